"""MLA's two forms of a prefill chunk over cached keys agree: the weight-absorbed form (chosen where it is cheaper, a
short chunk over a long context) against the expanded one, on fresh random weights, activations and cached latents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from phaseserve.config import ModelConfig
from phaseserve.model import attention_mla
from phaseserve.model.params import init_params
from phaseserve.presets import preset
from phaseserve.quant.policy import resolve_policy
from phaseserve.quant.quantize import quantize_params

CFG = ModelConfig.from_hf_config(preset("tiny-mla-moe"))


def test_the_absorbed_form_is_chosen_for_short_chunks_over_long_contexts_only():
    race = ModelConfig.from_hf_config({**preset("tiny-mla-moe"), "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                                       "qk_nope_head_dim": 32, "v_head_dim": 32, "num_attention_heads": 8})
    assert attention_mla.absorbed_is_cheaper(race, 16, 256)  # a prefix hit's suffix over 16 pages
    assert not attention_mla.absorbed_is_cheaper(race, 160, 160)  # a fresh prompt over its own keys
    assert attention_mla.absorbed_is_cheaper(race, 1, 2) and not attention_mla.absorbed_is_cheaper(race, 512, 512)


@pytest.mark.parametrize("t,s,start", [(4, 24, 17), (1, 40, 39), (8, 16, 0)])
def test_absorbed_chunk_equals_expanded(monkeypatch, t, s, start):
    """Rows at different offsets (one padding row that sees no key), cached latents at positions < start, the
    chunk's own at start..start+t-1: both forms give the same output, and the chosen one is the absorbed."""
    key = jax.random.key(t * 100 + s)
    attn = init_params(CFG, key, "float32").layers[0].attn
    b = 3
    kx, kc = jax.random.split(jax.random.fold_in(key, 1))
    x = jax.random.normal(kx, (b, t, CFG.hidden_size), jnp.float32)
    cached = jax.random.normal(kc, (b, s, CFG.kv_lora_rank + CFG.qk_rope_head_dim), jnp.float32)
    offsets = np.array([start, max(start - 3, 0), 0])
    positions = jnp.asarray(offsets[:, None] + np.arange(t)[None], jnp.int32)
    lengths = jnp.asarray(np.minimum(offsets + t, s) * np.array([1, 1, 0]), jnp.int32)  # row 2: padding

    def context(kv):  # the chunk's latents written over the cache at their positions, as the pool gives them back
        rows = jnp.arange(b)[:, None]
        return cached.at[rows, jnp.clip(positions, 0, s - 1)].set(kv)

    run = jax.jit(lambda: attention_mla.forward(attn, CFG, x, positions, lengths, context=context)[0])
    assert attention_mla.absorbed_is_cheaper(CFG, t, s)
    absorbed = np.asarray(run())
    monkeypatch.setattr(attention_mla, "absorbed_is_cheaper", lambda *a: False)
    expanded = np.asarray(jax.jit(lambda: attention_mla.forward(attn, CFG, x, positions, lengths,
                                                                context=context)[0])())
    assert np.abs(expanded).max() > 0.01 and np.isfinite(absorbed).all()
    np.testing.assert_allclose(absorbed, expanded, rtol=2e-5, atol=2e-5)


def test_head_major_kv_b_reads_the_same_weights():
    """``with_head_major_kv_b`` lays wkv_b's halves out per head once; the absorbed products on them equal the ones
    sliced from wkv_b (fresh random weights and activations), in a decode step's queries and output and in a chunk
    over cached keys; quantized wkv_b and layers already set are left alone."""
    params = init_params(CFG, jax.random.key(7), "float32")
    hm = attention_mla.with_head_major_kv_b(CFG, params)
    a, ah = params.layers[0].attn, hm.layers[0].attn
    assert a.kv_b_heads is None and ah.kv_b_heads is not None
    assert ah.kv_b_heads[0].shape == (CFG.num_heads, CFG.qk_nope_head_dim, CFG.kv_lora_rank)
    assert ah.kv_b_heads[1].shape == (CFG.num_heads, CFG.kv_lora_rank, CFG.v_head_dim)
    kq, ko, kx = jax.random.split(jax.random.key(8), 3)
    q_nope = jax.random.normal(kq, (5, CFG.num_heads, CFG.qk_nope_head_dim), jnp.float32)
    o_lat = jax.random.normal(ko, (5, CFG.num_heads, CFG.kv_lora_rank), jnp.float32)
    for fn, arg in ((attention_mla.absorb_query, q_nope), (attention_mla.absorb_output, o_lat)):
        ref, got = np.asarray(fn(a, CFG, arg)), np.asarray(jax.jit(lambda p, v, f=fn: f(p, CFG, v))(ah, arg))
        assert np.abs(ref).max() > 0.01
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    x = jax.random.normal(kx, (5, CFG.hidden_size), jnp.float32)
    positions = jnp.arange(5, dtype=jnp.int32) * 7
    for ref, got in zip(attention_mla.absorbed_queries(a, CFG, x, positions)[0],
                        attention_mla.absorbed_queries(ah, CFG, x, positions)[0], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(attention_mla.absorbed_output(ah, CFG, o_lat)),
                               np.asarray(attention_mla.absorbed_output(a, CFG, o_lat)), rtol=1e-5, atol=1e-5)
    assert attention_mla.with_head_major_kv_b(CFG, hm).layers[0].attn.kv_b_heads is ah.kv_b_heads
    b, t, s = 2, 3, 20  # a chunk of 3 tokens at positions 9..11 over 20 cached latents: the absorbed form
    kc, kt = jax.random.split(jax.random.key(9))
    cached = jax.random.normal(kc, (b, s, CFG.kv_lora_rank + CFG.qk_rope_head_dim), jnp.float32)
    xt = jax.random.normal(kt, (b, t, CFG.hidden_size), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(9, 9 + t, dtype=jnp.int32), (b, t))
    lengths = jnp.full((b,), 12, jnp.int32)
    assert attention_mla.absorbed_is_cheaper(CFG, t, s)
    def context(kv):  # the chunk's latents written over the cache at positions 9..11
        return cached.at[:, 9:12].set(kv)

    chunk = [np.asarray(attention_mla.forward(w, CFG, xt, pos, lengths, context=context)[0]) for w in (a, ah)]
    assert np.abs(chunk[0]).max() > 0.01
    np.testing.assert_allclose(chunk[1], chunk[0], rtol=1e-5, atol=1e-5)
    fp8 = quantize_params(params, resolve_policy("all-fp8", base="float32"))
    assert attention_mla.with_head_major_kv_b(CFG, fp8).layers[0].attn.kv_b_heads is None  # quantized: sliced per step


def test_decode_workers_lay_kv_b_out_per_head():
    """The engine's decode worker holds float MLA weights with head-major kv_b (and its step runs on them)."""
    from phaseserve.config import ServeConfig
    from phaseserve.engine import Engine, Request

    params = init_params(CFG, jax.random.key(3), "float32")
    eng = Engine(CFG, params, ServeConfig())
    assert all(layer.attn.kv_b_heads is not None for layer in eng.decode.params.layers)
    out = eng.generate([Request(id="a", prompt=[3, 1, 4, 1, 5], max_tokens=4)])
    assert len(out[0].tokens) == 4 and out[0].finish_reason == "length"
