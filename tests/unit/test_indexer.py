"""The DSA prefill is memory-linear in T: no intermediate of the blockwise sparse attention grows as T x T (traced,
not run), and the selection it makes equals a plain dense top-k over the full score matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.config import ModelConfig
from phaseserve.model import indexer
from phaseserve.presets import preset

CFG = ModelConfig.from_hf_config(preset("tiny-mla-moe")).replace(index_topk=64, index_n_heads=4, index_head_dim=16)


def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", p)
            if hasattr(sub, "eqns"):
                yield from _avals(sub)


def _inputs(t: int, rng):
    b, h, r, rope, w = 1, CFG.num_heads, CFG.kv_lora_rank, CFG.qk_rope_head_dim, CFG.kv_cache_width
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    return (f(b, t, h, r), f(b, t, h, rope), f(b, t, w), pos,
            (f(b, t, CFG.index_n_heads, CFG.index_head_dim), f(b, t, CFG.index_n_heads), f(b, t, CFG.index_head_dim)))


def test_no_intermediate_grows_quadratically():
    sizes = {}
    for t in (1024, 4096):
        args = _inputs(t, np.random.default_rng(0))
        fn = lambda ql, qr, lat, pos, index: indexer.sparse_prefill(CFG, ql, qr, lat, pos, None, 0.1,  # noqa: E731
                                                                      index=index)
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        sizes[t] = max(int(np.prod(a.shape)) for a in _avals(jaxpr) if hasattr(a, "shape"))
    assert sizes[4096] <= 4.5 * sizes[1024], sizes  # 4x the tokens: at most ~4x the largest buffer (T x T: 16x)
    assert sizes[4096] < 4096 * 4096, sizes


def test_blockwise_selection_equals_dense_topk():
    t = 300  # not a multiple of the query block
    ql, qr, lat, pos, (q, w, k) = _inputs(t, np.random.default_rng(1))
    _, sel = indexer.sparse_prefill(CFG, ql, qr, lat, pos, None, 0.1, index=(q, w, k), block=64)
    dense = np.asarray(indexer.select(indexer.index_scores(q, w, k), pos, None, CFG.index_topk))
    sel = np.asarray(sel)
    assert sel.shape == (1, t, CFG.index_topk)
    for i in range(CFG.index_topk, t):  # queries with more visible keys than index_topk
        assert set(sel[0, i]) == set(dense[0, i])


def test_indexer_types_follow_transformers_config():
    """``indexer_types`` as transformers' ``GlmMoeDsaConfig`` derives it (freq/offset schedule and "FS" pattern),
    and cut with the layers when a config is cut to fewer layers."""
    import transformers as T

    base = dict(preset("glm-5"), num_hidden_layers=7)
    for kw in ({"index_topk_freq": 2, "index_skip_topk_offset": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
               {"index_topk_pattern": "FSSFSFF"}, {}):
        ref = T.GlmMoeDsaConfig(num_hidden_layers=7, **kw).indexer_types
        assert list(ModelConfig.from_hf_config({**base, **kw}).indexer_types) == ref, kw
    cut = ModelConfig.from_hf_config({**base, "num_hidden_layers": 3, "indexer_types": ["full", "shared"] * 39})
    assert cut.indexer_types == ("full", "shared", "full")
