"""Weight representations and policies: parsing, classification, quantize_params, and ``ps.forward`` on every
representation against the float32 model (top-1 agreement and KL reported and bounded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phaseserve as ps
from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight
from phaseserve import presets
from phaseserve.config import QuantConfig
from phaseserve.model.params import abstract_params, is_info, map_infos
from phaseserve.quant import (
    PolicyError,
    Rep,
    abstract_quantized,
    phase_policy,
    quantize_params,
    resolve_policy,
    tensor_class,
)
from phaseserve.quant.quantize import leaf_rep, named_leaves

forward = jax.jit(ps.forward, static_argnums=1)


def random_params(cfg, seed: int):
    """Host-random float32 params (fan-in scaled normals, norms around one): no per-shape compiles."""
    rng = np.random.default_rng(seed)

    def leaf(info):
        if info.init in ("ones", "zeros"):
            return jnp.asarray((info.init == "ones") + 0.1 * rng.standard_normal(info.shape), jnp.float32)
        scale = 0.02 if info.init == "embed" else 1 / np.sqrt(info.shape[-2] if len(info.shape) > 1 else 1)
        return jnp.asarray(scale * rng.standard_normal(info.shape), jnp.float32)

    return map_infos(leaf, abstract_params(cfg))


@pytest.fixture(scope="module")
def mla():
    cfg = presets.preset_config("tiny-mla-moe")
    params = random_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 1, cfg.vocab_size)
    return cfg, params, tokens, forward(params, cfg, tokens)


def agreement_kl(ref: jax.Array, logits: jax.Array) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || logits) over all positions."""
    p = jax.nn.log_softmax(ref.astype(jnp.float32), -1)
    q = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    kl = jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1))
    return float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(logits, -1))), float(kl)


# ---- policy config ------------------------------------------------------------------------------------
def test_rep_parse_and_print_round_trip():
    cases = {"int4:g32:bf16:gptq": Rep("int4", 32, "bfloat16", method="gptq"), "fp8": Rep("fp8"),
             "fp8:channel": Rep("fp8", block=None), "fp8:b64x32": Rep("fp8", block=(64, 32)), "bf16": Rep("bfloat16"),
             "int4": Rep("int4", 128)}
    for text, rep in cases.items():
        assert Rep.parse(text) == rep
        assert Rep.parse(str(rep)) == rep
    for bad in ("int3", "int4:g33", "fp8:g32", "bfloat16:g32", "int4:awq"):
        with pytest.raises(PolicyError):
            Rep.parse(bad)


def test_presets_and_overrides():
    kimi = resolve_policy("kimi-int4")
    assert kimi.rep("routed_experts") == Rep("int4", 32, "bfloat16")
    assert kimi.rep("attention") == Rep("bfloat16") and kimi.rep("lm_head") == Rep("bfloat16")
    glm = resolve_policy("glm-fp8")
    assert {c: glm.rep(c).kind for c in ("attention", "routed_experts", "shared_experts", "dense_mlp")} == \
        dict.fromkeys(("attention", "routed_experts", "shared_experts", "dense_mlp"), "fp8")
    assert glm.rep("lm_head").kind == glm.rep("embeddings").kind == glm.rep("router").kind == "bfloat16"
    assert resolve_policy("all-fp8").rep("lm_head").kind == "fp8"
    over = resolve_policy("kimi-int4,routed_experts=int4:g128:gptq,base=float32")
    assert over.rep("routed_experts") == Rep("int4", 128, method="gptq") and over.rep("norms") == Rep("float32")
    assert resolve_policy(over.describe()) == over.replace(name=over.describe())
    assert resolve_policy({"preset": "glm-fp8", "lm_head": "fp8:channel"}).rep("lm_head") == Rep("fp8", block=None)
    f32 = resolve_policy("kimi-int4", base="float32")
    assert f32.rep("attention") == Rep("float32") and f32.rep("routed_experts").kind == "int4"


@pytest.mark.parametrize("spec", ["embeddings=int4", "router=fp8", "norms=fp8", "nonsense", "mlp=int4",
                                  "kimi-int4,lm_head"])
def test_bad_policies_raise(spec):
    with pytest.raises(PolicyError):
        resolve_policy(spec)


def test_phase_policy_from_quant_config():
    q = QuantConfig(prefill_weights="fp8", decode_weights="int4", int4_group_size=32, fp8_block=None)
    pre, dec = phase_policy(q, "prefill"), phase_policy(q, "decode")
    assert pre.rep("attention") == Rep("fp8", block=None) and pre.rep("lm_head").kind == "bfloat16"
    assert dec.rep("routed_experts") == Rep("int4", 32, "bfloat16") and dec.rep("attention").kind == "bfloat16"
    assert phase_policy(QuantConfig(decode_weights="all-int4"), "decode").rep("lm_head").kind == "int4"
    with pytest.raises(PolicyError):
        phase_policy(q, "train")


# ---- classification and conversion --------------------------------------------------------------------
def test_every_leaf_has_a_class(mla):
    cfg, params, _, _ = mla
    classes = {p: tensor_class(p, len(x.shape)) for p, x in named_leaves(params)}
    assert classes["embed"] == "embeddings" and classes["lm_head"] == "lm_head"
    assert classes["layers.0.mlp.w_up"] == "dense_mlp" and classes["layers.1.mlp.w_up"] == "routed_experts"
    assert classes["layers.1.mlp.shared.w_down"] == "shared_experts" and classes["layers.1.mlp.router"] == "router"
    assert classes["layers.1.attn.wkv_b"] == "attention" and classes["layers.1.attn.kv_a_norm"] == "norms"
    assert classes["final_norm"] == "norms" and classes["layers.1.mlp.correction_bias"] == "router"
    assert set(classes.values()) == {"attention", "routed_experts", "shared_experts", "dense_mlp", "router",
                                     "embeddings", "lm_head", "norms"}


def test_quantize_params_follows_policy(mla):
    _, params, _, _ = mla
    q = dict(named_leaves(quantize_params(params, "kimi-int4")))
    w = q["layers.1.mlp.w_gate"]
    assert isinstance(w, Int4Weight) and w.group_size == 32 and w.scale.dtype == jnp.bfloat16
    assert w.packed.shape == (8, 64, 128) and w.scale.shape == (8, 4, 128)
    assert q["layers.1.attn.wq_b"].dtype == jnp.bfloat16 and q["lm_head"].dtype == jnp.bfloat16
    assert q["layers.1.mlp.correction_bias"].dtype == jnp.float32
    g = dict(named_leaves(quantize_params(params, "glm-fp8")))
    assert isinstance(g["layers.0.attn.wkv_a"], Fp8Weight) and g["layers.0.attn.wkv_a"].scale.shape == (1, 2)
    assert isinstance(g["layers.0.mlp.w_down"], Fp8Weight) and g["layers.0.mlp.w_down"].scale.shape == (2, 1)
    assert not isinstance(g["lm_head"], Fp8Weight) and g["embed"].dtype == jnp.bfloat16
    assert {leaf_rep(x) for p, x in g.items() if p.endswith("norm")} == {"bfloat16"}


@pytest.mark.parametrize("policy", ["kimi-int4", "glm-fp8", "all-int4", "all-fp8,attention=fp8:channel"])
def test_abstract_tree_matches_real_tree(mla, policy):
    cfg, params, _, _ = mla
    real = quantize_params(params, policy)
    abstract = abstract_quantized(cfg, policy)
    assert jax.tree.structure(real) == jax.tree.structure(abstract, is_leaf=is_info)
    for a, r in zip(jax.tree.leaves(abstract, is_leaf=is_info), jax.tree.leaves(real), strict=True):
        assert tuple(a.shape) == tuple(r.shape) and jnp.dtype(a.dtype) == r.dtype


def test_requantizing_keeps_leaves_bit_exact(mla):
    _, params, _, _ = mla
    once = quantize_params(params, "all-int4,attention=fp8")
    twice = quantize_params(once, "all-int4,attention=fp8")
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(twice), strict=True):
        assert a is b
    back = quantize_params(once, "float32")  # dequantize everything
    lead = dict(named_leaves(back))["layers.1.mlp.w_up"]
    assert lead.dtype == jnp.float32 and lead.shape == (8, 128, 128)


def test_indivisible_group_is_a_clear_error():
    cfg = presets.preset_config("tiny-mla-moe").replace(kv_lora_rank=96)
    with pytest.raises(PolicyError, match="wkv_b.*96.*group size 128"):
        abstract_quantized(cfg, "all-int4")


# ---- forward on every representation ------------------------------------------------------------------
_MATMULS = ("attention", "routed_experts", "shared_experts", "dense_mlp", "lm_head")


def _every_matmul(rep: str) -> str:
    return "base=float32," + ",".join(f"{c}={rep}" for c in _MATMULS)


# (policy, min top-1 agreement, max KL) vs the float32 model; measured values are printed (``-s``). Small
# random models have nearly tied logits (docs/design.md), so agreement floors are loose; the KL bounds follow from
# each representation's rounding error (relative RMS weight error: bf16 ~0.2%, fp8 ~3.5%, int4 g32 ~9%).
LADDER = [("bfloat16", 0.85, 0.015), (_every_matmul("fp8"), 0.5, 0.08), (_every_matmul("int4:g32"), 0.2, 0.35),
          (_every_matmul("int4:g128"), 0.12, 0.45)]
FORWARD_CASES = [
    ("float32", 1.0, 1e-9),
    (_every_matmul("fp8:channel"), 0.5, 0.08),
    ("kimi-int4", 0.7, 0.03),
    ("glm-fp8", 0.5, 0.08),
]


@pytest.mark.parametrize("policy,min_agree,max_kl", FORWARD_CASES, ids=[c[0][:40] for c in FORWARD_CASES])
def test_forward_on_representation_vs_float32(mla, policy, min_agree, max_kl):
    cfg, params, tokens, ref = mla
    logits = forward(quantize_params(params, policy), cfg, tokens)
    assert logits.shape == ref.shape and bool(jnp.all(jnp.isfinite(logits)))
    agree, kl = agreement_kl(ref, logits)
    print(f"\n[forward vs float32] {policy}: top-1 agreement {agree:.3f}, KL {kl:.5f}")
    assert agree >= min_agree and kl <= max_kl, (agree, kl)


def test_error_grows_as_bits_shrink(mla):
    """bf16 < fp8 < int4 g32 < int4 g128 in KL, each within its bound."""
    cfg, params, tokens, ref = mla
    kls = []
    for policy, min_agree, max_kl in LADDER:
        agree, kl = agreement_kl(ref, forward(quantize_params(params, policy), cfg, tokens))
        print(f"\n[forward vs float32] {policy}: top-1 agreement {agree:.3f}, KL {kl:.5f}")
        assert agree >= min_agree and 0 < kl <= max_kl, (policy, agree, kl)
        kls.append(kl)
    assert kls == sorted(kls), kls


def test_gqa_model_runs_fp8_and_int4():
    cfg = presets.preset_config("tiny-gqa-moe")
    params = random_params(cfg, 3)
    tokens = jax.random.randint(jax.random.key(4), (2, 24), 1, cfg.vocab_size)
    ref = forward(params, cfg, tokens)
    for policy, max_kl in ((_every_matmul("fp8"), 0.05), (_every_matmul("int4:g32"), 0.3)):
        q = quantize_params(params, policy)
        assert isinstance(q.layers[1].mlp.w_gate, (Fp8Weight, Int4Weight))
        agree, kl = agreement_kl(ref, forward(q, cfg, tokens))
        print(f"\n[gqa forward vs float32] {policy}: agreement {agree:.3f}, KL {kl:.5f}")
        assert 0 < kl <= max_kl
    assert np.isfinite(kl)
