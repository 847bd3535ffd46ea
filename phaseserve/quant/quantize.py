"""Converting a params tree to a policy's representations, and the same conversion on abstract trees.

- :func:`tensor_class` names the class of a leaf from its path (see ``policy.py`` for the table).
- :func:`quantize_params` turns a plain (or already quantized) params tree into the representations of a
  :class:`~phaseserve.quant.policy.QuantPolicy`: RTN for FP8 and INT4, or GPTQ for INT4 when the policy asks
  for it and a :class:`~phaseserve.quant.calibrate.Calibration` is given. A leaf already in its target
  representation is kept as is (bit for bit), so a loaded FP8/INT4 checkpoint survives a second pass.
- :func:`abstract_quantized` gives the same tree with ``ArrayInfo`` leaves inside the ``Int4Weight`` /
  ``Fp8Weight`` containers: shapes, dtypes and logical axes of every stored array, nothing allocated. The
  size report counts it; orbax restores into it.

Storage of one ``[.., K, N]`` weight (``K`` = in, ``N`` = out):

=============  ===============================================  ==============================================
rep            arrays                                            bytes per weight value
=============  ===============================================  ==============================================
float32        ``f32[.., K, N]``                                 4
bfloat16       ``bf16[.., K, N]``                                2
fp8 (block)    ``q f8e4m3[.., K, N]``, ``scale f32[.., K/bk, N/bn]``  1 + 4/(bk*bn)
fp8 (channel)  ``q f8e4m3[.., K, N]``, ``scale f32[.., 1, N]``      1 + 4/K
int4           ``packed u8[.., K/2, N]``, ``scale [.., K/G, N]``     0.5 + sizeof(scale)/G
=============  ===============================================  ==============================================
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight, pack_int4
from phaseserve.config import ModelConfig, to_dtype
from phaseserve.model.loader import leaf_path as path_str  # one spelling of leaf paths: 'layers.3.attn.wq'
from phaseserve.model.params import ArrayInfo, abstract_params, is_info
from phaseserve.qarrays import is_quantized
from phaseserve.quant.actorder import ActOrderInt4Weight
from phaseserve.quant.calibrate import gptq_int4
from phaseserve.quant.policy import PolicyError, QuantPolicy, Rep, resolve_policy

_NORM_NAMES = re.compile(r"(^|\.)(attn_norm|mlp_norm|final_norm|q_norm|k_norm|kv_a_norm|q_a_norm|k_norm_w|k_norm_b)$")


def tensor_class(path: str, ndim: int) -> str:
    """The policy class of the leaf at ``path`` (``ndim`` tells routed experts from dense MLPs)."""
    if path == "embed":
        return "embeddings"
    if path == "lm_head":
        return "lm_head"
    if _NORM_NAMES.search(path):
        return "norms"
    if re.search(r"\.mlp\.(router|correction_bias)$", path):
        return "router"
    if ".mlp.shared." in path:
        return "shared_experts"
    if re.search(r"\.mlp\.w_(gate|up|down)$", path):
        return "routed_experts" if ndim == 3 else "dense_mlp"
    if ".attn." in path:
        return "attention"
    if path.startswith("mtp."):
        return "mtp"
    raise PolicyError(f"cannot classify parameter {path!r}")


def _is_unit(x: Any) -> bool:
    return is_info(x) or is_quantized(x)


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs where a quantized container counts as one leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_unit)
    return [(path_str(kp), x) for kp, x in flat]


def leaf_rep(x: Any) -> str:
    """A short label of a leaf's representation: ``bfloat16``, ``fp8:b128x128``, ``int4:g32:bf16``."""
    if isinstance(x, ActOrderInt4Weight):
        return leaf_rep(x.w) + ":act"
    if isinstance(x, Int4Weight):
        sd = "bf16" if _dtype_name(x.scale) == "bfloat16" else "f32"
        return f"int4:g{x.group_size}:{sd}"
    if isinstance(x, Fp8Weight):
        k = x.q.shape[-2]
        return "fp8:channel" if tuple(x.block) == (k, 1) and k != 1 else f"fp8:b{x.block[0]}x{x.block[1]}"
    return _dtype_name(x)


def _dtype_name(x: Any) -> str:
    return x.dtype if is_info(x) else str(jax.numpy.dtype(x.dtype))


def target_rep(policy: QuantPolicy, path: str, ndim: int) -> Rep:
    """The representation ``policy`` gives the leaf at ``path``: vectors take the base dtype, the router's
    correction bias stays float32."""
    if path.endswith("mlp.correction_bias"):
        return Rep("float32")
    rep = policy.rep(tensor_class(path, ndim))
    return Rep(policy.base) if (rep.quantized and ndim < 2) else rep


def _matches(x: Any, rep: Rep) -> bool:
    if rep.kind == "int4":
        if isinstance(x, ActOrderInt4Weight):  # a loaded GPTQ act-order weight: its nibbles are kept, not re-rounded
            x = x.w
        return isinstance(x, Int4Weight) and x.group_size == rep.group_size and _dtype_name(x.scale) == rep.scale_dtype
    if rep.kind == "fp8":
        if not isinstance(x, Fp8Weight):
            return False
        want = (x.q.shape[-2], 1) if rep.block is None else rep.block
        return tuple(x.block) == tuple(want)
    return not is_quantized(x) and _dtype_name(x) == rep.kind


# The quantizers below are pallas_kernels' ``quantize_int4`` / ``quantize_fp8`` (same formulas, same layouts),
# jitted, with the range maximum (7 or 448) passed in as a full array of the scales' shape: XLA on CPU turns a
# division by a constant *or broadcast scalar* into a multiplication by its reciprocal, which moves scales by
# one ulp and would make ``quantize_params`` differ from the reference quantizers of published checkpoints
# (torch's ``amax / 448``). Array-by-array division is IEEE-exact.
_INT4_MAX, _E4M3_MAX = 7.0, 448.0


def _full(shape: tuple[int, ...], value: float) -> np.ndarray:
    return np.full(shape, value, np.float32)


@partial(jax.jit, static_argnames=("group_size", "scale_dtype"))
def _rtn_int4(w: jax.Array, group_size: int, scale_dtype, qmax: jax.Array) -> Int4Weight:
    """w [..., K, N] -> Int4Weight: symmetric, scale = amax / qmax per group of K rows, q in [-8, 7].
    qmax f32[..., K/G, 1, N] (all 7)."""
    *lead, k, n = w.shape
    wg = w.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
    amax = jnp.max(jnp.abs(wg), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(scale_dtype)
    q = jnp.clip(jnp.round(wg / scale.astype(jnp.float32)), -8, 7).astype(jnp.int32) + 8
    return pack_int4(q.reshape(*lead, k, n).astype(jnp.uint8), scale[..., 0, :], group_size)


@partial(jax.jit, static_argnames=("block",))
def _fp8(w: jax.Array, block: tuple[int, int] | None, qmax: jax.Array) -> Fp8Weight:
    """w [..., K, N] -> Fp8Weight: scale = amax / qmax per (bk, bn) block (per output channel if None).
    qmax f32[..., ceil(K/bk), ceil(N/bn)] (all 448)."""
    *lead, k, n = w.shape
    bk, bn = (k, 1) if block is None else block
    kp, np_ = math.ceil(k / bk) * bk, math.ceil(n / bn) * bn
    wf = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, kp - k), (0, np_ - n)])
    amax = jnp.max(jnp.abs(wf.reshape(*lead, kp // bk, bk, np_ // bn, bn)), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    full = jnp.repeat(jnp.repeat(scale, bk, axis=-2), bn, axis=-1)[..., :k, :n]
    return Fp8Weight((w.astype(jnp.float32) / full).astype(jnp.float8_e4m3fn), scale, (bk, bn))


def _check_int4(path: str, shape: tuple[int, ...], rep: Rep) -> None:
    k = shape[-2]
    if k % rep.group_size:
        raise PolicyError(f"{path}: input dim {k} is not a multiple of the int4 group size {rep.group_size}")


def quantize_leaf(x: Any, rep: Rep, path: str = "?", hessian=None) -> Any:
    """Convert one leaf (plain array or container) to ``rep``. ``hessian`` (GPTQ statistics) is used only
    for ``int4`` with ``method="gptq"``; without it the leaf falls back to RTN."""
    if _matches(x, rep):
        return x
    w = x.dequantize(jnp.float32) if is_quantized(x) else x
    if not rep.quantized:
        return w.astype(to_dtype(rep.kind))
    if w.ndim < 2:
        raise PolicyError(f"{path}: cannot quantize a {w.ndim}-D tensor to {rep}")
    *lead, k, n = w.shape
    if rep.kind == "fp8":
        bk, bn = (k, 1) if rep.block is None else rep.block
        return _fp8(w, rep.block, _full((*lead, math.ceil(k / bk), math.ceil(n / bn)), _E4M3_MAX))
    _check_int4(path, w.shape, rep)
    if rep.method == "gptq" and hessian is not None:
        return gptq_int4(w, hessian, rep.group_size, rep.scale_dtype)
    qmax = _full((*lead, k // rep.group_size, 1, n), _INT4_MAX)
    return _rtn_int4(w, rep.group_size, to_dtype(rep.scale_dtype).type, qmax)


def quantize_params(params: Any, policy: str | QuantPolicy, calibration: Any = None) -> Any:
    """A new params tree in ``policy``'s representations (see module docstring).

    ``calibration`` (:class:`~phaseserve.quant.calibrate.Calibration`, from ``collect_calibration``) is required
    when an INT4 class uses ``method="gptq"``; weights it has no statistics for (e.g. MLA ``wkv_b``, which
    the model dequantizes rather than multiplies, or experts no calibration token reached) use RTN.
    """
    policy = resolve_policy(policy)
    if policy.uses("gptq") and calibration is None:
        raise PolicyError(f"policy {policy.name!r} uses GPTQ: pass calibration=collect_calibration(...)")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)
    out = []
    for kp, x in flat:
        path = path_str(kp)
        ndim = len(x.shape)
        rep = target_rep(policy, path, ndim)
        hess = calibration.hessian(path) if (calibration is not None and rep.method == "gptq") else None
        out.append(quantize_leaf(x, rep, path, hess))
    return jax.tree.unflatten(treedef, out)


def abstract_leaf(info: ArrayInfo, rep: Rep, path: str = "?") -> Any:
    """The stored arrays of ``info`` in ``rep`` as ``ArrayInfo`` leaves (inside a container if quantized)."""
    if not rep.quantized:
        return ArrayInfo(info.shape, rep.kind, info.axes, info.init)
    *lead, k, n = info.shape
    if rep.kind == "fp8":
        bk, bn = (k, 1) if rep.block is None else rep.block
        scale = ArrayInfo((*lead, math.ceil(k / bk), math.ceil(n / bn)), "float32", info.axes, "ones")
        return Fp8Weight(ArrayInfo(info.shape, "float8_e4m3fn", info.axes), scale, (bk, bn))
    _check_int4(path, info.shape, rep)
    packed = ArrayInfo((*lead, k // 2, n), "uint8", info.axes)
    scale = ArrayInfo((*lead, k // rep.group_size, n), rep.scale_dtype, info.axes, "ones")
    return Int4Weight(packed, scale, rep.group_size)


def abstract_quantized(cfg_or_tree: ModelConfig | Any, policy: str | QuantPolicy) -> Any:
    """``abstract_params`` in ``policy``'s representations: ``ArrayInfo`` leaves for every stored array."""
    policy = resolve_policy(policy)
    tree = abstract_params(cfg_or_tree) if isinstance(cfg_or_tree, ModelConfig) else cfg_or_tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)
    out = []
    for kp, info in flat:
        path = path_str(kp)
        out.append(abstract_leaf(info, target_rep(policy, path, len(info.shape)), path))
    return jax.tree.unflatten(treedef, out)


def shape_dtype_tree(abstract: Any) -> Any:
    """ArrayInfo leaves -> ``jax.ShapeDtypeStruct`` (containers kept)."""
    return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, to_dtype(i.dtype)), abstract, is_leaf=is_info)
