"""Helpers shared by the kernels: impl / interpret / target resolution, typed errors, the online-softmax
update that every attention kernel body runs, the split-K combine, and page dequantization.

``impl``: ``"auto"`` (the Pallas kernel on GPU/TPU, the XLA reference on CPU, and the reference wherever
the Pallas path refuses a shape), ``"pallas"`` (the kernel, or :class:`UnsupportedShapeError`) or
``"reference"``. ``interpret=None`` means interpret mode exactly when running on the CPU. ``target``
picks which kernel body to build: ``"gpu"`` (Pallas Triton) or ``"tpu"`` (Pallas Mosaic TPU); ``None``
follows the default backend, and on the CPU (interpret mode) it is ``"gpu"``. The lowering check passes
``target`` explicitly, but in a CPU process :func:`dispatch_kernel` with ``impl="pallas"`` and ``target=None``
builds the body per *lowering* platform with ``jax.lax.platform_dependent`` (``cuda``/``rocm`` -> Triton,
``tpu`` -> Mosaic, anything else -> interpret mode), so ``jax.export`` for any platform gets the right body.

Provenance: every kernel takes ``provenance=``, a ``collections.Counter`` owned by the caller (None: not recorded),
and records into it, at trace time, which implementation it built (``pallas``, ``reference``, or ``fallback`` with
the reason the Pallas path refused the shape), keyed ``(op, platform, impl, reason)``; :func:`provenance_rows` lists
one. There is no process-wide table: the engine's workers pass their own (``phaseserve.kernel_mesh``). Fallbacks are
also logged as warnings.

Dots: float32 operands use ``precision=HIGHEST`` (IEEE f32 on GPUs instead of TF32; full-precision passes on
TPU), so the float32 exact-parity mode stays exact on accelerators.

The online-softmax helpers are written with ops that both the Triton and the Mosaic TPU lowerings
accept (2-D values, keepdims reductions, ``jnp.where`` masks, ``lax.dot_general`` with f32 accumulation).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
TARGETS = ("gpu", "tpu")
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)
LOG = logging.getLogger("pallas_kernels")
# A provenance sink: (op, platform, impl, reason) -> number of traces that built it; platform is "cuda"/"tpu"/"default"
# under platform-dependent dispatch, else the explicit target or "any"; reason is "" except for fallbacks
Provenance = collections.Counter


class UnsupportedShapeError(ValueError):
    """The Pallas path does not support this shape/dtype combination (``impl="auto"`` then uses the reference)."""


def backend() -> str:
    """'cpu', 'gpu' or 'tpu' for the default backend."""
    return jax.default_backend()


def resolve_impl(impl: str) -> str:
    """``"auto"`` -> the Pallas kernel on GPU/TPU, the reference on CPU."""
    if impl not in ("auto", "pallas", "reference"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'reference', got {impl!r}")
    if impl == "auto":
        return "reference" if backend() == "cpu" else "pallas"
    return impl


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` -> interpret mode exactly when running on the CPU."""
    return backend() == "cpu" if interpret is None else bool(interpret)


def resolve_target(target: str | None) -> str:
    """``None`` -> the default backend's kernel ("tpu" on TPU, otherwise "gpu")."""
    if target is None:
        return "tpu" if backend() == "tpu" else "gpu"
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS} or None, got {target!r}")
    return target


def record(sink: Provenance | None, op: str, platform: str, impl: str, reason: str = "") -> None:
    """Count one trace of ``op`` built as ``impl`` ("pallas" | "reference" | "fallback") for ``platform`` in
    ``sink`` (None: not counted); a fallback is logged either way."""
    if sink is not None:
        sink[(op, platform, impl, reason)] += 1
    if impl == "fallback":
        LOG.warning("%s (%s): Pallas path refused, using the reference: %s", op, platform, reason)


def provenance_rows(sink: Provenance) -> list[dict]:
    """The builds recorded in ``sink`` as rows {op, platform, impl, reason, count} (sorted), for summaries and JSON."""
    return [dict(op=o, platform=p, impl=i, reason=r, count=n) for (o, p, i, r), n in sorted(sink.items())]


def dispatch(impl: str, run_pallas, run_reference, *, op: str = "kernel", platform: str = "any",
             provenance: Provenance | None = None):
    """Run ``run_pallas()`` or ``run_reference()`` per ``impl``; ``"auto"`` falls back on a refused shape
    (recorded in ``provenance`` and logged)."""
    if resolve_impl(impl) == "reference":
        record(provenance, op, platform, "reference")
        return run_reference()
    return _pallas_or_fallback(provenance, op, platform, impl == "pallas", run_pallas, run_reference)


def _pallas_or_fallback(sink: Provenance | None, op: str, platform: str, strict: bool, run_pallas, run_reference):
    """The kernel; on a refused shape, raise (strict) or use the reference, recorded as a fallback."""
    try:
        out = run_pallas()
    except UnsupportedShapeError as e:
        if strict:
            raise
        record(sink, op, platform, "fallback", str(e))
        return run_reference()
    record(sink, op, platform, "pallas")
    return out


def dispatch_kernel(op: str, impl: str, target: str | None, interpret: bool | None,
                    build: Callable[[str, bool], jax.Array], run_reference: Callable[[], jax.Array],
                    provenance: Provenance | None = None):
    """Build ``op`` per implementation and platform; ``build(target, interpret)`` runs the kernel; what was built
    is counted in ``provenance`` (the caller's sink; None: not counted).

    * ``target`` given, or ``interpret=True``: that one body (as :func:`dispatch`).
    * default backend GPU or TPU: that backend's body (``"auto"`` falls back to the reference on a refused shape).
    * default backend CPU: ``impl="auto"`` is the reference; ``impl="pallas"`` chooses the body per *lowering*
      platform with ``jax.lax.platform_dependent`` (cuda/rocm -> Triton, tpu -> Mosaic, other platforms ->
      interpret mode), so ``jax.export(..., platforms=["tpu"])`` from a CPU process builds the Mosaic body without
      ``target=``. Every branch is traced: a shape an accelerator branch refuses there falls back to the
      reference in that branch (recorded and logged); only the CPU (interpret) branch raises.
      ``"auto"`` does not trace the kernel bodies on a CPU, which keeps CPU model tracing as cheap as before.
    """
    if impl not in ("auto", "pallas", "reference"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'reference', got {impl!r}")
    if impl == "reference" or (impl == "auto" and backend() == "cpu" and target is None and interpret is None):
        record(provenance, op, "any", "reference")
        return run_reference()
    if target is not None or interpret is True or backend() != "cpu":
        tgt = resolve_target(target)
        return dispatch(impl, lambda: build(tgt, resolve_interpret(interpret)), run_reference, op=op,
                        platform=tgt, provenance=provenance)

    def branch(platform, tgt):
        return lambda: _pallas_or_fallback(provenance, op, platform, False, lambda: build(tgt, False), run_reference)

    def default():
        if interpret is None:
            return _pallas_or_fallback(provenance, op, "default", True, lambda: build("gpu", True), run_reference)
        record(provenance, op, "default", "reference")
        return run_reference()

    gpu = branch("cuda", "gpu")
    return jax.lax.platform_dependent(cuda=gpu, rocm=gpu, tpu=branch("tpu", "tpu"), default=default)


def check_gpu_fp8(what: str, dtype, interpret: bool) -> None:
    """Raise :class:`UnsupportedShapeError` (``impl="auto"``: the reference) when the compiled Triton body would
    convert FP8 on a GPU without FP8 conversions (compute capability < 8.9: Ampere and older). Interpret mode,
    export from a machine without a GPU, and sm_89+ (Ada, Hopper, Blackwell) pass."""
    if interpret or not is_fp8(dtype):
        return
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    cc = getattr(gpus[0], "compute_capability", None) if gpus else None
    if cc is not None and tuple(int(v) for v in str(cc).split(".")[:2]) < (8, 9):
        raise UnsupportedShapeError(f"{what}: FP8 needs a GPU with compute capability >= 8.9, this one is {cc}")


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def compute_dtype(*dtypes) -> jnp.dtype:
    """Dtype of the MXU/tensor-core operands: float32 if any operand is float32 (exact parity runs), else bf16."""
    return jnp.dtype(jnp.float32) if any(jnp.dtype(d) == jnp.float32 for d in dtypes) else jnp.dtype(jnp.bfloat16)


def dequantize_pages(pages: jax.Array, scales: jax.Array | None) -> jax.Array:
    """f32 values of paged KV: ``pages * scales`` broadcast over the trailing feature dim (identity when None).

    pages [..., F] (bf16 / f32 / float8_e4m3fn); scales f32[...] (one per token, or per token per head).
    """
    x = pages.astype(jnp.float32)
    return x if scales is None else x * scales.astype(jnp.float32)[..., None]


def dot_precision(a, b):
    """HIGHEST when an operand is float32 (no TF32 / bf16 passes), else the default (16-bit / FP8 operands)."""
    f32 = jnp.dtype(jnp.float32)
    return jax.lax.Precision.HIGHEST if f32 in (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) else None


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b[N, K]^T -> f32[M, N] (the logits product of decode attention)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=dot_precision(a, b),
                               preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] -> f32[M, N]."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=dot_precision(a, b),
                               preferred_element_type=jnp.float32)


def online_softmax_step(m_prev, l_prev, acc_prev, logits, values, *, p_scale=None, dot_dtype=jnp.float32):
    """One flash-decoding update over a block of T keys.

    m_prev, l_prev: f32[H, 1] running max / denominator (start at -inf / 0); acc_prev: f32[H, F] running
    unnormalized output; logits: f32[H, T] with masked keys at -inf; values: [T, F] (masked rows already
    zeroed); p_scale: optional f32[1, T] multiplied into the probabilities before the value product (the
    FP8 V scale folded into P; masked keys must carry 0, not NaN). Fully masked blocks are a no-op.
    """
    m_cur = jnp.max(logits, axis=1, keepdims=True)
    m_new = jnp.maximum(m_prev, m_cur)
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # all keys masked so far: avoid (-inf) - (-inf)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(logits - m_safe)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    if p_scale is not None:
        p = p * p_scale
    acc_new = alpha * acc_prev + dot_nn(p.astype(dot_dtype), values.astype(dot_dtype))
    return m_new, l_new, acc_new


def finalize(acc: jax.Array, den: jax.Array) -> jax.Array:
    """acc f32[..., F] / den f32[..., 1]; rows that saw no key (den == 0) give zeros, not NaN.

    NaN read from a page must come out as NaN (the integrity layer's finite guard looks for it), so the test is
    ``den == 0``, never ``den > 0`` (which is False for a NaN denominator and would silently zero the row)."""
    return jnp.where(den == 0, 0.0, acc / jnp.where(den == 0, 1.0, den))


def combine_splits(o: jax.Array, m: jax.Array, den: jax.Array, axis: int) -> jax.Array:
    """Merge split-K partials (XLA, outside the kernel).

    o f32[..., S, ..., F] unnormalized partial outputs; m, den f32[..., S, ...] their running max and sum,
    ``axis`` the split axis of ``m``/``den`` (the same axis of ``o``). Empty splits (den == 0) contribute
    nothing; rows where every split is empty give zeros.
    """
    m_max = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.where(den == 0, 0.0, jnp.exp(m - jnp.where(m_max == NEG_INF, 0.0, m_max)))  # NaN splits stay NaN
    num = jnp.sum(o * w[..., None], axis=axis)
    den = jnp.sum(den * w, axis=axis)[..., None]
    return finalize(num, den)


def token_mask_row(start, t: int, length) -> jax.Array:
    """bool[1, T]: key positions ``start + [0, T)`` that are below ``length``."""
    return start + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1) < length


def token_mask_col(start, t: int, length) -> jax.Array:
    """bool[T, 1]: the same mask as a column (for zeroing value rows)."""
    return start + jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0) < length
