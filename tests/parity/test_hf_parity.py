"""``ps.forward`` against Hugging Face transformers in float32 on tiny random checkpoints of every
supported architecture (YaRN, Llama-3 rope, group-limited routing, norm_topk_prob both ways, partial
rotary, q/k norm, attention biases, tied embeddings, q LoRA on and off, GLM-5 DSA within index_topk; past it:
test_dsa_parity): the fixed variants of :mod:`tests.parity.hf_models`, and shapes drawn per architecture
(:mod:`tests.parity.shapes`: head counts and GQA groups, head dims, LoRA ranks, nope/rope/v dims, hidden and expert
sizes, routing groups, layer counts) so that a shape-specific bug cannot hide behind one family."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import phaseserve as ps
from tests.parity.hf_models import VARIANTS, build
from tests.parity.shapes import ARCHITECTURES, parity_settings

SHAPES = [(1, 1), (2, 7), (3, 19)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = build(request.param, d, seed=hash(request.param) % 1000)
    return request.param, d, model


def test_forward_matches_transformers(checkpoint):
    name, d, model = checkpoint
    cfg, params = ps.load_checkpoint(d, dtype="float32")
    rng = np.random.default_rng(1)
    for b, t in SHAPES:
        tokens = rng.integers(0, cfg.vocab_size, (b, t))
        with torch.no_grad():
            ref = model(torch.tensor(tokens)).logits.numpy()
        out = np.asarray(ps.forward(params, cfg, jnp.asarray(tokens, jnp.int32)))
        assert out.shape == ref.shape
        scale = np.abs(ref).max()
        assert scale > 0.1, f"{name}: degenerate logits"
        err = np.abs(out - ref).max() / scale
        assert err < 1e-4, f"{name} B={b} T={t}: max abs diff {err:.2e} relative to logit scale"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@given(data=st.data(), seed=st.integers(0, 2**16))
@parity_settings(3)
def test_drawn_shapes_match_transformers(tmp_path_factory, arch, data, seed):
    """Drawn shapes of each architecture, one batch of drawn size (GLM-5 within index_topk: dense attention)."""
    config = data.draw(ARCHITECTURES[arch](), label="config")
    d = tmp_path_factory.mktemp(arch)
    model = build(config, d, seed=seed)
    cfg, params = ps.load_checkpoint(d, dtype="float32")
    b = data.draw(st.integers(1, 3), label="batch")
    t = data.draw(st.integers(1, min(24, cfg.index_topk or 24)), label="tokens")
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    out = np.asarray(ps.forward(params, cfg, jnp.asarray(tokens, jnp.int32)))
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"{arch} {config.to_dict()} B={b} T={t}: max abs diff {err:.2e} relative to logit scale"


def test_config_features_are_exercised(checkpoint):
    """The variants really cover the features they are named after (guards against silent config drift)."""
    name, d, _ = checkpoint
    cfg, _ = ps.load_checkpoint(d)
    expect = {
        "deepseek_v3_grouped": lambda c: c.is_mla and c.n_group == 4 and c.topk_group == 2 and c.q_lora_rank,
        "deepseek_v3_yarn_noqlora": lambda c: c.rope.kind == "yarn" and c.q_lora_rank is None
        and not c.norm_topk_prob and c.rope.interleave,
        "glm4_moe_partial_bias": lambda c: c.rope.partial_rotary_factor == 0.5 and c.attention_bias
        and c.rotary_dim == 8,
        "glm4_moe_qknorm": lambda c: c.qk_norm and not c.norm_topk_prob,
        "qwen3_tied": lambda c: c.qk_norm and c.tie_word_embeddings,
        "qwen3_moe_nonorm_sparse_step": lambda c: c.moe_layers == (False, True, False) and not c.norm_topk_prob,
        "qwen3_moe_norm": lambda c: c.norm_topk_prob and c.scoring_func == "softmax",
        "llama_tied_llama3rope": lambda c: c.rope.kind == "llama3" and c.tie_word_embeddings,
        "llama": lambda c: c.attention == "gqa" and not c.is_moe,
        "glm_moe_dsa": lambda c: c.index_topk == 32 and c.is_mla,
    }
    assert expect[name](cfg), f"{name}: {cfg}"

