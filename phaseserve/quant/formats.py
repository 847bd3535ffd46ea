"""The published quantized checkpoint layouts: what each tensor means, and how one becomes an FP8 / INT4 weight.

``config.json``'s ``quantization_config`` names the scheme (:func:`parse_scheme` accepts it or refuses it with
an :class:`UnsupportedFormatError` naming the scheme and the feature); the tensors beside each ``X.weight`` say
which layout a linear is stored in. HF stores linears ``[out, in]``; phaseserve's weights are ``[in, out]``, so
every array below is transposed on load and nothing else is touched (no value is dequantized and re-rounded).

===========================  ============================================  =========================================
layout (``quant_method``)    tensors of one linear (HF ``[out, in]``)      value / phaseserve weight
===========================  ============================================  =========================================
plain (none)                 ``weight`` bf16/f16/f32 ``[out, in]``          the array, cast to the load dtype
FP8 block (``fp8``,          ``weight`` F8_E4M3 ``[out, in]``,              ``w = weight * scale_inv`` per
DeepSeek-V3 / GLM)           ``weight_scale_inv`` f32/bf16/F8_E8M0          ``(bo, bi)`` block ->
                             ``[ceil(out/bo), ceil(in/bi)]``                :class:`Fp8Weight` block ``(bi, bo)``
FP8 tensor / channel         ``weight`` F8_E4M3, ``weight_scale`` (or       ``w = weight * scale`` -> Fp8Weight block
(``compressed-tensors``      ``_scale_inv``) ``[]``/``[1]`` (tensor) or     ``(in, out)`` scale ``[1, 1]`` (tensor)
float-quantized, AutoFP8)    ``[out, 1]``/``[out]`` (channel)               or ``(in, 1)`` scale ``[1, out]``
INT4 pack-quantized          ``weight_packed`` i32 ``[out, in/8]``,         ``w = (nibble - 8) * scale[group]`` ->
(``compressed-tensors``,     ``weight_scale`` bf16/f16/f32 ``[out, in/G]``  :class:`Int4Weight` group ``G`` (channel:
Kimi K2-Thinking/K2.5/K2.6)  (channel: ``[out, 1]``), ``weight_shape``      ``G = in``), nibbles re-packed
                             i32 ``[2]``; optional ``weight_g_idx``
                             i32 ``[in]``
===========================  ============================================  =========================================

Conventions and defaults:

- Scales always *multiply* (DeepSeek's ``scale_inv`` is the dequantizing scale). F8_E8M0 scales (transformers'
  ``scale_fmt="ue8m0"``, powers of two) and bf16/f16 scales are widened to f32 exactly (FP8 scales are f32).
- ``weight_block_size`` absent: ``[128, 128]`` (transformers' ``FineGrainedFP8Config`` default). ``null``: the
  scale's shape must be per-tensor or per-channel, else the tensor is refused by name.
- Packing of ``weight_packed`` (``compressed_tensors ... pack_to_int32``, ``packed_dim=1``): the signed value
  ``q in [-8, 7]`` is stored as ``q + 8``; input column ``c = 8*j + i`` is word ``j``, bits ``4*i .. 4*i+3``::

      word j of a row:  bits 31..28   27..24  ...   7..4     3..0
                        col 8j+7      col 8j+6 ...  col 8j+1  col 8j

- ``weight_g_idx`` (GPTQ act-order "group"): ``g_idx[c]`` is the scale group of input column ``c``. The
  trivial map ``c // G`` loads as :class:`Int4Weight`; any other map with ``G`` columns per group loads as
  :class:`~phaseserve.quant.actorder.ActOrderInt4Weight` (rows permuted into group order, the matmul gathers the
  activations); groups of unequal size load as the exact dequantization ``(nibble - 8) * scale[:, g_idx]``.

Refused (:class:`UnsupportedFormatError`, naming the scheme or tensor and the feature): asymmetric / zero-point
INT4 (``weight_zero_point``), W8A16 (8-bit int weights), W4A8 / W8A8-int (quantized activations), static FP8
activation scales (``input_scale``), F8_E5M2 weights, other ``quant_method``s and compressed-tensors formats.

Refused as corrupt (:class:`~phaseserve.model.loader.CorruptTensorError`, naming the tensor and its first bad
element): a scale (FP8 or INT4) that is not finite and positive (NaN, Inf, negative or zero: the weight would
dequantize to NaN, Inf, zero or flipped signs), and an F8_E4M3 weight holding a NaN byte (``0x7f`` / ``0xff``).
A ``quantization_config`` whose block or group sizes are not positive integers is a
:class:`~phaseserve.model.loader.CheckpointConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight, pack_int4, unpack_int4
from phaseserve.model.loader import CheckpointConfigError, CheckpointError, CorruptTensorError, ShapeMismatchError

DEFAULT_FP8_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default when weight_block_size is absent


class UnsupportedFormatError(CheckpointError):
    """The checkpoint uses a quantization scheme or feature phaseserve does not read (named in the message)."""


# ---- the scheme of quantization_config --------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheme:
    """What ``quantization_config`` allows: FP8 weights (with their block) and/or INT4 pack-quantized groups."""

    method: str | None = None  # None (plain), "fp8", "compressed-tensors"
    fp8: bool = False
    fp8_block: tuple[int, int] | None = None  # HF (out, in) block; None: per-tensor / per-channel scales only
    int4_groups: frozenset[int] = frozenset()  # group sizes; 0 stands for strategy "channel"


def _describe(w: dict) -> str:
    kind = f"{w.get('type', 'int')}{w.get('num_bits')}"
    extra = f" {w.get('group_size')}" if w.get("strategy") == "group" else ""
    sym = "" if w.get("symmetric", True) else " asymmetric"
    return f"{kind} {w.get('strategy')}{extra}{sym}"


def _sizes(field: str, value, n: int) -> tuple[int, ...]:
    """``n`` positive integers (a list of two, or one number) from a ``quantization_config`` field, or a
    :class:`CheckpointConfigError` naming it."""
    vals = value if isinstance(value, (list, tuple)) else [value]
    ok = len(vals) == n and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 31 for v in vals)
    if not ok:
        raise CheckpointConfigError(f"quantization_config {field}={value!r}: expected "
                                    f"{'a positive integer' if n == 1 else 'two positive integers'}")
    return tuple(vals)


def _object(field: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointConfigError(f"quantization_config{' ' + field if field else ''} is of type "
                                    f"{type(value).__name__}, not an object")
    return value


def parse_scheme(qcfg: dict) -> Scheme:
    """Validate ``quantization_config`` (empty: plain) and say what it allows; refusals name the scheme."""
    qcfg = _object("", qcfg)
    if not qcfg:
        return Scheme()
    method = qcfg.get("quant_method")
    if method == "fp8":
        if qcfg.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedFormatError(f"quant_method 'fp8' with fmt {qcfg.get('fmt')!r}: only e4m3 weights are read")
        if qcfg.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedFormatError(f"quant_method 'fp8' with activation_scheme {qcfg['activation_scheme']!r}: "
                                         "static activation scales are not supported (dynamic only)")
        block = qcfg["weight_block_size"] if "weight_block_size" in qcfg else DEFAULT_FP8_BLOCK
        return Scheme("fp8", fp8=True, fp8_block=_sizes("weight_block_size", block, 2) if block is not None else None)
    if method != "compressed-tensors":
        raise UnsupportedFormatError(f"quant_method {method!r} is not supported (phaseserve reads 'fp8' and "
                                     "'compressed-tensors')")
    fp8, block, groups = False, None, set()
    for gname, group in _object("config_groups", qcfg.get("config_groups")).items():
        group = _object(f"config_groups.{gname}", group)
        w = _object(f"config_groups.{gname}.weights", group.get("weights"))
        acts = _object(f"config_groups.{gname}.input_activations", group.get("input_activations")) or None
        fmt = group.get("format") or qcfg.get("format")
        what = f"compressed-tensors group {gname!r} ({_describe(w)}, format {fmt!r})"
        if w.get("type", "int") == "float" and w.get("num_bits") == 8:
            if fmt not in ("float-quantized", "naive-quantized"):
                raise UnsupportedFormatError(f"{what}: FP8 weights are read in format 'float-quantized' only")
            if acts and not acts.get("dynamic", False):
                raise UnsupportedFormatError(f"{what}: static activation scales (input_scale) are not supported")
            if w.get("strategy") == "block":
                block = _sizes(f"config_groups.{gname}.weights.block_structure", w.get("block_structure"), 2)
            elif w.get("strategy") not in ("tensor", "channel"):
                raise UnsupportedFormatError(f"{what}: FP8 strategy {w.get('strategy')!r} is not supported")
            fp8 = True
            continue
        if w.get("type", "int") != "int" or w.get("num_bits") != 4:
            feature = "W8A16 (8-bit integer weights)" if w.get("num_bits") == 8 else "this weight type"
            raise UnsupportedFormatError(f"{what}: {feature} is not supported (INT4 pack-quantized and FP8 are)")
        if fmt != "pack-quantized":
            raise UnsupportedFormatError(f"{what}: INT4 is read in format 'pack-quantized' only")
        if acts:
            raise UnsupportedFormatError(f"{what}: W4A{acts.get('num_bits')} (quantized activations) is not "
                                         "supported; INT4 is weight-only (W4A16)")
        if not w.get("symmetric", True):
            raise UnsupportedFormatError(f"{what}: asymmetric (zero-point) INT4 is not supported")
        if w.get("strategy") == "group":
            groups.add(_sizes(f"config_groups.{gname}.weights.group_size", w.get("group_size"), 1)[0])
        elif w.get("strategy") == "channel":
            groups.add(0)
        else:
            raise UnsupportedFormatError(f"{what}: INT4 strategy {w.get('strategy')!r} is not supported")
    return Scheme("compressed-tensors", fp8=fp8, fp8_block=block, int4_groups=frozenset(groups))


# ---- values no checkpoint may hold ------------------------------------------------------------------------------
def check_scale(name: str, scale: np.ndarray) -> None:
    """A dequantizing scale (any float dtype, E8M0 included) must be finite and positive everywhere."""
    s = np.asarray(scale).astype(np.float32)
    bad = ~(np.isfinite(s) & (s > 0))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CorruptTensorError(f"tensor {name!r} has {int(bad.sum())} scale(s) that are not finite and positive "
                                 f"(first {float(s[first])} at {first}): the weight would dequantize to NaN, Inf, "
                                 "zero or flipped signs")


def check_e4m3(name: str, weight: np.ndarray) -> None:
    """An F8_E4M3 weight (e4m3fn: no Inf) must hold no NaN byte, ``0x7f`` or ``0xff``."""
    bad = (np.asarray(weight).view(np.uint8) & 0x7F) == 0x7F
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CorruptTensorError(f"tensor {name!r} has {int(bad.sum())} NaN F8_E4M3 byte(s) (0x7f / 0xff), first "
                                 f"at {first}")


# ---- compressed-tensors int32 packing ---------------------------------------------------------------------------
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


def int4_group(name: str, scale_shape: tuple[int, ...], in_f: int, scheme: Scheme) -> int:
    """The group size a ``weight_scale`` of ``scale_shape`` [out, in/G] implies, checked against the scheme."""
    cols = scale_shape[-1]
    group = in_f // cols if cols and in_f % cols == 0 else 0
    if not group or group % 2:
        raise ShapeMismatchError(f"{name}_scale has shape {scale_shape}: {in_f} input columns do not split into "
                                 "groups of an even size")
    allowed = {in_f if g == 0 else g for g in scheme.int4_groups}
    if group not in allowed:
        raise ShapeMismatchError(f"{name}_scale implies group size {group}, quantization_config allows "
                                 f"{sorted(allowed)}")
    return group


def ct_to_int4(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group_size: int) -> Int4Weight:
    """One compressed-tensors linear (HF ``[out, in]``) -> :class:`Int4Weight` ``[in, out]``, integers only."""
    out_f, in_f = (int(s) for s in shape)
    if scale.shape != (out_f, in_f // group_size):
        raise ShapeMismatchError(f"weight_scale has shape {scale.shape}, expected {(out_f, in_f // group_size)} "
                                 f"for group size {group_size}")
    nib = unpack_int32_nibbles(packed, in_f)  # [out, in]
    return pack_int4(jnp.asarray(nib.T), jnp.asarray(np.ascontiguousarray(scale.T)), group_size)


def ct_act_order(packed: np.ndarray, scale: np.ndarray, g_idx: np.ndarray, in_f: int) -> np.ndarray:
    """Act-order INT4: packed i32[out, in/8], scale [out, n_groups], g_idx i32[in] -> exact f32[in, out]."""
    q = unpack_int32_nibbles(packed, in_f).astype(np.float32) - 8.0  # [out, in]
    return np.ascontiguousarray((q * scale.astype(np.float32)[:, g_idx]).T)


def int4_to_ct(w: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:class:`Int4Weight` ``[in, out]`` -> (``weight_packed``, ``weight_scale``, ``weight_shape``) in HF layout."""
    nib = (np.asarray(unpack_int4(w), np.int16) + 8).astype(np.uint8)  # [in, out]
    k, n = nib.shape
    return pack_int32_nibbles(nib.T), np.ascontiguousarray(np.asarray(w.scale).T), np.array([n, k], np.int32)


# ---- FP8 (DeepSeek/GLM blocks; compressed-tensors / AutoFP8 tensor and channel scales) -------------------------
def fp8_scale_layout(name: str, scale_shape: tuple[int, ...], shape: tuple[int, int],
                     block: tuple[int, int] | None) -> tuple[int, int]:
    """The HF ``(bo, bi)`` block a scale of ``scale_shape`` stands for, for a weight of HF ``shape`` [out, in]."""
    out_f, in_f = shape
    if block is not None and tuple(scale_shape) == (-(-out_f // block[0]), -(-in_f // block[1])):
        return block
    if int(np.prod(scale_shape)) == 1 and len(scale_shape) <= 2:
        return out_f, in_f  # per tensor
    if tuple(scale_shape) in ((out_f, 1), (out_f,)):
        return 1, in_f  # per output channel
    if block is not None:
        want = (-(-out_f // block[0]), -(-in_f // block[1]))
        raise ShapeMismatchError(f"{name} has shape {tuple(scale_shape)}, expected {want} for block {block} "
                                 "(or a per-tensor / per-channel scale)")
    raise UnsupportedFormatError(f"{name} has shape {tuple(scale_shape)} and weight_block_size is null: a scale "
                                 "that is not per-tensor or per-channel needs a block size")


def fp8_from_hf(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> Fp8Weight:
    """``weight`` f8[out, in] + its dequantizing scale (any float dtype, reshaped to the ``(bo, bi)`` grid) ->
    :class:`Fp8Weight` ``[in, out]`` with block ``(bi, bo)``. The fp8 bytes are only transposed."""
    bo, bi = block
    out_f, in_f = weight.shape
    grid = np.asarray(scale).astype(np.float32).reshape(-(-out_f // bo), -(-in_f // bi))
    return Fp8Weight(jnp.asarray(np.ascontiguousarray(weight.T)), jnp.asarray(np.ascontiguousarray(grid.T)),
                     (bi, bo))

