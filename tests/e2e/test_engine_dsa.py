"""GLM-5 DeepSeek Sparse Attention served by the engine: greedy tokens equal transformers' ``generate`` (float32,
eager, its own indexer cache) for generations running well past ``index_topk``, colocated and disaggregated, with
and without ``indexer_types`` sharing, with chunked prefill; the pool holds the index keys the planner counts."""

from __future__ import annotations

import pytest

import phaseserve as ps
from phaseserve.cache import paged
from tests.e2e.engine_utils import hf_greedy, random_requests, serve_config
from tests.parity.hf_models import build, dsa_config


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
