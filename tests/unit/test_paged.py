"""Device page pool: FP8 round-trip error bounds, prompt and decode writes (ragged lengths, page boundaries,
masked / padding / corrupt rows write nothing), gathers back, scrubbing, and memory accounting vs hand counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import phaseserve as ps
from phaseserve.cache import paged
from phaseserve.config import ModelConfig

S = 4  # page size
GQA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48)
MLA = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=12, intermediate_size=48, attention="mla", kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
DTYPES = ["float32", "bfloat16", "float8_e4m3fn"]


def rand(rng, shape, spread=True):
    """Random bf16-representable values, with token magnitudes spread over ~6 orders of magnitude."""
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x *= np.exp(rng.uniform(-7, 7, shape[:-1]))[..., None].astype(np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def rand_kv(cfg, rng, b, t):
    if cfg.is_mla:
        return [rand(rng, (b, t, cfg.kv_cache_width)) for _ in range(cfg.num_layers)]
    return [tuple(rand(rng, (b, t, cfg.num_kv_heads, cfg.head_dim)) for _ in range(2)) for _ in range(cfg.num_layers)]


def ref_roundtrip(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Independent numpy reference of store-then-load."""
    if kv_dtype != "float8_e4m3fn":
        return x.astype(ps.config.to_dtype(kv_dtype)).astype(np.float32)
    scale = np.maximum(np.abs(x).max(-1) / 448.0, 1e-12).astype(np.float32)
    q = np.clip(x / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * scale[..., None]


def assert_stored(got: np.ndarray, x: np.ndarray, kv_dtype: str) -> None:
    """got == store-then-load of x. FP8: XLA and numpy may differ in the last bit of the scale, so a value next to
    a rounding boundary can land one e4m3 code away; allow that for under 1% of the elements, nothing more."""
    want = ref_roundtrip(x, kv_dtype)
    if kv_dtype != "float8_e4m3fn":
        np.testing.assert_array_equal(got, want)
        return
    s = np.maximum(np.abs(x).max(-1, keepdims=True) / 448.0, 1e-12)
    off = ~np.isclose(got, want, rtol=1e-5, atol=0)
    assert off.mean() < 0.01, off.mean()
    assert (np.abs(got - want) <= 2.0**-3 * np.abs(want) + 2.0**-9 * s)[off].all()


# ---- quantization ---------------------------------------------------------------------------------------
def test_fp8_roundtrip_within_e4m3_bounds():
    rng = np.random.default_rng(0)
    x = rand(rng, (512, 8, 128))
    q, scale = paged.quantize_kv(jnp.asarray(x), jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (512, 8)
    y = np.asarray(paged.dequantize_kv(q, scale))
    s = np.asarray(scale)[..., None]
    err = np.abs(y - x)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2**-4 for normals; subnormal half-spacing 2**-10 (x scale)
    assert (err <= 2.0**-4 * np.abs(x) + 2.0**-10 * s).all()
    big = np.abs(x) >= 2.0**-6 * s
    rel = err[big] / np.abs(x[big])
    assert 0.03 < rel.max() <= 0.0625, rel.max()  # the worst case is reached, never exceeded
    norm_rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
    assert norm_rel.max() < 0.04 and norm_rel.mean() < 0.03, (norm_rel.max(), norm_rel.mean())
    # the absmax element of each token maps exactly onto +-448
    assert np.allclose(np.abs(np.asarray(q, np.float32)).max(-1), 448.0)
    assert_stored(y, x, "float8_e4m3fn")


def test_fp8_never_nan_from_finite_input_and_never_zero_scale():
    rng = np.random.default_rng(1)
    x = rand(rng, (6, 64))
    x[0] = 0.0  # all-zero token
    x[1] = 0.0
    x[1, 5] = 3e38  # near f32 max
    x[2] *= 1e-38  # subnormal-ish tiny token
    x[3, :] = -1e-45  # f32 denormals
    x[4] = rng.choice([-3e38, 3e38, 1e-30, 0.0], 64)
    q, scale = paged.quantize_kv(jnp.asarray(x), jnp.float8_e4m3fn)
    y = np.asarray(paged.dequantize_kv(q, scale))
    assert np.isfinite(np.asarray(q, np.float32)).all() and np.isfinite(y).all()
    assert (np.asarray(scale) > 0).all() and np.isfinite(np.asarray(scale)).all()
    assert (y[0] == 0).all() and y[1, 5] == pytest.approx(3e38, rel=0.07)


def test_non_fp8_dtypes_store_a_plain_cast():
    x = rand(np.random.default_rng(2), (5, 16))
    for name in ("float32", "bfloat16"):
        q, scale = paged.quantize_kv(jnp.asarray(x), ps.config.to_dtype(name))
        assert scale is None
        np.testing.assert_array_equal(np.asarray(paged.dequantize_kv(q, scale)), ref_roundtrip(x, name))


# ---- writes and gathers ---------------------------------------------------------------------------------
def page_rows(rng, num_pages, lengths, p):
    """Disjoint shuffled pages for each row, 0-padded to p entries."""
    perm = list(rng.permutation(np.arange(1, num_pages)))
    pt = np.zeros((len(lengths), p), np.int32)
    for b, n in enumerate(lengths):
        k = -(-n // S)
        pt[b, :k] = [perm.pop() for _ in range(k)]
    return pt


def leaves(pool):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(pool)]


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_cpu_pools_hold_raw_bits_and_read_back_values(kv_dtype):
    """On XLA:CPU BF16/FP8 pools hold raw uint16/uint8 bits (written in place); reads give the values back, and
    the accelerators keep the value dtype."""
    dt = jnp.dtype(ps.config.to_dtype(kv_dtype))
    raw = paged.storage_dtype(kv_dtype, "cpu")
    assert raw == (dt if dt.itemsize == 4 else jnp.dtype(f"uint{8 * dt.itemsize}"))
    assert paged.storage_dtype(kv_dtype, "gpu") == dt and paged.value_dtype(raw) == dt
    pool = paged.init_pool(MLA, 6, S, kv_dtype)
    assert pool.layers[0].latent.dtype == raw
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, MLA.kv_cache_width)), jnp.float32)
    stored = paged.as_stored(x, raw)
    assert stored.dtype == raw
    np.testing.assert_array_equal(np.asarray(paged.as_values(stored), np.float32),
                                  np.asarray(x.astype(dt), np.float32))


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_prompt_write_then_gather_round_trips(cfg, kv_dtype):
    rng = np.random.default_rng(3)
    n_pages, p = 16, 4
    lengths = np.array([1, S, 2 * S + 3], np.int32)  # length 1, exact page boundary, ragged
    pt = page_rows(rng, n_pages, lengths, p)
    kvs = rand_kv(cfg, rng, 3, 3 * S)
    pool0 = paged.init_pool(cfg, n_pages, S, kv_dtype)
    pool = jax.jit(paged.write_prompt)(pool0, kvs, jnp.asarray(pt), jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        got = paged.gather_request(pool, pt[b], int(n))
        for lay, want in zip(got, kvs, strict=True):
            for g, w in zip(jax.tree.leaves(lay), jax.tree.leaves(want), strict=True):
                assert_stored(np.asarray(g), w[b, :n], kv_dtype)
    # pages outside every table (and the null page) are untouched; slots past each length too
    used = set(pt[pt > 0].tolist())
    for before, after in zip(leaves(pool0), leaves(pool), strict=True):
        untouched = [i for i in range(n_pages) if i not in used]
        np.testing.assert_array_equal(before[untouched], after[untouched])
        last = pt[2, 2]  # third page of row 2 holds 3 tokens
        np.testing.assert_array_equal(before[last, 3:], after[last, 3:])


def test_prompt_start_skips_the_shared_prefix():
    rng = np.random.default_rng(4)
    pt = page_rows(rng, 8, [3 * S], 3)
    kvs = rand_kv(MLA, rng, 1, 3 * S)
    pool0 = paged.init_pool(MLA, 8, S, "float8_e4m3fn")
    pool = paged.write_prompt(pool0, kvs, jnp.asarray(pt), jnp.asarray([3 * S]), start=jnp.asarray([S + 1]))
    lat = np.asarray(paged.gather_request(pool, pt[0], 3 * S)[0])
    assert (lat[: S + 1] == 0).all()
    assert_stored(lat[S + 1:], kvs[0][0, S + 1:], "float8_e4m3fn")


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_decode_write_masked_padding_and_corrupt_rows_write_nothing(cfg):
    rng = np.random.default_rng(5)
    n_pages = 12
    full = jnp.arange(1, n_pages, dtype=jnp.int32)[None]  # fill every real page with random content first
    pool0 = paged.write_prompt(paged.init_pool(cfg, n_pages, S, "float8_e4m3fn"),
                               rand_kv(cfg, rng, 1, (n_pages - 1) * S), full, jnp.asarray([(n_pages - 1) * S]))
    pt = np.array([[3, 7, 0], [5, 0, 0], [9, 2, 0], [0, 0, 0], [n_pages + 2, 0, 0], [-1, 0, 0], [4, 0, 0]],
                  np.int32)
    pos = np.array([S, S - 1, 0, 0, 1, 1, 3 * S], np.int32)  # page boundary, last slot, slot 0, .., past table
    mask = np.array([True, True, False, True, True, True, True])  # row 2: integrity-failed; row 3: padding
    new = jax.tree.map(lambda x: x[:, 0], rand_kv(cfg, rng, 7, 1))
    pool = jax.jit(paged.write_token)(pool0, new, jnp.asarray(pt), jnp.asarray(pos), jnp.asarray(mask))
    written = {(7, 0): 0, (5, S - 1): 1}  # (page, slot) -> row
    for before, after in zip(leaves(pool0), leaves(pool), strict=True):
        diff = np.argwhere((before != after).reshape(n_pages, S, -1).any(-1))
        assert {tuple(d) for d in diff.tolist()} <= set(written), diff
    for lay, want in zip(pool.layers, new, strict=True):
        got = paged.gather_layer(lay, jnp.asarray(pt[:2]))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_stored(np.asarray(g)[0, S], w[0], "float8_e4m3fn")
            assert_stored(np.asarray(g)[1, S - 1], w[1], "float8_e4m3fn")
    for before, after in zip(leaves(pool0), leaves(pool), strict=True):
        np.testing.assert_array_equal(before[0], after[0])  # null page never written


def test_incremental_decode_equals_prompt_write():
    rng = np.random.default_rng(6)
    t = 2 * S + 1
    pt = jnp.asarray(page_rows(rng, 8, [t], 3))
    kvs = rand_kv(GQA, rng, 1, t)
    whole = paged.write_prompt(paged.init_pool(GQA, 8, S, "bfloat16"), kvs, pt, jnp.asarray([t]))
    inc = paged.write_prompt(paged.init_pool(GQA, 8, S, "bfloat16"), kvs, pt, jnp.asarray([2]))
    step = jax.jit(paged.write_token, donate_argnums=0)
    for i in range(2, t):
        inc = step(inc, [(k[:, i], v[:, i]) for k, v in kvs], pt, jnp.asarray([i]), jnp.asarray([True]))
    for a, b in zip(leaves(whole), leaves(inc), strict=True):
        np.testing.assert_array_equal(a, b)


def test_clear_pages_scrubs_only_the_listed_pages():
    rng = np.random.default_rng(7)
    pt = page_rows(rng, 8, [2 * S, 2 * S], 2)
    pool = paged.write_prompt(paged.init_pool(MLA, 8, S, "float8_e4m3fn"), rand_kv(MLA, rng, 2, 2 * S),
                              jnp.asarray(pt), jnp.asarray([2 * S, 2 * S]))
    cleared = paged.clear_pages(pool, jnp.asarray([pt[0, 1], 0, 99], jnp.int32))
    for lay0, lay1 in zip(pool.layers, cleared.layers, strict=True):
        assert (np.asarray(lay1.latent, np.float32)[pt[0, 1]] == 0).all() and (lay1.scale[pt[0, 1]] == 1).all()
        keep = [i for i in range(8) if i != pt[0, 1]]
        np.testing.assert_array_equal(np.asarray(lay0.latent, np.float32)[keep],
                                      np.asarray(lay1.latent, np.float32)[keep])


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_prefill_kv_of_the_model_round_trips(cfg):
    cfg = cfg.replace(num_layers=1, moe_layers=())
    params = ps.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 2 * S + 1), 0, cfg.vocab_size)
    _, kvs = ps.prefill(params, cfg, tokens)
    pt = page_rows(np.random.default_rng(8), 10, [2 * S + 1] * 2, 3)
    pool = paged.write_prompt(paged.init_pool(cfg, 10, S, "float32"), kvs, jnp.asarray(pt), jnp.asarray([9, 9]))
    for lay, want in zip(paged.gather_request(pool, pt[1], 9), kvs, strict=True):
        for g, w in zip(jax.tree.leaves(lay), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w[1]))


# ---- memory accounting ----------------------------------------------------------------------------------
KIMI_K2 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
           "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 64,
           "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8,
           "n_shared_experts": 1, "moe_intermediate_size": 2048, "first_k_dense_replace": 1}
GLM5 = {"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 154880, "hidden_size": 6144,
        "intermediate_size": 12288, "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3, "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128}


def test_bytes_per_token_hand_counts_kimi_k2_and_glm5():
    kimi, glm = ModelConfig.from_hf_config(KIMI_K2), ModelConfig.from_hf_config(GLM5)
    # Kimi K2: 61 layers x (512 + 64) = 35,136 latent values per token
    assert paged.kv_bytes_per_token(kimi, "bfloat16") == 61 * 576 * 2 == 70272
    assert paged.kv_bytes_per_token(kimi, "float8_e4m3fn") == 61 * 576 + 61 * 4 == 35380  # + one f32 scale/layer
    assert paged.kv_bytes_per_token(kimi, "float32") == 61 * 576 * 4
    assert paged.indexer_bytes_per_token(kimi, "bfloat16") == 0
    # GLM-5: 78 layers x 576; its DSA indexer keys (128 per layer) stored beside them, counted separately too
    assert paged.kv_bytes_per_token(glm, "bfloat16", include_indexer=False) == 78 * 576 * 2 == 89856
    assert paged.kv_bytes_per_token(glm, "float8_e4m3fn", include_indexer=False) == 78 * 576 + 78 * 4 == 45240
    assert paged.indexer_bytes_per_token(glm, "bfloat16") == 78 * 128 * 2 == 19968
    assert paged.indexer_bytes_per_token(glm, "float8_e4m3fn") == 78 * (128 + 4) == 10296
    assert paged.kv_bytes_per_token(glm, "float8_e4m3fn", include_indexer=True) == 45240 + 10296
    assert paged.kv_bytes_per_page(kimi, "float8_e4m3fn", 64) == 64 * 35380
    # FP8 pages nearly double the resident tokens under one budget (scales cost 0.7%)
    budget = 100 * 2**30
    ratio = paged.pages_for_budget(kimi, "fp8", 16, budget) / paged.pages_for_budget(kimi, "bf16", 16, budget)
    assert 1.98 < ratio < 1.99, ratio


def test_bytes_per_token_gqa_hand_count():
    cfg = GQA.replace(num_layers=48, num_kv_heads=4, num_heads=32, head_dim=128, moe_layers=())
    assert paged.kv_bytes_per_token(cfg, "bfloat16") == 48 * 2 * 4 * 128 * 2
    assert paged.kv_bytes_per_token(cfg, "float8_e4m3fn") == 48 * (2 * 4 * 128 + 2 * 4 * 4)


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_pool_bytes_match_accounting_and_budget(cfg, kv_dtype):
    per_page = paged.kv_bytes_per_page(cfg, kv_dtype, S)
    n = paged.pages_for_budget(cfg, kv_dtype, S, 13 * per_page)
    assert n == 13 and paged.pages_for_budget(cfg, kv_dtype, S, 13 * per_page - 1) == 12
    pool = jax.eval_shape(lambda: paged.init_pool(cfg, n, S, kv_dtype))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool)) == n * per_page
    assert paged.pool_nbytes(paged.init_pool(cfg, 3, S, kv_dtype)) == 3 * per_page


@pytest.mark.parametrize("cfg", [GQA, MLA], ids=["gqa", "mla"])
def test_pool_layout_is_what_the_attention_kernels_take(cfg):
    """The FP8 pool's pages and scales feed pallas_kernels' references directly (DESIGN layout contract)."""
    from pallas_kernels.mla_attention import mla_decode_attention_reference
    from pallas_kernels.paged_attention import paged_decode_attention_reference

    def dense_attend(q, kv, valid):
        """Masked softmax attention over gathered dense KV (latent as keys and values for MLA)."""
        k, v = kv if isinstance(kv, tuple) else (kv[:, :, None], kv[:, :, None])
        b, h, d = q.shape
        g = h // k.shape[2]
        s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(b, -1, g, d), k) / np.sqrt(d)
        p = jax.nn.softmax(jnp.where(valid[:, None, None, :], s, -jnp.inf), axis=-1)
        return jnp.einsum("bkgt,btkd->bkgd", p, jnp.where(valid[:, :, None, None], v, 0.0)).reshape(b, h, d)

    rng = np.random.default_rng(9)
    lengths = np.array([1, S, 2 * S + 3], np.int32)
    pt = jnp.asarray(page_rows(rng, 12, lengths, 3))
    pool = paged.write_prompt(paged.init_pool(cfg, 12, S, "float8_e4m3fn"), rand_kv(cfg, rng, 3, 3 * S), pt,
                              jnp.asarray(lengths))
    lay = pool.layers[1]
    vals = jax.tree.map(paged.as_values, lay)  # the kernels take values (XLA:CPU pools hold raw bits)
    w = cfg.kv_cache_width
    q = jnp.asarray(rng.standard_normal((3, cfg.num_heads, w)), jnp.float32)
    valid = jnp.arange(3 * S)[None, :] < jnp.asarray(lengths)[:, None]
    mine = np.asarray(dense_attend(q, paged.gather_layer(lay, pt), valid))
    if cfg.is_mla:
        r = cfg.kv_lora_rank
        theirs = mla_decode_attention_reference(q[..., :r], q[..., r:], vals.latent, pt, jnp.asarray(lengths),
                                                scales=vals.scale, sm_scale=w**-0.5)
        mine = mine[..., :r]
    else:
        theirs = paged_decode_attention_reference(q, vals.k, vals.v, pt, jnp.asarray(lengths),
                                                  k_scales=vals.k_scale, v_scales=vals.v_scale)
    np.testing.assert_allclose(mine, np.asarray(theirs), rtol=2e-5, atol=2e-5)
