"""The one checkpoint loader (``phaseserve.load_checkpoint``): any Hugging Face directory, plain or quantized.

It reads ``config.json``'s ``quantization_config`` (:func:`~phaseserve.quant.formats.parse_scheme`), then builds
each parameter leaf from the tensors its HF names point to (:mod:`phaseserve.model.loader` owns the names, the
shapes and the strict check), in the layout the file stores it (table in :mod:`phaseserve.quant.formats`):

- plain tensors -> arrays in ``dtype``;
- FP8 (block, per-channel or per-tensor scales, f32/bf16/E8M0) -> :class:`Fp8Weight`, bytes untouched;
- INT4 pack-quantized (group or channel) -> :class:`Int4Weight`, nibbles re-packed, scales transposed;
- act-order INT4 (non-trivial ``weight_g_idx``) -> :class:`~phaseserve.quant.actorder.ActOrderInt4Weight` (rows
  permuted into group order, the permutation kept; groups of unequal size: the exact dequantization in ``dtype``).

Every other variant is refused with a :class:`~phaseserve.model.loader.CheckpointError` subclass naming the
tensor (or scheme) and the feature; so is a tensor of the wrong dtype (``TensorDtypeError``: an integer scale, a
float ``weight_packed``) or with values no checkpoint holds (``CorruptTensorError``: scales that are not finite and
positive, NaN F8_E4M3 bytes; :func:`~phaseserve.quant.formats.check_scale`).

``strict=True`` (default): a tensor no leaf consumed (a stray ``weight_scale_inv`` beside a BF16 weight, a
``weight_zero_point``, an ``input_scale``) is an error naming it; ``strict=False`` loads the rest and lists what it
skipped in a ``SkippedTensorsWarning``.

``policy=`` converts the loaded tree to another representation with ``quantize_params``: leaves already in the
policy's representation are kept bit for bit, others are re-quantized from their float32 dequantization
(exact conversions are listed in the README).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight
from phaseserve.config import ModelConfig
from phaseserve.model import loader as base
from phaseserve.model.loader import INT_DTYPES, MissingTensorError, ShapeMismatchError, TensorDtypeError, TensorStore
from phaseserve.model.params import ArrayInfo, Params
from phaseserve.qarrays import dequantize
from phaseserve.quant import actorder
from phaseserve.quant.actorder import ActOrderInt4Weight, act_order_int4
from phaseserve.quant.formats import (
    Scheme,
    UnsupportedFormatError,
    check_e4m3,
    check_scale,
    ct_act_order,
    ct_to_int4,
    fp8_from_hf,
    fp8_scale_layout,
    int4_group,
    parse_scheme,
    unpack_int32_nibbles,
)
from phaseserve.quant.policy import QuantPolicy

__all__ = ["load_checkpoint", "read_quantized"]


def _kind(store: TensorStore, name: str) -> str:
    if name + "_packed" in store:
        return "int4"
    if name in store and store.dtype(name).startswith("F8"):
        return "fp8"
    return "plain"


SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})
FP8_SCALE_DTYPES = SCALE_DTYPES | {"F8_E8M0"}
PACKED_DTYPES = frozenset({"I32", "U32"})


def _need(store: TensorStore, name: str, why: str) -> None:
    if name not in store:
        raise MissingTensorError(f"checkpoint {store.dir} lacks tensor {name!r} ({why})")


def _dtype(store: TensorStore, name: str, allowed: frozenset[str], what: str) -> None:
    if store.dtype(name) not in allowed:
        raise TensorDtypeError(f"tensor {name!r} is {store.dtype(name)}: {what} is stored as one of "
                               f"{', '.join(sorted(allowed))}")


def _read_int4(store: TensorStore, n: str, hf_shape: tuple[int, int], scheme: Scheme) -> tuple[Any, set[str]]:
    """One pack-quantized linear ``n`` (``X.weight``) -> Int4Weight [in, out]; act-order: ActOrderInt4Weight, or
    f32 [in, out] (the exact dequantization) when its groups are of unequal size."""
    if not scheme.int4_groups:
        raise UnsupportedFormatError(f"{n}_packed: INT4 pack-quantized tensor, but quantization_config declares no "
                                     "compressed-tensors INT4 scheme")
    if n + "_zero_point" in store:
        raise UnsupportedFormatError(f"{n}_zero_point: asymmetric (zero-point) INT4 is not supported")
    _need(store, n + "_scale", "the INT4 scales")
    _dtype(store, n + "_packed", PACKED_DTYPES, "INT4 packed nibbles (int32 words)")
    _dtype(store, n + "_scale", SCALE_DTYPES, "an INT4 scale")
    if len(store.shape(n + "_scale")) != 2:
        raise ShapeMismatchError(f"tensor {n + '_scale'!r} has shape {store.shape(n + '_scale')}, expected "
                                 f"[{hf_shape[0]}, in/group]")
    used = {n + "_packed", n + "_scale"}
    if n + "_shape" in store:
        _dtype(store, n + "_shape", INT_DTYPES, "a weight shape")
        shape = tuple(int(s) for s in np.asarray(store.get(n + "_shape")).reshape(-1))
        if shape != hf_shape:
            raise ShapeMismatchError(f"tensor {n + '_shape'!r} says {shape}, expected {hf_shape}")
        used.add(n + "_shape")
    out_f, in_f = hf_shape
    if store.shape(n + "_packed") != (out_f, -(-in_f // 8)):
        raise ShapeMismatchError(f"tensor {n + '_packed'!r} has shape {store.shape(n + '_packed')}, expected "
                                 f"{(out_f, -(-in_f // 8))}")
    scale = store.get(n + "_scale")  # [out, in/G]
    check_scale(n + "_scale", scale)
    if scale.dtype == np.float16:
        scale = scale.astype(np.float32)  # exact; Int4Weight keeps f32 or bf16 scales
    group = int4_group(n, scale.shape, in_f, scheme)
    packed = store.get(n + "_packed")
    if n + "_g_idx" in store:
        _dtype(store, n + "_g_idx", INT_DTYPES, "a group index")
        used.add(n + "_g_idx")
        g_idx = np.asarray(store.get(n + "_g_idx")).astype(np.int64).reshape(-1)
        if g_idx.shape != (in_f,) or g_idx.min() < 0 or g_idx.max() >= scale.shape[1]:
            raise ShapeMismatchError(f"tensor {n + '_g_idx'!r} must map {in_f} columns to groups "
                                     f"0..{scale.shape[1] - 1}")
        if not np.array_equal(g_idx, np.arange(in_f) // group):  # act-order: INT4 over permuted rows
            permuted = act_order_int4(unpack_int32_nibbles(packed, in_f), scale, g_idx, group)
            return (permuted if permuted is not None else ct_act_order(packed, scale, g_idx, in_f)), used
    return ct_to_int4(packed, scale, hf_shape, group), used


def _read_fp8(store: TensorStore, n: str, hf_shape: tuple[int, int], scheme: Scheme) -> tuple[Fp8Weight, set[str]]:
    """One FP8 linear ``n`` with ``weight_scale_inv`` (DeepSeek) or ``weight_scale`` (compressed-tensors)."""
    if store.dtype(n) != "F8_E4M3":
        raise UnsupportedFormatError(f"{n} is {store.dtype(n)}: only F8_E4M3 weights are read")
    if not scheme.fp8:
        raise UnsupportedFormatError(f"{n} is F8_E4M3, but quantization_config declares no FP8 scheme")
    scale_name = n + "_scale_inv" if n + "_scale_inv" in store else n + "_scale"
    _need(store, scale_name, "the scale of an F8_E4M3 weight")
    if store.shape(n) != hf_shape:
        raise ShapeMismatchError(f"tensor {n!r} has shape {store.shape(n)}, expected {hf_shape}")
    _dtype(store, scale_name, FP8_SCALE_DTYPES, "an FP8 scale")
    block = fp8_scale_layout(scale_name, store.shape(scale_name), hf_shape, scheme.fp8_block)
    weight, scale = store.get(n), store.get(scale_name)  # f8[out, in], [out/bo, in/bi] (or per tensor / channel)
    check_e4m3(n, weight)
    check_scale(scale_name, scale)
    return fp8_from_hf(weight, scale, block), {n, scale_name}


def _stack(parts: list[Any], names: list[str]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(p, np.ndarray) for p in parts):  # act-order experts with unequal groups: all as float
        return np.stack([p if isinstance(p, np.ndarray) else np.asarray(dequantize(p, jnp.float32)) for p in parts])
    if any(isinstance(p, ActOrderInt4Weight) for p in parts):  # some experts act-order: all with a permutation
        parts = [p if isinstance(p, ActOrderInt4Weight) else actorder.identity(p) for p in parts]
        inner = [p.w for p in parts]
    else:
        inner = parts
    statics = {(p.group_size, p.scale.dtype) if isinstance(p, Int4Weight) else p.block for p in inner}
    if len(statics) > 1:
        raise UnsupportedFormatError(f"{names[0]} .. {names[-1]}: stacked experts use different quantization "
                                     f"layouts {sorted(map(str, statics))}")
    if isinstance(parts[0], ActOrderInt4Weight):
        return actorder.stack(parts)
    if isinstance(parts[0], Int4Weight):
        return Int4Weight(jnp.stack([p.packed for p in parts]), jnp.stack([p.scale for p in parts]),
                          parts[0].group_size)
    return Fp8Weight(jnp.stack([p.q for p in parts]), jnp.stack([p.scale for p in parts]), parts[0].block)


def read_quantized(store: TensorStore, names: list[str], transpose: bool, info: ArrayInfo, qcfg: dict,
                   ) -> tuple[Any, set[str]]:
    """Leaf reader for ``model.loader.read_checkpoint``: a leaf in the layout its tensors are stored in."""
    scheme = parse_scheme(qcfg)
    kinds = {_kind(store, n) for n in names}
    if kinds == {"plain"}:
        return base.read_plain(store, names, transpose, info, qcfg)
    if not transpose or len(kinds) > 1:
        why = "a quantized tensor where only a plain one is read" if not transpose else \
            f"stacked experts stored in different layouts ({sorted(kinds)})"
        raise UnsupportedFormatError(f"{names[0]}: {why}")
    hf_shape = tuple(reversed(info.shape[-2:]))
    parts, used = [], set()
    for n in names:
        part, consumed = (_read_int4 if "int4" in kinds else _read_fp8)(store, n, hf_shape, scheme)
        parts.append(part)
        used |= consumed
    return _stack(parts, names), used


def load_checkpoint(path: str | Path, dtype: str = "float32", *, strict: bool = True,
                    policy: str | QuantPolicy | None = None) -> tuple[ModelConfig, Params]:
    """Read an HF checkpoint (plain, FP8 or INT4 pack-quantized) as shipped: quantized linears become
    :class:`Fp8Weight` / :class:`Int4Weight`, everything else is cast to ``dtype`` (routers stay float32).

    ``strict``: any tensor the loader did not use is an ``UnexpectedTensorError`` naming it (default);
    ``strict=False`` skips them and lists them in a ``SkippedTensorsWarning``. ``policy``: convert the result
    to that policy (``quantize_params``); leaves already in its representation are kept bit for bit."""
    cfg, params = base.read_checkpoint(path, dtype, reader=read_quantized, strict=strict)
    if policy is not None:
        from phaseserve.quant.quantize import quantize_params

        params = quantize_params(params, policy)
    return cfg, params
