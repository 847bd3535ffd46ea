"""Reading the published quantized checkpoint formats straight into FP8 / INT4 weights (no BF16 round trip).

**DeepSeek-V3 / GLM FP8** (``quantization_config = {"quant_method": "fp8", "weight_block_size": [bo, bi]}``):
each quantized ``nn.Linear`` stores ``weight`` as float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` f32
``[ceil(out/bo), ceil(in/bi)]`` with ``w ~= weight * scale_inv`` per block (the "inverse" is the scale that
*dequantizes*). Our :class:`Fp8Weight` is ``[in, out]`` with scale ``[ceil(in/bi), ceil(out/bo)]`` and block
``(bi, bo)``: both arrays are transposed, the fp8 bytes are not touched.

**compressed-tensors ``pack-quantized``** (Kimi K2-Thinking / K2.5 / K2.6; ``quant_method:
"compressed-tensors"``, symmetric ``int`` 4-bit weights, strategy ``group`` or ``channel``): each quantized
linear stores ``weight_packed`` int32 ``[out, in/8]``, ``weight_scale`` ``[out, in/G]`` (bf16 in Kimi's
files), ``weight_shape`` int32 ``[2]`` = ``(out, in)``. Packing (``compressed_tensors ... pack_to_int32``,
``packed_dim=1``): the signed value ``q in [-8, 7]`` is stored as ``q + 8``; input column ``c = 8*j + i`` goes
into word ``j`` at bits ``4*i .. 4*i+3`` (the first column in the least significant nibble)::

    word j of a row:  bits 31..28   27..24  ...   7..4     3..0
                      col 8j+7      col 8j+6 ...  col 8j+1  col 8j

Loading unpacks the nibbles as integers, transposes them to ``[in, out]`` and re-packs them into
:class:`Int4Weight`'s two-halves-per-group byte layout (see ``pallas_kernels/int4_matmul.py``); the scales are
transposed. No value is ever dequantized, so the loaded weight equals quantizing the same float weights
directly (bit for bit when the scale rule matches). The group size comes from ``quantization_config`` and
is checked against each tensor's scale shape.

:func:`load_quantized_checkpoint` reads any HF directory (plain, FP8 or pack-quantized) through
``phaseserve.model.loader.load_checkpoint``'s reader hook and can convert the result to another policy.
Kimi K2.5/K2.6's multimodal wrapper is unwrapped (``language_model.`` prefix dropped, vision tower skipped).
FP8 tensors are read from the safetensors bytes directly (its numpy/flax readers do not decode F8_E4M3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight, pack_int4, unpack_int4
from phaseserve.config import ModelConfig
from phaseserve.model.loader import (
    CheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    TensorStore,
    load_checkpoint,
    read_plain,
)
from phaseserve.model.params import ArrayInfo, Params
from phaseserve.quant.policy import QuantPolicy

_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}
_LM_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_COMPONENTS = ("_packed", "_scale_inv", "_scale", "_shape", "_zero_point", "_g_idx")


class UnsupportedFormatError(CheckpointError):
    """The checkpoint's quantization scheme is not one phaseserve reads."""


# ---- compressed-tensors int32 packing ------------------------------------------------------------------
def unpack_int32_nibbles(packed: np.ndarray, cols: int) -> np.ndarray:
    """compressed-tensors ``weight_packed`` i32[R, ceil(C/8)] -> unsigned nibbles u8[R, C] (= q + 8)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    nib = ((words[..., None] >> shifts) & 0xF).astype(np.uint8)  # [R, W, 8]: column 8*j + i
    return nib.reshape(packed.shape[0], -1)[:, :cols]


def pack_int32_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """Inverse of :func:`unpack_int32_nibbles`: u8[R, C] (values 0..15) -> i32[R, ceil(C/8)]."""
    r, c = nibbles.shape
    pad = (-c) % 8
    v = np.pad(nibbles.astype(np.uint32), ((0, 0), (0, pad))).reshape(r, -1, 8)
    words = np.bitwise_or.reduce(v << (np.arange(8, dtype=np.uint32) * 4), axis=-1)
    return words.astype(np.uint32).view(np.int32)


def ct_to_int4(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group_size: int) -> Int4Weight:
    """One compressed-tensors linear (HF ``[out, in]``) -> :class:`Int4Weight` ``[in, out]``, integers only."""
    out_f, in_f = (int(s) for s in shape)
    if scale.shape != (out_f, in_f // group_size):
        raise ShapeMismatchError(f"weight_scale has shape {scale.shape}, expected {(out_f, in_f // group_size)} "
                                 f"for group size {group_size}")
    nib = unpack_int32_nibbles(packed, in_f)  # [out, in]
    return pack_int4(jnp.asarray(nib.T), jnp.asarray(np.ascontiguousarray(scale.T)), group_size)


def int4_to_ct(w: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:class:`Int4Weight` ``[in, out]`` -> (``weight_packed``, ``weight_scale``, ``weight_shape``) in HF layout."""
    nib = (np.asarray(unpack_int4(w), np.int16) + 8).astype(np.uint8)  # [in, out]
    k, n = nib.shape
    return pack_int32_nibbles(nib.T), np.ascontiguousarray(np.asarray(w.scale).T), np.array([n, k], np.int32)


# ---- DeepSeek/GLM FP8 blocks ----------------------------------------------------------------------------
def fp8_from_hf(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> Fp8Weight:
    """``weight`` f8[out, in] + ``weight_scale_inv`` f32[ceil(out/bo), ceil(in/bi)], block (bo, bi) ->
    :class:`Fp8Weight` ``[in, out]`` with block (bi, bo). The fp8 bytes are only transposed."""
    bo, bi = block
    out_f, in_f = weight.shape
    want = (-(-out_f // bo), -(-in_f // bi))
    if scale_inv.shape != want:
        raise ShapeMismatchError(f"weight_scale_inv has shape {scale_inv.shape}, expected {want} for block {block}")
    return Fp8Weight(jnp.asarray(np.ascontiguousarray(weight.T)),
                     jnp.asarray(np.ascontiguousarray(scale_inv.T).astype(np.float32)), (bi, bo))


def fp8_to_hf(w: Fp8Weight) -> tuple[np.ndarray, np.ndarray]:
    """:class:`Fp8Weight` -> (``weight`` f8[out, in], ``weight_scale_inv`` f32) in HF layout."""
    return np.ascontiguousarray(np.asarray(w.q).T), np.ascontiguousarray(np.asarray(w.scale).T)


# ---- the reader hook -------------------------------------------------------------------------------------
class QuantizedTensorStore(TensorStore):
    """A :class:`TensorStore` that presents ``X.weight_packed/_scale/_shape`` and ``X.weight_scale_inv`` under
    the plain name ``X.weight`` (so the loader's missing/unexpected checks work on logical tensors).

    Multimodal wrappers (Kimi K2.5/K2.6 ``KimiK25ForConditionalGeneration``) are unwrapped: a
    ``language_model.`` prefix is dropped and vision tensors (``vision_tower.``, ``mm_projector.``,
    ``multi_modal_projector.``) are skipped; ``quantization_config`` may sit in ``text_config``."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.file_name: dict[str, str] = {}  # logical name -> name in the file
        weight_map = {}
        for n, f in self.weight_map.items():
            if n.startswith(_VISION_PREFIXES):
                continue
            logical = n[len(_LM_PREFIX):] if n.startswith(_LM_PREFIX) else n
            weight_map[logical], self.file_name[logical] = f, n
        self.weight_map = weight_map
        self.raw = set(weight_map)
        hf = json.loads((self.dir / "config.json").read_text())
        hf = hf.get("text_config", hf) if not hf.get("quantization_config") else hf
        self.qcfg = hf.get("quantization_config") or {}
        self.fp8_block = tuple(self.qcfg.get("weight_block_size") or (128, 128))
        self.group_sizes = _ct_group_sizes(self.qcfg)

    def names(self) -> set[str]:
        out = set()
        for n in self.raw:
            for c in _COMPONENTS:
                if n.endswith(".weight" + c):
                    n = n[: -len(c)]
                    break
            out.add(n)
        return out

    def has(self, name: str) -> bool:
        return name in self.raw

    def _slice(self, name: str):
        return self._handle(name).get_slice(self.file_name[name])

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.raw and name + "_shape" in self.raw:
            return tuple(int(s) for s in np.asarray(self.get(name + "_shape")).reshape(-1))
        return tuple(self._slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """Host numpy array; FP8 tensors, which safetensors' numpy/flax readers do not decode, are read
        straight from the file (header offsets) as ``ml_dtypes.float8_e4m3fn``."""
        fname = self.file_name[name]
        dtype = self._slice(name).get_dtype()
        if dtype not in _RAW_DTYPES:
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(self._handle(name).get_tensor(fname))
        path = self.dir / self.weight_map[name]
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n))[fname]
        start, end = meta["data_offsets"]
        raw = np.fromfile(path, np.uint8, count=end - start, offset=8 + n + start)
        return raw.view(_RAW_DTYPES[dtype]).reshape(meta["shape"])


def _ct_group_sizes(qcfg: dict) -> set[int]:
    if qcfg.get("quant_method") != "compressed-tensors":
        return set()
    fmt = qcfg.get("format")
    sizes = set()
    for group in (qcfg.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        gfmt = group.get("format") or fmt
        if gfmt != "pack-quantized" or w.get("num_bits") != 4 or w.get("type", "int") != "int":
            raise UnsupportedFormatError(f"compressed-tensors group {group} is not 4-bit int pack-quantized")
        if not w.get("symmetric", True):
            raise UnsupportedFormatError("asymmetric (zero-point) int4 is not supported")
        if group.get("input_activations"):
            raise UnsupportedFormatError("activation quantization is not supported (weight-only int4 only)")
        if w.get("strategy") == "group":
            sizes.add(int(w["group_size"]))
        elif w.get("strategy") != "channel":
            raise UnsupportedFormatError(f"int4 strategy {w.get('strategy')!r} is not supported")
    return sizes


def read_quantized(store: QuantizedTensorStore, names: list[str], transpose: bool, info: ArrayInfo) -> Any:
    """Loader hook: a leaf from packed int4, fp8 blocks or plain tensors (routed experts are stacked)."""
    first = names[0]
    kind = "int4" if store.has(first + "_packed") else "fp8" if store.has(first + "_scale_inv") else "plain"
    if kind == "plain":
        return read_plain(store, names, transpose, info)
    if not transpose:
        raise UnsupportedFormatError(f"{first}: only linear weights can be quantized")
    expect_hf = tuple(reversed(info.shape[-2:]))
    parts = []
    for n in names:
        for comp in ("_packed", "_scale", "_shape") if kind == "int4" else ("_scale_inv",):
            if not store.has(n + comp):
                raise MissingTensorError(f"checkpoint {store.dir} lacks tensor {n + comp!r}")
        if store.shape(n) != expect_hf:
            raise ShapeMismatchError(f"tensor {n!r} has shape {store.shape(n)}, expected {expect_hf}")
        if kind == "int4":
            scale = store.get(n + "_scale")
            group = expect_hf[1] // scale.shape[1]
            if store.group_sizes and group not in store.group_sizes and scale.shape[1] != 1:
                raise ShapeMismatchError(f"{n}_scale implies group size {group}, config says {store.group_sizes}")
            parts.append(ct_to_int4(store.get(n + "_packed"), scale, expect_hf, group))
        else:
            parts.append(fp8_from_hf(store.get(n), store.get(n + "_scale_inv"), store.fp8_block))
    if len(parts) == 1:
        return parts[0]
    if kind == "int4":
        return Int4Weight(jnp.stack([p.packed for p in parts]), jnp.stack([p.scale for p in parts]),
                          parts[0].group_size)
    return Fp8Weight(jnp.stack([p.q for p in parts]), jnp.stack([p.scale for p in parts]), parts[0].block)


def load_quantized_checkpoint(path: str | Path, dtype: str = "bfloat16", policy: str | QuantPolicy | None = None,
                              ) -> tuple[ModelConfig, Params]:
    """Read an HF checkpoint (plain, DeepSeek/GLM FP8, or compressed-tensors int4) as shipped: quantized
    linears become :class:`Fp8Weight` / :class:`Int4Weight`, the rest is cast to ``dtype``. With ``policy``,
    the result is converted to that policy afterwards; leaves already in the policy's representation are
    kept bit for bit (so ``policy="kimi-int4"`` on a Kimi checkpoint converts nothing)."""
    cfg, params = load_checkpoint(path, dtype, reader=read_quantized, store_factory=QuantizedTensorStore)
    if policy is not None:
        from phaseserve.quant.quantize import quantize_params

        params = quantize_params(params, policy)
    return cfg, params
