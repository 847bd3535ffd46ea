"""Every quantized checkpoint variant is either loaded to the values its tensors mean or refused by name.

Each variant is written here by plain torch + safetensors code from a tiny random transformers DeepSeek-V3
(never by phaseserve's writer), and the loaded leaf is compared with a direct dequantization of the written
tensors (``q * scale`` in float32, computed by torch). The act-order, per-tensor-scale, stray-scale and E8M0
cases loaded wrong or crashed before the one loader (g_idx ignored, scale not applied, BF16 weight turned
into FP8, ``AttributeError``).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import phaseserve as ps
from phaseserve.model import loader as plain_loader
from phaseserve.model.loader import (
    MissingTensorError,
    QuantizedCheckpointError,
    SkippedTensorsWarning,
    UnexpectedTensorError,
)
from phaseserve.qarrays import Fp8Weight, Int4Weight, dense, dequantize, grouped_dense
from phaseserve.quant.actorder import ActOrderInt4Weight
from phaseserve.quant.formats import UnsupportedFormatError
from phaseserve.quant.quantize import leaf_rep, quantize_params
from tests.unit.quant_writers import pack_int32, tiny_deepseek

WO = "model.layers.0.self_attn.o_proj.weight"  # [128, 128]
KV = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [144, 128]: a partial 128x128 block
DOWN = "model.layers.1.mlp.experts.{}.down_proj.weight"  # 8 x [128, 128], stacked into one leaf
FP8_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def ct_config(weights: dict, fmt: str = "pack-quantized", acts: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


INT4_G32 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("hf") / "base"
    tiny_deepseek().save_pretrained(d)
    return d, load_file(str(d / "model.safetensors"))


def write(base, dst: Path, tensors: dict, qcfg: dict | None, shards: int = 1) -> Path:
    """The base checkpoint's config (plus ``qcfg``) and ``tensors``, in ``shards`` files with an index."""
    dst.mkdir(parents=True)
    cfg = json.loads((base[0] / "config.json").read_text())
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(dst / "model.safetensors"))
        return dst
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_weight(shape, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=rng(seed)) * 60).to(torch.float8_e4m3fn)


def loaded(params, name: str) -> np.ndarray:
    """The loaded leaf of HF tensor ``name`` (``WO``, ``KV`` or a ``DOWN`` expert), dequantized, as f32 [out, in]."""
    if name in (WO, KV):
        leaf = params.layers[0].attn.wo if name == WO else params.layers[0].attn.wkv_a
    else:  # one expert of the stacked leaf (a quantized weight is a pytree: slice every stored array)
        leaf = jax.tree.map(lambda a: a[int(name.split(".")[5])], params.layers[1].mlp.w_down)
    return np.asarray(dequantize(leaf, jnp.float32)).T


# ---- FP8 scales -----------------------------------------------------------------------------------------------
def test_per_tensor_fp8_scale_is_applied(base, tmp_path):
    """AutoFP8 / vLLM layout under ``quant_method: fp8``: ``weight_scale`` is one number per tensor."""
    t = dict(base[1])
    want = {}
    for i, n in enumerate((WO, KV)):
        q, s = fp8_weight(t[n].shape, i), torch.tensor(0.25 + i * 0.5)
        t[n], t[n.replace("weight", "weight_scale")] = q, s
        want[n] = (q.float() * s).numpy()
    cfg, params = ps.load_checkpoint(write(base, tmp_path / "t", t, {**FP8_CFG}))
    assert isinstance(params.layers[0].attn.wo, Fp8Weight) and params.layers[0].attn.wo.scale.shape == (1, 1)
    for n in want:
        assert np.array_equal(loaded(params, n), want[n]), n


def test_per_channel_fp8_compressed_tensors(base, tmp_path):
    """compressed-tensors float-quantized, strategy channel: ``weight_scale`` bf16 [out, 1]."""
    t = dict(base[1])
    want = {}
    for i, n in enumerate([WO, KV] + [DOWN.format(e) for e in range(8)]):
        q = fp8_weight(t[n].shape, 10 + i)
        s = (torch.rand(t[n].shape[0], 1, generator=rng(20 + i)) + 0.1).to(torch.bfloat16)
        t[n], t[n.replace("weight", "weight_scale")] = q, s
        want[n] = (q.float() * s.float()).numpy()
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    _, params = ps.load_checkpoint(write(base, tmp_path / "c", t, ct_config(w, "float-quantized")))
    assert params.layers[1].mlp.w_down.block == (128, 1)
    for n in want:
        assert np.array_equal(loaded(params, n), want[n]), n


def test_e8m0_block_scales_and_the_default_block_size(base, tmp_path):
    """transformers' ``scale_fmt="ue8m0"``: power-of-two ``weight_scale_inv`` stored as F8_E8M0; no
    ``weight_block_size`` in the config means the documented 128x128 default (partial edge blocks)."""
    t = dict(base[1])
    want = {}
    for i, n in enumerate((WO, KV)):
        out_f, in_f = t[n].shape
        q = fp8_weight((out_f, in_f), 30 + i)
        e = torch.randint(-6, 3, (math.ceil(out_f / 128), math.ceil(in_f / 128)), generator=rng(40 + i))
        s = torch.pow(2.0, e.float()).to(torch.float8_e8m0fnu)
        t[n], t[n + "_scale_inv"] = q, s
        full = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_f, :in_f]
        want[n] = (q.float() * full).numpy()
    qcfg = {k: v for k, v in FP8_CFG.items() if k != "weight_block_size"}
    _, params = ps.load_checkpoint(write(base, tmp_path / "e", t, qcfg))
    assert params.layers[0].attn.wkv_a.scale.shape == (1, 2) and params.layers[0].attn.wkv_a.block == (128, 128)
    for n in want:
        assert np.array_equal(loaded(params, n), want[n]), n


def test_null_block_size(base, tmp_path):
    """``weight_block_size: null``: per-channel scales load; block-shaped scales are refused naming the tensor."""
    t = dict(base[1])
    q, s = fp8_weight(t[WO].shape, 50), torch.rand(t[WO].shape[0], 1, generator=rng(51)) + 0.1
    t[WO], t[WO + "_scale_inv"] = q, s
    qcfg = {**FP8_CFG, "weight_block_size": None}
    _, params = ps.load_checkpoint(write(base, tmp_path / "ok", t, qcfg))
    assert np.array_equal(loaded(params, WO), (q.float() * s).numpy())
    t[KV], t[KV + "_scale_inv"] = fp8_weight(t[KV].shape, 52), torch.rand(2, 1, generator=rng(53)) + 0.1
    with pytest.raises(UnsupportedFormatError, match=KV + "_scale_inv.*weight_block_size is null"):
        ps.load_checkpoint(write(base, tmp_path / "bad", t, qcfg))


def test_stray_scale_beside_a_bf16_weight(base, tmp_path):
    """transformers writes an (uninitialized) ``weight_scale_inv`` beside the linears its FP8 quantizer leaves in
    BF16: strict refuses naming it; strict=False loads the BF16 weight as it is and lists the scale."""
    t = dict(base[1])
    t[KV], t[KV + "_scale_inv"] = fp8_weight(t[KV].shape, 60), torch.rand(2, 1, generator=rng(61)) + 0.5
    t[WO] = t[WO].to(torch.bfloat16)
    t[WO + "_scale_inv"] = torch.rand(1, 1, generator=rng(62)) * 100 + 1
    d = write(base, tmp_path / "s", t, FP8_CFG)
    with pytest.raises(UnexpectedTensorError, match=WO + "_scale_inv"):
        ps.load_checkpoint(d)
    with pytest.warns(SkippedTensorsWarning) as rec:
        _, params = ps.load_checkpoint(d, strict=False)
    assert rec[0].message.names == [WO + "_scale_inv"]
    assert not isinstance(params.layers[0].attn.wo, Fp8Weight)
    assert np.array_equal(loaded(params, WO), t[WO].float().numpy())


def test_fp8_weight_without_scale_is_named(base, tmp_path):
    t = dict(base[1])
    t[WO] = fp8_weight(t[WO].shape, 70)
    with pytest.raises(MissingTensorError, match=WO + "_scale"):
        ps.load_checkpoint(write(base, tmp_path / "m", t, FP8_CFG))


# ---- INT4 pack-quantized ----------------------------------------------------------------------------------------
def int4_tensors(t: dict, seed: int, g_idx: bool) -> dict[str, np.ndarray]:
    """Layer 1's routed down_proj as pack-quantized INT4 (group 32); with ``g_idx``, experts 0..6 use a permuted
    act-order group map (expert 7 the trivial one). Returns the direct dequantization of each expert."""
    want = {}
    for e in range(8):
        n = DOWN.format(e)
        out_f, in_f = t[n].shape
        q = torch.randint(-8, 8, (out_f, in_f), generator=rng(seed + e), dtype=torch.int8)
        s = (torch.rand(out_f, in_f // 32, generator=rng(seed + 100 + e)) + 0.05).to(torch.bfloat16)
        gi = torch.arange(in_f, dtype=torch.int32) // 32
        if g_idx and e < 7:
            gi = gi[torch.randperm(in_f, generator=rng(seed + 200 + e))]
        del t[n]
        t[n + "_packed"], t[n + "_scale"] = pack_int32(q), s
        t[n + "_shape"] = torch.tensor([out_f, in_f], dtype=torch.int32)
        if g_idx:
            t[n + "_g_idx"] = gi
        want[n] = (q.float() * s.float()[:, gi.long()]).numpy()
    return want


def test_act_order_g_idx_is_applied(base, tmp_path):
    """GPTQ act-order: the rows are permuted into group order on load (nibbles and scales as stored), and the
    matmuls gather the activations by the same permutation: weights, expert matmuls and logits match the direct
    dequantization."""
    t = dict(base[1])
    want = int4_tensors(t, 80, g_idx=True)
    qcfg = ct_config({**INT4_G32, "actorder": "group"})
    cfg, params = ps.load_checkpoint(write(base, tmp_path / "a", t, qcfg))
    w = params.layers[1].mlp.w_down
    assert isinstance(w, ActOrderInt4Weight) and w.w.group_size == 32 and w.w.scale.dtype == jnp.bfloat16
    for n in want:
        assert np.array_equal(loaded(params, n), want[n]), n
    dense_w = np.stack([want[DOWN.format(e)].T for e in range(8)])  # f32[E, in, out]
    x = jax.random.normal(jax.random.key(0), (12, 128), jnp.float32)
    sizes = jnp.array([3, 0, 2, 1, 1, 2, 0, 3], jnp.int32)
    ref = jax.lax.ragged_dot(x, jnp.asarray(dense_w), sizes, precision=jax.lax.Precision.HIGHEST)
    close(grouped_dense(x, w, sizes), ref)
    close(dense(x, jax.tree.map(lambda a: a[3], w)), x @ dense_w[3])
    plain = params.replace(layers=[params.layers[0], params.layers[1].replace(
        mlp=params.layers[1].mlp.replace(w_down=jnp.asarray(dense_w)))])
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    close(ps.forward(params, cfg, tokens), ps.forward(plain, cfg, tokens))


def test_act_order_survives_a_matching_policy(base, tmp_path):
    """The engine's per-phase copies go through ``quantize_params``: an INT4 policy with the checkpoint's group size
    and scale dtype keeps the act-order weight as loaded (its GPTQ nibbles), rather than re-rounding its
    dequantization with RTN; a different group size does convert it."""
    t = dict(base[1])
    int4_tensors(t, 81, g_idx=True)
    _, params = ps.load_checkpoint(write(base, tmp_path / "k", t, ct_config({**INT4_G32, "actorder": "group"})))
    w = params.layers[1].mlp.w_down
    kept = quantize_params(params, "base=float32,routed_experts=int4:g32:bf16").layers[1].mlp.w_down
    assert kept is w
    assert leaf_rep(w) == "int4:g32:bf16:act"
    moved = quantize_params(params, "base=float32,routed_experts=int4:g128:bf16").layers[1].mlp.w_down
    assert isinstance(moved, Int4Weight) and moved.group_size == 128


def close(got, want) -> None:
    """Equal up to float32 summation order: 1e-6 of the largest magnitude (a wrong row order is off by ~1e-1)."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_act_order_with_unequal_groups_loads_exact_values(base, tmp_path):
    """A g_idx whose groups do not all hold G columns cannot be permuted into contiguous groups: the experts load
    as their exact dequantization."""
    t = dict(base[1])
    want = int4_tensors(t, 85, g_idx=True)
    n = DOWN.format(2)
    gi = t[n + "_g_idx"].clone()
    gi[gi == 1] = 0  # group 0 now holds 64 columns, group 1 none
    t[n + "_g_idx"] = gi
    q = torch.stack([(t[n + "_packed"] >> (4 * i)) & 0xF for i in range(8)], -1).reshape(128, 128).float() - 8
    want[n] = (q * t[n + "_scale"].float()[:, gi.long()]).numpy()
    _, params = ps.load_checkpoint(write(base, tmp_path / "u", t, ct_config({**INT4_G32, "actorder": "group"})))
    assert params.layers[1].mlp.w_down.dtype == jnp.float32
    for n in want:
        assert np.array_equal(loaded(params, n), want[n]), n


def test_sharded_int4_and_trivial_g_idx(base, tmp_path):
    t = dict(base[1])
    want = int4_tensors(t, 90, g_idx=False)
    one = write(base, tmp_path / "one", dict(t), ct_config(INT4_G32))
    three = write(base, tmp_path / "three", dict(t), ct_config(INT4_G32), shards=3)
    _, p1 = ps.load_checkpoint(one)
    _, p3 = ps.load_checkpoint(three)
    w1, w3 = p1.layers[1].mlp.w_down, p3.layers[1].mlp.w_down
    assert isinstance(w3, Int4Weight) and w3.group_size == 32 and w3.scale.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(w1.packed), np.asarray(w3.packed))
    for n in want:
        assert np.array_equal(loaded(p3, n), want[n]), n
    # a trivial act-order map (c // G) is the same weight, still INT4
    for e in range(8):
        t[DOWN.format(e) + "_g_idx"] = torch.arange(128, dtype=torch.int32) // 32
    _, pg = ps.load_checkpoint(write(base, tmp_path / "g", t, ct_config({**INT4_G32, "actorder": "weight"})))
    assert isinstance(pg.layers[1].mlp.w_down, Int4Weight)
    assert np.array_equal(np.asarray(pg.layers[1].mlp.w_down.packed), np.asarray(w1.packed))


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_unsupported_schemes_are_refused_by_name(base, tmp_path):
    t = dict(base[1])
    int4_tensors(t, 110, g_idx=False)
    cases = [
        (ct_config({**INT4_G32, "symmetric": False}), "asymmetric"),
        (ct_config({**INT4_G32, "num_bits": 8}), "W8A16"),
        (ct_config(INT4_G32, acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "W4A8"),
        (ct_config(INT4_G32, fmt="marlin-24"), "pack-quantized"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({**FP8_CFG, "activation_scheme": "static"}, "static activation"),
    ]
    for i, (qcfg, feature) in enumerate(cases):
        with pytest.raises(UnsupportedFormatError, match=feature) as err:
            ps.load_checkpoint(write(base, tmp_path / f"r{i}", t, qcfg))
        assert len(str(err.value)) < 200 and "{" not in str(err.value), str(err.value)  # names it, no dict dump
    zp = dict(t)
    zp[DOWN.format(3) + "_zero_point"] = torch.zeros(16, 4, dtype=torch.int32) + 0x11111111
    with pytest.raises(UnsupportedFormatError, match=DOWN.format(3) + "_zero_point.*zero-point"):
        ps.load_checkpoint(write(base, tmp_path / "zp", zp, ct_config(INT4_G32)))
    e5 = dict(base[1])
    e5[WO], e5[WO + "_scale_inv"] = (torch.randn(128, 128) * 8).to(torch.float8_e5m2), torch.ones(1, 1)
    with pytest.raises(UnsupportedFormatError, match=WO + " is F8_E5M2"):
        ps.load_checkpoint(write(base, tmp_path / "e5", e5, FP8_CFG))


def test_strict_and_non_strict(base, tmp_path):
    t = dict(base[1])
    t[WO], t[WO + "_scale_inv"] = fp8_weight(t[WO].shape, 120), torch.rand(1, 1, generator=rng(121)) + 0.5
    t[WO.replace("weight", "input_scale")] = torch.tensor(0.5)
    d = write(base, tmp_path / "x", t, FP8_CFG)
    with pytest.raises(UnexpectedTensorError, match="o_proj.input_scale"):
        ps.load_checkpoint(d)
    with pytest.warns(SkippedTensorsWarning, match="o_proj.input_scale"):
        _, params = ps.load_checkpoint(d, strict=False)
    assert np.array_equal(loaded(params, WO), (t[WO].float() * t[WO + "_scale_inv"]).numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean checkpoint warns about nothing
        ps.load_checkpoint(base[0], strict=False)
    with pytest.raises(QuantizedCheckpointError, match="phaseserve.load_checkpoint"):
        plain_loader.read_checkpoint(d)  # the plain reading machinery refuses, naming the loader to use
