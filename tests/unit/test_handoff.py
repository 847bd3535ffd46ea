"""The handoff's power-of-two chunks: exact pages cross (no padding), chunk payloads join and split back to the
same arrays, and after ``Engine.warm_handoff`` no page count compiles anything (before it, new counts did)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import phaseserve as ps
from lab.bench.measure import CompileCounter
from phaseserve.config import ModelConfig
from phaseserve.engine.handoff import join_chunks, page_chunks, split_chunks
from phaseserve.sharding import replicated
from tests.e2e.engine_utils import F32


@given(st.integers(0, 5000))
def test_page_chunks_are_distinct_powers_of_two_summing_to_n(n):
    sizes = page_chunks(n)
    assert sum(sizes) == n and sizes == sorted(set(sizes), reverse=True)
    assert all(s & (s - 1) == 0 for s in sizes)


@pytest.mark.parametrize("n", [1, 5, 11])
def test_join_then_split_gives_the_chunks_back(n):
    rng = np.random.default_rng(n)
    chunks = [[(rng.normal(size=(1, s * 4, 3)).astype(np.float32), rng.normal(size=(1, s * 4)).astype(np.float32))]
              for s in page_chunks(n)]
    joined = join_chunks(chunks)
    assert joined[0][0].shape == (1, n * 4, 3)
    back = split_chunks(joined, page_size=4)
    assert jax.tree.structure(back) == jax.tree.structure(chunks)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(chunks), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


GQA = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, moe_layers=(False, True))


@pytest.fixture(scope="module")
def engine():
    serve = ps.ServeConfig(mode="disaggregated", quant=F32, max_batch=2,
                           cache=ps.CacheConfig(page_size=4, num_pages=40, max_pages_per_seq=12))
    eng = ps.Engine(GQA, ps.init_params(GQA, jax.random.key(0)), serve)
    leaves, tree = jax.tree.flatten(eng.prefill.pool)  # fresh random KV in every prefill page
    keys = jax.random.split(jax.random.key(1), len(leaves))
    eng.prefill.pool = jax.tree.unflatten(tree, [jax.device_put(jax.random.normal(k, x.shape, x.dtype), x.sharding)
                                                 for k, x in zip(keys, leaves, strict=True)])
    return eng


def _page_values(pool, pages: list[int]) -> list[np.ndarray]:
    """Every layer's KV rows of ``pages`` (float32 pools: the stored values)."""
    return [np.asarray(x)[np.asarray(pages)] for layer in pool.layers for x in jax.tree.leaves(layer)]


def test_export_then_land_moves_exactly_the_pages(engine):
    src, dst = [3, 7, 1, 9, 2, 5, 11, 4, 6, 8, 10], [12, 14, 13, 15, 16, 17, 18, 19, 20, 21, 22]
    chunks = engine.prefill.export(src)
    assert [jax.tree.leaves(c)[0].shape[1] for c in chunks] == [8 * 4, 2 * 4, 1 * 4]  # 11 pages: 8 + 2 + 1, no padding
    untouched = _page_values(engine.decode.pool, [23, 24, 30])
    engine.decode.land(dst, jax.device_put(chunks, replicated(engine.decode_mesh)))
    for got, want in zip(_page_values(engine.decode.pool, dst), _page_values(engine.prefill.pool, src), strict=True):
        np.testing.assert_array_equal(got, want)  # page src[i] landed in dst[i], every layer
    for got, want in zip(_page_values(engine.decode.pool, [23, 24, 30]), untouched, strict=True):
        np.testing.assert_array_equal(got, want)  # and nothing else was written


def test_after_warm_handoff_no_page_count_compiles(engine):
    sizes = engine.warm_handoff()
    assert sizes == len(page_chunks((1 << (engine.prefill.num_pages - 1).bit_length()) - 1))
    before = CompileCounter.count()
    for n in range(1, engine.prefill.num_pages):
        engine.decode.land([0] * n, jax.device_put(engine.prefill.export(list(range(1, n + 1))),
                                                   replicated(engine.decode_mesh)))
    assert CompileCounter.count() == before
