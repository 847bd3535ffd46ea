"""Published quantized checkpoint formats, written here from a tiny random Hugging Face model and read back.

The writers below are independent torch implementations of the published algorithms (DeepSeek-V3's 128x128
FP8 block quantization with ``weight_scale_inv``; compressed-tensors' ``pack_to_int32``), not phaseserve code,
so a layout or packing-order mistake in ``phaseserve.quant.formats`` cannot cancel out.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import phaseserve as ps
from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight, dequantize_int4
from phaseserve.model.loader import MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from phaseserve.quant import quantize_params, resolve_policy
from phaseserve.quant.formats import (
    UnsupportedFormatError,
    int4_to_ct,
    pack_int32_nibbles,
    unpack_int32_nibbles,
)
from phaseserve.quant.loader import load_checkpoint
from phaseserve.quant.quantize import named_leaves
from tests.unit.quant_writers import fp8_blocks, int4_groups, pack_int32, tiny_deepseek

_LINEAR_SKIP = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")


def _rewrite(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"))


def write_fp8(src: Path, dst: Path) -> None:
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if t.ndim == 2 and name.endswith(".weight") and not any(s in name for s in _LINEAR_SKIP):
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(t.float())
        else:
            tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() and "correction" not in name else t
    _rewrite(src, dst, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]})


def write_ct_int4(src: Path, dst: Path, group: int = 32, rule: str = "phaseserve") -> None:
    """Kimi K2-Thinking layout: routed experts int4 pack-quantized, everything else bf16."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if ".mlp.experts." in name:
            q, scale = int4_groups(t.float(), group, rule)
            base = name[: -len(".weight")]
            tensors[base + ".weight_packed"] = pack_int32(q)
            tensors[base + ".weight_scale"] = scale
            tensors[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() and "correction" not in name else t
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    _rewrite(src, dst, tensors, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                                 "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random DeepSeek-V3 (MLA + MoE) saved by transformers; dims give several and partial FP8 blocks."""
    d = tmp_path_factory.mktemp("hf") / "base"
    tiny_deepseek().save_pretrained(d)
    return d


def _assert_same_tree(got, want) -> None:
    g, w = dict(named_leaves(got)), dict(named_leaves(want))
    assert g.keys() == w.keys()
    for path in w:
        a, b = g[path], w[path]
        assert type(a) is type(b), path
        if isinstance(b, Fp8Weight):
            assert tuple(a.block) == tuple(b.block), path
            fields = ((a.q, b.q), (a.scale, b.scale))
        elif isinstance(b, Int4Weight):
            assert a.group_size == b.group_size, path
            fields = ((a.packed, b.packed), (a.scale, b.scale))
        else:
            fields = ((a, b),)
        for x, y in fields:
            assert x.dtype == y.dtype and x.shape == y.shape, path
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), path


# ---- packing ------------------------------------------------------------------------------------------
def test_int32_packing_order_matches_compressed_tensors():
    q = torch.randint(-8, 8, (5, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    packed = pack_int32(q).numpy()
    nib = unpack_int32_nibbles(packed, 64)
    assert np.array_equal(nib.astype(np.int16) - 8, q.numpy())
    assert np.array_equal(pack_int32_nibbles(nib), packed)
    # column 8j + i sits in word j, bits 4i..4i+3: an explicit word
    row = np.array([[1, 2, 3, 4, 5, 6, 7, 8]], np.uint8)
    assert pack_int32_nibbles(row).view(np.uint32)[0, 0] == 0x87654321
    assert pack_int32(torch.tensor([[-7, -6, -5, -4, -3, -2, -1, 0]], dtype=torch.int8)).numpy().view(
        np.uint32)[0, 0] == 0x87654321


# ---- FP8 (DeepSeek-V3 / GLM) ----------------------------------------------------------------------------
def test_fp8_checkpoint_equals_direct_quantization(hf_dir, tmp_path):
    write_fp8(hf_dir, tmp_path / "fp8")
    cfg, loaded = load_checkpoint(tmp_path / "fp8", dtype="bfloat16", policy="glm-fp8")
    _, base = ps.load_checkpoint(hf_dir, "float32")
    direct = quantize_params(base, "glm-fp8")  # the float weights the file was written from
    wkv_a = loaded.layers[0].attn.wkv_a
    assert isinstance(wkv_a, Fp8Weight) and wkv_a.block == (128, 128) and wkv_a.scale.shape == (1, 2)
    assert isinstance(loaded.layers[1].mlp.w_up, Fp8Weight) and loaded.layers[1].mlp.w_up.q.shape == (8, 128, 128)
    _assert_same_tree(loaded, direct)


def test_fp8_checkpoint_converted_at_load(hf_dir, tmp_path):
    write_fp8(hf_dir, tmp_path / "fp8")
    _, decode = load_checkpoint(tmp_path / "fp8", dtype="bfloat16", policy="kimi-int4")
    assert isinstance(decode.layers[1].mlp.w_down, Int4Weight) and decode.layers[1].mlp.w_down.group_size == 32
    assert decode.layers[1].attn.wo.dtype == jnp.bfloat16  # fp8 -> plain bf16 for the decode copy
    _, fp8 = load_checkpoint(tmp_path / "fp8", dtype="bfloat16")
    want = np.asarray(fp8.layers[1].attn.wo.dequantize(jnp.float32).astype(jnp.bfloat16)).view(np.uint16)
    assert np.array_equal(np.asarray(decode.layers[1].attn.wo).view(np.uint16), want)


# ---- compressed-tensors INT4 (Kimi K2-Thinking / K2.5 / K2.6) ---------------------------------------------
def test_ct_int4_checkpoint_equals_direct_quantization(hf_dir, tmp_path):
    write_ct_int4(hf_dir, tmp_path / "int4")
    cfg, shipped = load_checkpoint(tmp_path / "int4", dtype="bfloat16")
    w = shipped.layers[1].mlp.w_gate
    assert isinstance(w, Int4Weight) and w.group_size == 32 and w.scale.dtype == jnp.bfloat16
    assert shipped.layers[1].mlp.router.dtype == jnp.float32  # as the plain loader keeps routers
    _, loaded = load_checkpoint(tmp_path / "int4", dtype="bfloat16", policy="kimi-int4")
    assert loaded.layers[1].mlp.w_gate is not None and loaded.layers[1].mlp.w_gate.packed is not None
    _, base = ps.load_checkpoint(hf_dir, "float32")
    _assert_same_tree(loaded, quantize_params(base, "kimi-int4"))
    # and back to the file's own words
    packed, scale, shape = int4_to_ct(Int4Weight(w.packed[3], w.scale[3], 32))
    ref = load_file(str(tmp_path / "int4" / "model.safetensors"))
    assert np.array_equal(packed, ref["model.layers.1.mlp.experts.3.gate_proj.weight_packed"].numpy())
    assert list(shape) == ref["model.layers.1.mlp.experts.3.gate_proj.weight_shape"].tolist()


def test_kimi_k25_multimodal_wrapper(hf_dir, tmp_path):
    """K2.5/K2.6 ship the language model under ``language_model.`` inside a multimodal wrapper (config in
    ``text_config``) next to a vision tower: the text model loads exactly as the unwrapped checkpoint."""
    write_ct_int4(hf_dir, tmp_path / "int4")
    inner = json.loads((tmp_path / "int4" / "config.json").read_text())
    d = tmp_path / "k26"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                               "model_type": "kimi_k25", "text_config": inner}))
    tensors = {"language_model." + k: v for k, v in load_file(str(tmp_path / "int4" / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.rand(8, 3, 2, 2) + 0.5
    tensors["mm_projector.proj.0.weight"] = torch.rand(8, 8) + 0.5
    save_file(tensors, str(d / "model.safetensors"))
    cfg, wrapped = load_checkpoint(d, dtype="bfloat16")
    _, plain = load_checkpoint(tmp_path / "int4", dtype="bfloat16")
    assert cfg.num_experts == 8 and isinstance(wrapped.layers[1].mlp.w_up, Int4Weight)
    _assert_same_tree(wrapped, plain)


def test_ct_int4_with_compressed_tensors_scale_rule(hf_dir, tmp_path):
    """Scales chosen by compressed-tensors' own observer (amax / 7.5): the loaded weight dequantizes to
    exactly the file's ``q * scale``, whatever rule produced it."""
    write_ct_int4(hf_dir, tmp_path / "ct", group=128, rule="ct")
    _, loaded = load_checkpoint(tmp_path / "ct", dtype="float32")
    ref = load_file(str(tmp_path / "ct" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.down_proj"
    q = torch.stack([(ref[name + ".weight_packed"] >> (4 * i)) & 0xF for i in range(8)], -1).reshape(128, -1) - 8
    want = (q.float() * ref[name + ".weight_scale"].float().repeat_interleave(128, 1)).T.numpy()
    got = np.asarray(dequantize_int4(Int4Weight(loaded.layers[1].mlp.w_down.packed[5],
                                                loaded.layers[1].mlp.w_down.scale[5], 128)))
    assert loaded.layers[1].mlp.w_down.group_size == 128 and np.array_equal(got, want)


# ---- errors -----------------------------------------------------------------------------------------------
def test_format_errors_are_typed(hf_dir, tmp_path):
    write_fp8(hf_dir, tmp_path / "fp8")
    t = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    name = "model.layers.0.self_attn.o_proj.weight"

    def variant(tag: str, tensors: dict, qcfg: dict | None = None) -> Path:
        d = tmp_path / tag
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg or cfg["quantization_config"]}))
        save_file(tensors, str(d / "model.safetensors"))
        return d

    bad_scale = {**t, name + "_scale_inv": torch.rand(3, 3) + 0.5}
    with pytest.raises(ShapeMismatchError, match="weight_scale_inv"):
        load_checkpoint(variant("scale", bad_scale))
    extra = {**t, "model.layers.0.self_attn.q_b_proj.bias": torch.rand(3) + 0.5}
    with pytest.raises(UnexpectedTensorError):
        load_checkpoint(variant("extra", extra))
    write_ct_int4(hf_dir, tmp_path / "int4")
    t4 = load_file(str(tmp_path / "int4" / "model.safetensors"))
    ct = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    gone = {k: v for k, v in t4.items() if not k.endswith("experts.2.up_proj.weight_scale")}
    with pytest.raises(MissingTensorError, match="experts.2.up_proj.weight_scale"):
        load_checkpoint(variant("missing", gone, ct))
    asym = json.loads(json.dumps(ct))
    asym["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(UnsupportedFormatError, match="asymmetric"):
        load_checkpoint(variant("asym", t4, asym))
    assert resolve_policy("kimi-int4").rep("routed_experts").group_size == 32
