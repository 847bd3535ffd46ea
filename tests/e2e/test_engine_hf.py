"""Greedy decoding through the engine (float32 weights and KV) equals Hugging Face ``generate`` token for token,
for a GQA and an MLA model, in both modes, with requests of different lengths joining and leaving the batch."""

from __future__ import annotations

import pytest

import phaseserve as ps
from tests.e2e.engine_utils import hf_greedy, make_checkpoint, random_requests, serve_config


@pytest.fixture(scope="module", params=["qwen3_moe_norm", "deepseek_v3_grouped"])
def model(request, tmp_path_factory):
    hf, cfg, params = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    reqs = random_requests(cfg.vocab_size, 7, seed=11)
    return hf, cfg, params, reqs, [hf_greedy(hf, r) for r in reqs]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_engine_matches_hf_generate(model, mode):
    _, cfg, params, reqs, expected = model
    engine = ps.Engine(cfg, params, serve_config(mode=mode, max_batch=3))
    outs = engine.generate(reqs)
    for r, o, e in zip(reqs, outs, expected, strict=True):
        assert o.finish_reason == "length", (r.id, o.finish_reason, o.error)
        assert o.tokens == e, f"{mode} {r.id}: engine {o.tokens} vs transformers {e}"
    s = engine.summary()
    assert s["peak_concurrency"] == 3  # requests really shared the batch (and joined/left it)
    assert engine.allocator.num_free == engine.num_pages - 1  # drained: every page free again
    engine.check_invariants()
