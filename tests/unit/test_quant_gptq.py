"""Calibrated INT4 (GPTQ) against RTN: statistics collected from the real forward, GPTQ's algebra, and the
claim that matters — lower output error than RTN when activations have outlier channels.

GPTQ compensates each rounding error through correlated input channels, so the test activations are what
LLM activations look like: correlated (low-rank plus noise) with a few channels ``OUTLIER_GAIN`` times larger.
(With independent input channels the Hessian is diagonal and GPTQ reduces to RTN by construction.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phaseserve as ps
from pallas_kernels.int4_matmul import Int4Weight, dequantize_int4, unpack_int4
from phaseserve import presets
from phaseserve.model.layers import rms_norm
from phaseserve.model.params import abstract_params, map_infos
from phaseserve.quant import PolicyError, Rep, quantize_leaf, quantize_params
from phaseserve.quant.calibrate import collect_calibration, gptq_int4

forward = jax.jit(ps.forward, static_argnums=1)
OUTLIER_GAIN = 25.0


def random_params(cfg, seed: int, outliers: int = 0, embed_rank: int | None = None):
    """Host-random float32 params; with ``outliers``, that many channels of every norm that feeds a projection
    (attention, MLP, MLA latents) are amplified ``OUTLIER_GAIN`` times (the activation outliers of real LLMs);
    with ``embed_rank``, embeddings are low-rank plus noise (correlated hidden channels)."""
    rng = np.random.default_rng(seed)

    def leaf(info):
        if info.init in ("ones", "zeros"):
            return jnp.asarray((info.init == "ones") + 0.1 * rng.standard_normal(info.shape), jnp.float32)
        scale = 0.02 if info.init == "embed" else 1 / np.sqrt(info.shape[-2] if len(info.shape) > 1 else 1)
        return jnp.asarray(scale * rng.standard_normal(info.shape), jnp.float32)

    def amplify(kp, x):
        name = jax.tree_util.keystr(kp)
        if outliers and x.ndim == 1 and name.endswith(("attn_norm", "mlp_norm", "q_a_norm", "kv_a_norm")):
            return x.at[rng.choice(x.shape[0], outliers, replace=False)].multiply(OUTLIER_GAIN)
        return x

    params = jax.tree_util.tree_map_with_path(amplify, map_infos(leaf, abstract_params(cfg)))
    if embed_rank:
        v, d = params.embed.shape
        low = rng.standard_normal((v, embed_rank)) @ rng.standard_normal((embed_rank, d)) / np.sqrt(embed_rank)
        params = params.replace(embed=jnp.asarray(0.02 * (low + 0.2 * rng.standard_normal((v, d))), jnp.float32))
    return params


def outlier_inputs(rng, n: int, mix: np.ndarray, channels: np.ndarray) -> np.ndarray:
    """Correlated activations (rank-r mix plus noise) with outlier channels: f32[n, K]."""
    x = rng.standard_normal((n, mix.shape[0])) @ mix + 0.3 * rng.standard_normal((n, mix.shape[1]))
    x[:, channels] *= OUTLIER_GAIN
    return x.astype(np.float32)


def test_gptq_with_identity_hessian_is_rtn():
    """A diagonal Hessian leaves nothing to compensate: GPTQ's codes must be RTN's (bf16 scales, group 32)."""
    w = jax.random.normal(jax.random.key(0), (128, 96))
    got = gptq_int4(w, (np.eye(128), np.asarray(10)), 32, "bfloat16")
    want = quantize_leaf(w, Rep("int4", 32, "bfloat16"))  # phaseserve's RTN
    assert got.scale.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got.packed), np.asarray(want.packed))
    np.testing.assert_allclose(np.asarray(got.scale, np.float32), np.asarray(want.scale, np.float32), rtol=1e-6)


def test_gptq_beats_rtn_on_a_matrix_with_outlier_inputs():
    rng = np.random.default_rng(1)
    k, n = 256, 128
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    channels, mix = rng.choice(k, 6, replace=False), rng.standard_normal((32, k))
    calib, held_out = outlier_inputs(rng, 2048, mix, channels), outlier_inputs(rng, 512, mix, channels)
    h = calib.astype(np.float64).T @ calib.astype(np.float64)
    for g in (32, 128):
        rtn = quantize_leaf(jnp.asarray(w), Rep("int4", g))
        gptq = gptq_int4(jnp.asarray(w), (h, np.asarray(len(calib))), g)
        assert isinstance(gptq, Int4Weight) and gptq.packed.shape == rtn.packed.shape
        codes = np.asarray(unpack_int4(gptq))
        assert codes.min() >= -8 and codes.max() <= 7
        ref = held_out @ w
        err = {name: np.linalg.norm(held_out @ np.asarray(dequantize_int4(q)) - ref) / np.linalg.norm(ref)
               for name, q in (("rtn", rtn), ("gptq", gptq))}
        print(f"\n[layer output error, g{g}] RTN {err['rtn']:.4f}  GPTQ {err['gptq']:.4f}")
        assert err["gptq"] < 0.7 * err["rtn"], err


def test_calibration_statistics_come_from_the_real_forward():
    cfg = presets.preset_config("tiny-mla-moe")
    params = random_params(cfg, 2)
    tokens = jax.random.randint(jax.random.key(3), (3, 16), 1, cfg.vocab_size)
    cal = collect_calibration(params, cfg, tokens, batch_size=2)
    n_tok = tokens.size
    assert int(cal.rows["layers.0.attn.wq_a"]) == n_tok and int(cal.rows["lm_head"]) == n_tok
    experts = cal.rows["layers.1.mlp.w_gate"]
    assert experts.shape == (cfg.num_experts,) and int(experts.sum()) == n_tok * cfg.num_experts_per_tok
    assert "embed" not in cal.hessians and "layers.1.mlp.router" not in cal.hessians
    assert "layers.0.attn.wkv_b" not in cal.hessians  # MLA dequantizes kv_b rather than multiplying by it
    # The first projection's input is the normalised embedding: check H = X^T X exactly.
    x = rms_norm(jnp.take(params.embed, tokens, axis=0), params.layers[0].attn_norm, cfg.rms_norm_eps)
    x = np.asarray(x, np.float64).reshape(-1, cfg.hidden_size)
    np.testing.assert_allclose(cal.hessians["layers.0.attn.wq_a"], x.T @ x, rtol=1e-4, atol=1e-4)
    h = cal.hessians["layers.1.mlp.w_down"]
    assert h.shape == (cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size)
    np.testing.assert_allclose(h, np.swapaxes(h, -1, -2), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        collect_calibration(params, cfg, np.zeros((0, 4), np.int32))


def test_gptq_policy_needs_calibration():
    cfg = presets.preset_config("tiny-mla-moe")
    with pytest.raises(PolicyError, match="calibration"):
        quantize_params(random_params(cfg, 0), "kimi-int4,routed_experts=int4:g32:gptq")


def test_gptq_beats_rtn_on_a_model_with_outlier_channels():
    """All MLP weights (dense, shared, routed experts) INT4 g32; calibration set and evaluation set are
    different random token sequences. GPTQ must bring the logits closer to float32 than RTN does."""
    cfg = presets.preset_config("tiny-mla-moe")
    params = random_params(cfg, 4, outliers=4, embed_rank=8)
    calib = jax.random.randint(jax.random.key(5), (16, 32), 1, cfg.vocab_size)
    tokens = jax.random.randint(jax.random.key(6), (8, 32), 1, cfg.vocab_size)
    ref = forward(params, cfg, tokens)
    cal = collect_calibration(params, cfg, calib)
    classes = ("routed_experts", "shared_experts", "dense_mlp")
    out = {}
    for method in ("rtn", "gptq"):
        policy = "base=float32," + ",".join(f"{c}=int4:g32:{method}" for c in classes)
        logits = forward(quantize_params(params, policy, cal), cfg, tokens)
        p, q = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(logits, -1)
        kl = float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))
        rel = float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref))
        agree = float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(logits, -1)))
        out[method] = (kl, rel, agree)
        print(f"\n[outlier model, MLP int4 g32] {method}: KL {kl:.5f}, rel. logit error {rel:.4f}, top-1 {agree:.3f}")
    assert out["gptq"][0] < 0.8 * out["rtn"][0] and out["gptq"][1] < out["rtn"][1], out
