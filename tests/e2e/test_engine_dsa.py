"""GLM-5 DeepSeek Sparse Attention served by the engine: greedy tokens equal transformers' ``generate`` (float32,
eager, its own indexer cache, the tie order of ``tests.parity.hf_models.dsa_topk``) for generations running well past
``index_topk``, colocated and disaggregated, with and without ``indexer_types`` sharing, with chunked prefill, on
fixed and drawn shapes, and through the Pallas sparse decode kernel; the pool holds the index keys the planner
counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import phaseserve as ps
from phaseserve.cache import paged
from tests.e2e.engine_utils import hf_greedy, random_requests, serve_config
from tests.parity.hf_models import build, dsa_config
from tests.parity.shapes import glm5, parity_settings


@pytest.fixture(scope="module", params=[(8, None), (8, ["full", "shared", "full"])], ids=["full", "shared"])
def dsa(request, tmp_path_factory):
    topk, types = request.param
    d = tmp_path_factory.mktemp("dsa")
    model = build(dsa_config(topk, types), d, seed=5, attn_implementation="eager")
    cfg, params = ps.load_checkpoint(d, dtype="float32")
    return model, cfg, params


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_greedy_tokens_equal_transformers_past_index_topk(dsa, mode):
    model, cfg, params = dsa
    k = cfg.index_topk
    # prompts from shorter than index_topk to 3x it; every generation ends past 3x index_topk
    reqs = random_requests(cfg.vocab_size, 4, seed=11, min_len=k - 3, max_len=3 * k, max_tokens=(3 * k, 3 * k + 1))
    engine = ps.Engine(cfg, params, serve_config(mode, num_pages=160))
    outs = {o.id: o for o in engine.generate(reqs)}
    for r in reqs:
        assert len(r.prompt) + r.max_tokens > 3 * k
        assert outs[r.id].error is None and outs[r.id].finish_reason == "length"
        assert outs[r.id].tokens == hf_greedy(model, r), f"{mode} {r.id} (prompt {len(r.prompt)})"


def test_pool_holds_the_index_keys_the_planner_counts(dsa):
    _, cfg, _ = dsa
    pool = paged.init_pool(cfg, 10, 4, "float8_e4m3fn")
    full = sum(t == "full" for t in cfg.indexer_types)
    assert sum(lay.index is not None for lay in pool.layers) == full
    per_token = paged.kv_bytes_per_token(cfg, "float8_e4m3fn")
    assert per_token == cfg.num_layers * (cfg.kv_cache_width + 4) + full * (cfg.index_head_dim + 4)
    assert paged.pool_nbytes(pool) == 10 * 4 * per_token


def test_chunked_prefill_selects_over_cached_index_keys(dsa):
    """Prompts prefilled 7 tokens per step: each chunk scores the index keys already in the request's pages (past
    index_topk) and equals transformers."""
    model, cfg, params = dsa
    reqs = random_requests(cfg.vocab_size, 3, seed=11, min_len=2 * cfg.index_topk - 2, max_len=3 * cfg.index_topk,
                           max_tokens=(12, 13))
    outs = ps.Engine(cfg, params, serve_config("disaggregated", num_pages=160, max_prefill_tokens=7)).generate(reqs)
    for r, o in zip(reqs, outs, strict=True):
        assert o.error is None and o.tokens == hf_greedy(model, r), r.id


def _serve_like_transformers(model, cfg, params, reqs, label: str, **engine_kw) -> ps.Engine:
    """Every path of the engine: colocated, disaggregated with chunked prefill (5 tokens a step over the cached
    index keys), each decode step selecting over the paged index keys; greedy tokens equal transformers'."""
    want = {r.id: hf_greedy(model, r) for r in reqs}
    for mode, kw in (("colocated", {}), ("disaggregated", {"max_prefill_tokens": 5})):
        engine = ps.Engine(cfg, params, serve_config(mode, num_pages=160, **kw), **engine_kw)
        for o in engine.generate(reqs):
            assert o.error is None and o.tokens == want[o.id], f"{label} {mode} {o.id}"
    return engine


@given(config=glm5(topk_max=12), seed=st.integers(0, 2**16))
@parity_settings(2)
def test_drawn_shapes_serve_like_transformers(tmp_path_factory, config, seed):
    """Drawn GLM-5 shapes (index dims and heads, ranks, head dims, indexer_types): prompts from under index_topk to
    twice it, generations well past it."""
    d = tmp_path_factory.mktemp("dsa_drawn")
    model = build(config, d, seed=seed, attn_implementation="eager")
    cfg, params = ps.load_checkpoint(d, dtype="float32")
    k = cfg.index_topk
    reqs = random_requests(cfg.vocab_size, 3, seed=seed, min_len=max(1, k - 2), max_len=2 * k,
                           max_tokens=(k + 2, k + 4))
    _serve_like_transformers(model, cfg, params, reqs, str(config.to_dict()))


@given(config=glm5(topk_max=10, kv_lora_rank=128, rope=16), seed=st.integers(0, 2**16))
@parity_settings(1)
def test_sparse_decode_kernel_serves_like_transformers(tmp_path_factory, config, seed):
    """The Pallas sparse MLA decode kernel (interpret mode) inside the engine, on a drawn shape whose latent it takes
    (kv_lora_rank 128, rope 16): the same greedy tokens as transformers."""
    d = tmp_path_factory.mktemp("dsa_kernel")
    model = build(config, d, seed=seed, attn_implementation="eager")
    cfg, params = ps.load_checkpoint(d, dtype="float32")
    k = cfg.index_topk
    reqs = random_requests(cfg.vocab_size, 2, seed=seed, min_len=k, max_len=2 * k, max_tokens=(k + 2, k + 3))
    engine = _serve_like_transformers(model, cfg, params, reqs, str(config.to_dict()), attn_impl="pallas")
    built = {(row["phase"], row["op"]): row["impl"] for row in engine.summary()["kernels"]}
    assert built[("decode", "sparse_mla_decode_attention")] == "pallas", built
