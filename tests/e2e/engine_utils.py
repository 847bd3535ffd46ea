"""Shared helpers for engine tests: tiny HF checkpoints, float32 serve configs, HF greedy references."""

from __future__ import annotations

import numpy as np
import torch

import phaseserve as ps
from phaseserve.engine import Request
from tests.parity.hf_models import build, dsa_topk

F32 = ps.QuantConfig(prefill_weights="float32", decode_weights="float32", kv_dtype="float32",
                     prefill_kv_dtype="float32")


def serve_config(mode: str = "disaggregated", quant: ps.QuantConfig = F32, num_pages: int = 96, page_size: int = 4,
                 max_batch: int = 4, admission: str = "reserve", integrity: bool = True, prefix_caching: bool = True,
                 retain_prefixes: bool = False, **kw) -> ps.ServeConfig:
    return ps.ServeConfig(mode=mode, quant=quant, max_batch=max_batch,
                          cache=ps.CacheConfig(page_size=page_size, num_pages=num_pages, max_pages_per_seq=16,
                                               admission=admission, integrity=integrity,
                                               prefix_caching=prefix_caching, retain_prefixes=retain_prefixes),
                          **kw)


def make_checkpoint(variant: str, directory, seed: int = 0):
    model = build(variant, directory, seed=seed)
    cfg, params = ps.load_checkpoint(directory, dtype="float32")
    return model, cfg, params


def random_requests(vocab: int, n: int, seed: int = 0, min_len: int = 1, max_len: int = 13,
                    max_tokens=(3, 11)) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        out.append(Request(id=f"r{i}", prompt=rng.integers(0, vocab, length).tolist(),
                           max_tokens=int(rng.integers(*max_tokens)), ignore_eos=True))
    return out


def hf_greedy(model, req: Request) -> list[int]:
    """transformers' own ``generate`` (greedy, no eos) for one request; a GLM-5 model's DSA indexers take the
    earliest of exactly tied keys, phaseserve's order (``torch.topk`` leaves it unspecified:
    ``tests.parity.test_dsa_parity``)."""
    ids = torch.tensor([req.prompt])
    with torch.no_grad(), dsa_topk():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(req.prompt):].tolist()
