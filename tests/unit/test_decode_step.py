"""The decode step's cost paths: expert dispatch choice (blocked = ragged = dense, plain and quantized, skewed
routing, the capacity part with and without overflow), the compiled step holding no pool-sized copy or conversion
for any KV dtype (HLO check), the rows' page view the CPU attention reads through (same output as the whole pool,
integrity-masked and out-of-range rows included), and greedy sampling skipping the sort."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_matmul import quantize_int4
from pallas_kernels.mla_attention import mla_decode_attention
from pallas_kernels.paged_attention import paged_decode_attention
from phaseserve.cache.attend import PagedAttend, rows_view
from phaseserve.cache.integrity import IntegrityTracker
from phaseserve.cache.paged import as_stored, as_values, init_pool
from phaseserve.config import ModelConfig
from phaseserve.engine.decode_step import DecodeBatch, decode_step
from phaseserve.engine.sampling import _draw, sample
from phaseserve.model import moe as M
from phaseserve.model.params import init_params

S = 4
MOE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=16, scoring_func="sigmoid", norm_topk_prob=True,
           moe_layers=(False, True))
MLA = ModelConfig(architecture="DeepseekV3ForCausalLM", num_kv_heads=4, head_dim=12, attention="mla", kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **MOE)
GQA = ModelConfig(architecture="Qwen3MoeForCausalLM", num_kv_heads=2, head_dim=8, **MOE)


def _moe_inputs(cfg, n, seed):
    key = jax.random.key(seed)
    p = init_params(cfg, key).layers[1].mlp
    x = jax.random.normal(jax.random.fold_in(key, 1), (n, cfg.hidden_size))
    w, idx = M.route(p, cfg, x)
    return p, x, w, idx


@pytest.mark.parametrize("n", [1, 3, 16, 300])
def test_dispatches_agree(n):
    p, x, w, idx = _moe_inputs(MLA, n, seed=n)
    ref = M.ragged_experts(p, MLA, x, w, idx)[0]
    for d in (M.blocked_experts, M.dense_experts, M.auto_experts):
        np.testing.assert_allclose(d(p, MLA, x, w, idx)[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [5, 70, 300])
def test_blocked_experts_skewed_routing(n):
    """One expert takes most assignments (several blocks of it, the bound on blocks reached), others none."""
    p, x, w, _ = _moe_inputs(MLA, n, seed=n + 1)
    rng = np.random.default_rng(n)
    idx = np.stack([np.zeros(n, np.int32), rng.choice([3, 5], n).astype(np.int32)], axis=1)
    idx[::7, 0] = 6
    idx = jnp.asarray(idx)
    np.testing.assert_allclose(M.blocked_experts(p, MLA, x, w, idx)[0], M.dense_experts(p, MLA, x, w, idx)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [1, 3, 16, 200])
@pytest.mark.parametrize("skewed", [False, True])
def test_blocked_experts_capacity_part(cap, skewed):
    """The batched capacity part with and without overflow into the blocks (cap 1 and 3: most assignments overflow;
    16: some experts do; 200: none, the block loop runs zero times): the same output as every expert on every
    token."""
    n = 70
    p, x, w, idx = _moe_inputs(MLA, n, seed=cap)
    if skewed:
        idx = jnp.stack([jnp.zeros(n, jnp.int32), jnp.where(jnp.arange(n) % 3 == 0, 6, 2)], axis=1)
    np.testing.assert_allclose(M.blocked_experts(p, MLA, x, w, idx, cap=cap)[0], M.dense_experts(p, MLA, x, w, idx)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap,bt", [(3, 4), (5, 16), (0, 4)])
def test_blocked_experts_every_token_on_the_same_experts(cap, bt):
    """Every token picks the same k experts: each holds n assignments, the most overflow the static block bound
    allows for, in blocks of ``bt`` rows past the capacity."""
    n = 37
    p, x, w, _ = _moe_inputs(MLA, n, seed=cap + bt)
    idx = jnp.broadcast_to(jnp.array([4, 1], jnp.int32), (n, 2))
    np.testing.assert_allclose(M.blocked_experts(p, MLA, x, w, idx, cap=cap, bt=bt)[0],
                               M.dense_experts(p, MLA, x, w, idx)[0], rtol=1e-5, atol=1e-5)


def test_capacity_part_bounded_by_the_bytes_it_materializes(monkeypatch):
    """Float weights in the activations' dtype are read in place (nothing materialized); quantized stacks are
    expanded whole by the capacity part, so past ``CAPACITY_MAX_BYTES`` the dispatch keeps to the blocks."""
    p, x, w, idx = _moe_inputs(MLA, 300, seed=3)
    q = p.replace(w_gate=quantize_int4(p.w_gate, 8), w_up=quantize_int4(p.w_up, 8), w_down=quantize_int4(p.w_down, 8))
    assert M._stack_bytes(p, MLA, MLA.hidden_size, jnp.float32) == 0
    assert M._stack_bytes(q, MLA, MLA.hidden_size, jnp.float32) == 3 * 8 * 32 * 16 * 4
    assert M.default_cap(q, MLA, 300, MLA.hidden_size, jnp.float32) == M.capacity_rows(600, 8) > 0
    caps = []
    monkeypatch.setattr(M, "capacity_rows", lambda m, e: caps.append(m) or 0)
    monkeypatch.setattr(M, "CAPACITY_MAX_BYTES", 3 * 8 * 32 * 16 * 4 - 1)
    assert M.default_cap(q, MLA, 300, MLA.hidden_size, jnp.float32) == 0
    M.blocked_experts(q, MLA, x, w, idx)  # over the budget: capacity_rows not consulted
    M.blocked_experts(p, MLA, x, w, idx)  # float weights: consulted
    assert caps == [600]


def test_blocked_experts_int4_weights():
    p, x, w, idx = _moe_inputs(MLA, 2, seed=7)
    q = p.replace(w_gate=quantize_int4(p.w_gate, 8), w_up=quantize_int4(p.w_up, 8), w_down=quantize_int4(p.w_down, 8))
    for cap in (0, 1):  # blocks only; capacity part and blocks
        np.testing.assert_allclose(M.blocked_experts(q, MLA, x, w, idx, cap=cap)[0],
                                   M.dense_experts(q, MLA, x, w, idx)[0], rtol=1e-5, atol=1e-5)
    # the quantized weights are really used: the result differs from the float weights'
    assert not np.allclose(M.blocked_experts(q, MLA, x, w, idx)[0], M.blocked_experts(p, MLA, x, w, idx)[0],
                           atol=1e-6)


def test_choose_dispatch():
    for n in (1, 8, 4096):
        assert M.choose_dispatch(n, MLA, "cpu") is M.blocked_experts
    for backend in ("gpu", "tpu"):  # the ragged dispatch, its grouped matmuls run per the step's kernel dispatch
        d = M.choose_dispatch(1, MLA, backend)
        assert d.func is M.ragged_experts and d.keywords == {"kd": M.DIRECT}
    assert [M.block_rows(m, 16) for m in (2, 64, 8192)] == [4, 8, 128]
    assert [M.capacity_rows(m, 16) for m in (64, 255, 256, 1024, 8192)] == [0, 0, 24, 80, 640]


def _batch(cfg, b, pages_per_row, num_pages, rng):
    pt = rng.permutation(np.arange(1, num_pages))[: b * pages_per_row].reshape(b, pages_per_row).astype(np.int32)
    return DecodeBatch(tokens=rng.integers(0, cfg.vocab_size, b).astype(np.int32),
                       positions=rng.integers(1, pages_per_row * S, b).astype(np.int32), page_table=pt,
                       active=np.ones(b, bool), temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32),
                       top_p=np.ones(b, np.float32), seeds=np.arange(b, dtype=np.uint32), steps=np.zeros(b, np.int32),
                       want_logprobs=np.zeros(b, bool))


def _random_pool(cfg, num_pages, kv, seed):
    pool = init_pool(cfg, num_pages, S, kv)
    leaves, tree = jax.tree.flatten(pool)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [as_stored(jax.random.uniform(k, x.shape, minval=0.5, maxval=1.5)
                                               * jnp.where(jax.random.bernoulli(k, 0.5, x.shape), 1, -1), x.dtype)
                                     for k, x in zip(keys, leaves, strict=True)])


def pool_sized_ops(hlo: str, elements: set[int], ops: tuple[str, ...] = ("copy", "convert", "bitcast-convert")
                   ) -> list[str]:
    """Lines of ``ops`` instructions (anywhere, fused computations included) whose result has as many elements as a
    pool array."""
    pattern = re.compile(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*\w+\[([\d,]*)\]\S*\s+(" + "|".join(map(re.escape, ops))
                         + r")\(")
    bad = []
    for line in hlo.splitlines():
        m = pattern.match(line)
        if m and int(np.prod([int(d) for d in m.group(1).split(",") if d] or [1])) in elements:
            bad.append(line.strip()[:160])
    return bad


def _step_hlo(cfg, kv, b=3):
    num_pages = 97  # a size no weight has
    pool = init_pool(cfg, num_pages, S, kv)
    params = init_params(cfg, jax.random.key(0))
    batch = _batch(cfg, b, 4, num_pages, np.random.default_rng(0))
    step = jax.jit(lambda p, pool, b, ok: decode_step(p, cfg, pool, b, ok, tracker=IntegrityTracker),
                   donate_argnums=(1,))
    hlo = step.lower(params, pool, batch, jnp.ones(b, bool)).compile().as_text()
    return hlo, pool, {int(np.prod(x.shape)) for x in jax.tree.leaves(pool)}


@pytest.mark.parametrize("cfg,kv,b", [(MLA, "float32", 1), (GQA, "float32", 1), (MLA, "float32", 3),
                                      (MLA, "float8_e4m3fn", 1), (MLA, "float8_e4m3fn", 3), (GQA, "bfloat16", 3)],
                         ids=["mla-f32-b1", "gqa-f32-b1", "mla-f32-b3", "mla-fp8-b1", "mla-fp8-b3", "gqa-bf16-b3"])
def test_step_hlo_has_no_pool_sized_copy(cfg, kv, b):
    """No pool-sized ``copy``, ``convert`` or ``bitcast-convert`` anywhere in the compiled step, and every pool
    array updated in place (aliased input -> output). Batch 1 included: a one-row scatter became a
    dynamic-update-slice with whole-pool copies; FP8/BF16 pools held as FP8/BF16 on XLA:CPU were converted to f16
    (scatter) or materialized as raw bits (bitcast-convert) in full at every layer write."""
    hlo, pool, elements = _step_hlo(cfg, kv, b)
    assert pool_sized_ops(hlo, elements) == []
    aliases = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*\w+=", hlo)
    assert aliases is not None and aliases.group(1).count("may-alias") >= len(jax.tree.leaves(pool))


def test_pool_sized_ops_detects_a_whole_pool_conversion():
    """The check above can fail: a step that converts the pool is caught."""
    pool = init_pool(MLA, 97, S, "float8_e4m3fn")
    f = jax.jit(lambda x: x.latent.astype(jnp.float16)[1:3])
    hlo = f.lower(pool.layers[0]).compile().as_text()
    assert pool_sized_ops(hlo, {int(np.prod(pool.layers[0].latent.shape))})


@pytest.mark.parametrize("cfg", [MLA, GQA], ids=["mla", "gqa"])
@pytest.mark.parametrize("kv", ["float32", "float8_e4m3fn"])
def test_rows_view_reads_what_the_pool_holds(cfg, kv):
    rng = np.random.default_rng(3)
    num_pages, b = 23, 4
    pages = _random_pool(cfg, num_pages, kv, seed=5).layers[0]
    batch = _batch(cfg, b, 5, num_pages, rng)
    pt = np.array(batch.page_table)
    pt[1, 3] = num_pages + 4  # out of range: clipped, as the kernels do
    pt[2, 0] = -1
    lengths = jnp.asarray(rng.integers(1, 5 * S + 1, b), jnp.int32)
    view, vpt = rows_view(pages, jnp.asarray(pt))
    key = jax.random.key(1)
    if cfg.is_mla:
        ql = jax.random.normal(key, (b, cfg.num_heads, cfg.kv_lora_rank))
        qr = jax.random.normal(jax.random.fold_in(key, 1), (b, cfg.num_heads, cfg.qk_rope_head_dim))
        run = lambda p, t: mla_decode_attention(ql, qr, p.latent, t, lengths, scales=p.scale, sm_scale=0.3,  # noqa: E731
                                                 impl="reference")
    else:
        q = jax.random.normal(key, (b, cfg.num_heads, cfg.head_dim))
        run = lambda p, t: paged_decode_attention(q, p.k, p.v, t, lengths, k_scales=p.k_scale,  # noqa: E731
                                                  v_scales=p.v_scale, sm_scale=0.3, impl="reference")
    np.testing.assert_array_equal(run(view, vpt), run(jax.tree.map(as_values, pages), jnp.asarray(pt)))


def test_paged_attend_masked_row_reads_nothing():
    cfg, kv = MLA, "float8_e4m3fn"
    rng = np.random.default_rng(4)
    pool = _random_pool(cfg, 23, kv, seed=6)
    batch = _batch(cfg, 3, 5, 23, rng)
    ok = jnp.array([True, False, True])
    att = PagedAttend(jnp.asarray(batch.page_table), jnp.asarray(batch.positions), jnp.ones(3, bool), ok,
                      tracker=IntegrityTracker, sm_scale=0.3)
    ql = jax.random.normal(jax.random.key(2), (3, cfg.num_heads, cfg.kv_lora_rank))
    qr = jax.random.normal(jax.random.key(3), (3, cfg.num_heads, cfg.qk_rope_head_dim))
    lat = jax.random.normal(jax.random.key(4), (3, cfg.kv_cache_width))
    new, o = att(pool.layers[0], (ql, qr), lat)
    assert np.all(np.asarray(o[1]) == 0) and np.all(np.abs(np.asarray(o[0])) > 0)
    # the failing row wrote nothing: its pages are unchanged
    row1 = np.asarray(batch.page_table)[1]
    np.testing.assert_array_equal(np.asarray(new.latent[row1].astype(jnp.float32)),
                                  np.asarray(pool.layers[0].latent[row1].astype(jnp.float32)))


def test_sampling_greedy_skips_the_draw_and_mixed_rows_match():
    rng = np.random.default_rng(9)
    b, v = 6, 50
    logits = jnp.asarray(rng.standard_normal((b, v)), jnp.float32)
    temp = jnp.asarray([0, 0.7, 0, 1.3, 0, 0.9], jnp.float32)
    top_k, top_p = jnp.asarray([0, 5, 0, 0, 3, 0], jnp.int32), jnp.asarray([1, 1, 1, 0.8, 1, 0.9], jnp.float32)
    seeds, steps = jnp.arange(b, dtype=jnp.uint32) + 11, jnp.arange(b, dtype=jnp.int32)
    out = np.asarray(sample(logits, temp, top_k, top_p, seeds, steps))
    drawn = np.asarray(_draw(logits, temp, top_k, top_p, seeds, steps))
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    hot = np.asarray(temp) > 0
    np.testing.assert_array_equal(out[~hot], greedy[~hot])
    np.testing.assert_array_equal(out[hot], drawn[hot])
    zeros = jnp.zeros(b, jnp.float32)
    np.testing.assert_array_equal(sample(logits, zeros, top_k, top_p, seeds, steps), greedy)
    # all-greedy: the sort sits in the untaken branch of a cond
    jaxpr = jax.make_jaxpr(sample)(logits, zeros, top_k, top_p, seeds, steps)
    top = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "cond" in top and "sort" not in top


def test_width_bucket_covers_the_pages_and_wastes_at_most_a_third():
    """The decode page-table width: at least the live pages, less than a third of what attention reads is padding
    above the floor of 4 (a power of two: up to a half), monotone, and few distinct widths (each one is a compile)."""
    from phaseserve.engine.shapes import bucket, width_bucket

    widths = [width_bucket(n) for n in range(1, 1025)]
    assert all(w >= n for n, w in enumerate(widths, 1)) and widths == sorted(widths)
    assert all(w == 4 for w in widths[:4])
    assert max((w - n) / w for n, w in enumerate(widths, 1) if n > 4) < 1 / 3
    assert max((bucket(n, 4) - n) / bucket(n, 4) for n in range(5, 1025)) > 0.49  # the power-of-two rule it replaces
    assert len(set(widths)) <= 2 * len({bucket(n, 4) for n in range(1, 1025)})


def test_row_bucket_pads_a_decode_batch_by_at_most_a_third_above_8_rows():
    """Decode rows: powers of two up to 8, then at most a third of the padded rows is padding (a power of two: up to
    half, 17 rows run as 32), monotone, and every padded size is one :func:`decode_shapes` lists for warm-up."""
    from types import SimpleNamespace

    from phaseserve.engine.shapes import bucket, decode_shapes, row_bucket

    rows = [row_bucket(n) for n in range(1, 257)]
    assert rows[:8] == [1, 2, 4, 4, 8, 8, 8, 8] and row_bucket(17) == 24 and row_bucket(25) == 32
    assert all(b >= n for n, b in enumerate(rows, 1)) and rows == sorted(rows)
    assert max((b - n) / b for n, b in enumerate(rows, 1) if n > 8) < 1 / 3
    assert len(set(rows)) <= 2 * len({bucket(n) for n in range(1, 257)})
    for max_rows in (1, 5, 20, 32, 100):
        listed = {b for b, _ in decode_shapes(SimpleNamespace(page_table=np.zeros((1, 8), np.int32)), max_rows, 8)}
        assert listed == {row_bucket(n) for n in range(1, max_rows + 1)}, max_rows


@pytest.mark.parametrize("weights", ["float32", "all-fp8"])
def test_moe_dispatch_benchmark_point(weights):
    """The side-by-side benchmark of the capacity part: both arms timed every repeat, the same output, and the
    capacity arm really uses the capacity part at this size (cap > 0) while the blocks arm does not."""
    from lab.bench import moe_dispatch

    r = moe_dispatch.measure(MLA, 300, repeats=2, weights=weights)
    assert r["cap"] == M.capacity_rows(600, MLA.num_experts) > 0 and r["moe_layers"] == 1
    assert len(r["ms"]["blocks"]) == len(r["ms"]["capacity"]) == len(r["ms"]["capacity_wide"]) == len(r["ratio"]) == 2
    assert all(t > 0 for t in r["ms"]["blocks"] + r["ms"]["capacity"]) and r["rel_diff"] < 1e-5
    assert r["overflow_rows"] == min(r["block_rows"], M.OVERFLOW_BLOCK_ROWS) and len(r["ratio_wide"]) == 2
    md = moe_dispatch.markdown({"label": "t", "repeats": 2, "weights": weights, "rows": [{"model": "mla", **r}],
                                "environment": {"load_average_1m_5m_15m": [0, 0, 0]}})
    assert f"| mla | 300 | {r['cap']} | {r['block_rows']} | {r['overflow_rows']} |" in md
    assert f"Weights: {weights}" in md
