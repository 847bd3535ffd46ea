"""Kernel dispatch: every Pallas kernel call of the model, with its implementation, its provenance, and under a
phase's mesh a ``jax.shard_map`` with explicit partition specs.

XLA cannot partition a Pallas (Triton / Mosaic) custom call: left to GSPMD, a kernel on sharded weights or a
sharded page pool gets its operands all-gathered onto every device. Inside the engine's jitted steps every kernel
call goes through this module instead. The specs come from :data:`DEFAULT_RULES` (logical axis -> mesh axis), the
same table ``phaseserve.sharding`` places the weights and the page pool with, through :func:`weight_spec` and
:func:`head_axis`, so a kernel's operands arrive exactly as they are stored:

========================  ===================================================  =========================
call                      per device (tp / ep: the mesh axes the rules give)    collective
========================  ===================================================  =========================
dense, column-parallel    x [..., K] (whole), w [K, N/tp] -> [..., N/tp]        none
dense, row-parallel       x [..., K/tp], w [K/tp, N] -> partial [..., N]        psum over tp
grouped (routed experts)  the rank's E/ep experts on the rows routed to them;   psum over ep (and tp when
                          gate/up columns or down rows split over tp            the expert width is split)
paged decode attention    q [B, H/tp, hd], K/V pages [P, S, KV/tp, hd]          none
MLA (and DSA sparse MLA)  q [B, H/tp, r | rope], latent pages replicated        none
flash prefill attention   q [B, T, H/tp, dk], k / v [B, S, KV/tp, .]            none
========================  ===================================================  =========================

Token exchange for routed experts: both phases hold their activations replicated over the mesh, so an EP rank
already has every token; it rotates the expert-sorted rows so that its own experts' (contiguous) rows come first,
runs the grouped kernel over its local experts (rows past them come out zero) and rotates back; the partial
outputs are summed over ``ep`` (every row is non-zero on exactly one rank, so the sum is exact). There is no
all-to-all: each rank receives the activations it already holds and contributes one all-reduce per projection.

A dimension is split only when every stored array of the weight allows it (an INT4 group or an FP8 scale block
never straddles two devices; :func:`weight_spec`); otherwise that dimension is replicated, in the placement and
in the kernel call alike.

Dispatch: every function here takes a :class:`KernelDispatch`, an immutable value passed down the call path as an
argument (the model's forward / prefill / decode functions and the paged cache's attention take it as ``kd``); nothing
is read from a context variable or a module global. It names the mesh, each weight's spec (keyed by the traced weight
object), the ``matmul_impl`` / ``attn_impl`` switches, the phase, and the provenance log its calls are recorded in.
:data:`DIRECT` (no mesh, ``"auto"``, no log; the default of every ``kd`` parameter) calls the kernels directly:
training, tests and tools. The engine's workers each build one for their phase, with their own ``kernels`` Counter as
the log; ``sharding.sharded_step`` binds the traced params' specs to it (:meth:`KernelDispatch.with_weights`) and
passes it to the step. With a mesh of more than one device, a call whose implementation resolves to the Pallas kernel
runs under ``shard_map``; the XLA reference path is left to GSPMD (plain XLA ops partition). Every call made with a
log is recorded in it: op, platform, implementation (``pallas``, ``reference``, ``fallback`` with its reason, ``xla``
for plain weights), layout (``gspmd``: left to XLA; ``shard_map tp@1``: the weight's dim 1 split over tp;
``shard_map heads@tp``: attention heads split; ``shard_map replicated``: whole operands on every device); once per
trace, so a count is the number of traced call sites, not of executions. Under ``impl="pallas"`` in a CPU process the
kernels are built per lowering platform, so the table lists the ``cuda`` and ``tpu`` bodies that were traced beside
the ``default`` (interpret-mode) body that ran.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels import common
from pallas_kernels import flash_prefill as _flash
from pallas_kernels import mla_attention as _mla
from pallas_kernels import paged_attention as _paged
from pallas_kernels import sparse_mla as _sparse
from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("expert_mlp", "tp"),
    ("experts", "ep"),
    ("vocab", None),
    ("embed", None),
    ("kv_lora", None),
    ("q_lora", None),
    ("head_dim", None),
    ("norm", None),
)
IMPLS = ("auto", "pallas", "reference")


# ---- specs from the rules ----------------------------------------------------------------------------------
def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules=DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec of one plain array, dropping mesh axes that do not divide the dimension."""
    if len(axes) != len(shape):
        return PartitionSpec()
    out = []
    for dim, ax in zip(shape, nn.logical_to_mesh_axes(axes, rules), strict=True):
        size = 1 if ax is None else mesh.shape[ax]
        out.append(ax if ax is not None and size > 1 and dim % size == 0 else None)
    return PartitionSpec(*out)


def _splits(w: Any, dim: int, size: int) -> bool:
    """Can dimension ``dim`` (negative) of weight ``w`` be split ``size`` ways with every stored array whole per
    device: INT4 groups and FP8 scale blocks never straddle two devices."""
    if isinstance(w, Int4Weight):
        return w.packed.shape[dim] % size == 0 and w.scale.shape[dim] % size == 0
    if isinstance(w, Fp8Weight):
        n, s = w.q.shape[dim], w.scale.shape[dim]
        block = {-2: w.block[0], -1: w.block[1]}.get(dim, 1)
        return n % size == 0 and (s == 1 or (s % size == 0 and n % (size * block) == 0))
    return w.shape[dim] % size == 0


def weight_spec(axes: tuple[str | None, ...], w: Any, mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """The spec of weight ``w`` (plain or quantized; ``w.shape`` is its logical shape) from its logical axes."""
    shape = tuple(w.shape)
    if len(axes) != len(shape):
        return PartitionSpec()
    out = []
    for i, ax in enumerate(nn.logical_to_mesh_axes(axes, rules)):
        size = 1 if ax is None else mesh.shape[ax]
        out.append(ax if ax is not None and size > 1 and _splits(w, i - len(shape), size) else None)
    return PartitionSpec(*out)


def component_specs(w: Any, spec: PartitionSpec) -> Any:
    """``spec`` for each stored array of ``w`` (a pytree like ``w``); an FP8 scale dim of size 1 (one block over
    the whole dim: per-channel scales) is replicated along it."""
    if not isinstance(w, Int4Weight | Fp8Weight):
        return spec
    return jax.tree.map(lambda a: PartitionSpec(*(None if a.shape[i] == 1 else ax for i, ax in enumerate(spec))), w)


def head_axis(mesh: Mesh, *heads: int, rules=DEFAULT_RULES) -> str | None:
    """The mesh axis attention heads split over (the rules' ``kv_heads``) when it divides every count in ``heads``
    and has more than one device; else None (replicated)."""
    ax = nn.logical_to_mesh_axes(("kv_heads",), rules)[0]
    if ax is None or mesh.shape[ax] == 1 or any(h % mesh.shape[ax] for h in heads):
        return None
    return ax


# ---- the dispatch -------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class KernelDispatch:
    """How the kernel calls of one step run: the mesh (None: one device), each weight's spec, the implementation
    switches, and the provenance log (owned by the caller, e.g. a worker's ``kernels``; None: not recorded).

    Immutable and passed explicitly (the ``kd`` argument of the model and cache functions); a worker's jitted step
    closes over its phase's dispatch and binds the traced weights' specs with :meth:`with_weights`."""

    mesh: Mesh | None = None
    matmul_impl: str = "auto"
    attn_impl: str = "auto"
    phase: str = ""
    log: collections.Counter | None = None  # (phase, op, platform, impl, reason, layout) -> traced calls
    specs: Mapping[int, tuple[Any, PartitionSpec]] = field(default_factory=dict)  # id(weight) -> (weight, spec)
    rules: tuple = DEFAULT_RULES

    def __post_init__(self):
        for name, impl in (("matmul_impl", self.matmul_impl), ("attn_impl", self.attn_impl)):
            if impl not in IMPLS:
                raise ValueError(f"{name} must be one of {IMPLS}, got {impl!r}")

    def with_weights(self, weights: Iterable[tuple[Any, tuple]]) -> KernelDispatch:
        """This dispatch with the specs of ``weights``, ``(weight, logical axes)`` pairs (a step's traced params)."""
        if self.mesh is None:
            return self
        specs = {id(w): (w, weight_spec(ax, w, self.mesh, self.rules)) for w, ax in weights}
        return dataclasses.replace(self, specs=specs)

    def spec(self, w: Any) -> PartitionSpec | None:
        hit = self.specs.get(id(w))
        return hit[1] if hit is not None and hit[0] is w else None

    def sharded(self, impl: str) -> bool:
        """shard_map this call: the Pallas kernel runs (not the reference) on more than one device."""
        return self.mesh is not None and self.mesh.size > 1 and common.resolve_impl(impl) == "pallas"

    @property
    def matmul_kernels(self) -> bool:
        """``matmul_impl`` resolves to the Pallas kernels (the MoE layer then dispatches through the grouped kernels,
        not the CPU's gathered / dense einsums)."""
        return common.resolve_impl(self.matmul_impl) == "pallas"

    @property
    def unsharded(self) -> str:
        """Layout label of a call left to GSPMD (or run on a single device)."""
        return "gspmd" if self.mesh is not None and self.mesh.size > 1 else "one device"

    def sink(self) -> collections.Counter | None:
        """A fresh Counter for one call's kernel builds (``pallas_kernels`` provenance), or None without a log."""
        return None if self.log is None else collections.Counter()

    def record(self, op: str, layout: str, built: collections.Counter | None) -> None:
        """Record one traced call in the log: what it built (``built``, from its sink); a call that built no kernel
        (a plain-weight matmul) as ``xla``."""
        if self.log is None:
            return
        rows = list(built.elements()) if built else []
        for o, p, i, r in rows or [(op, "any", "xla", "")]:
            self.log[(self.phase, o, p, i, r, layout)] += 1


DIRECT = KernelDispatch()  # no mesh, "auto" implementations, nothing recorded: the kernels called directly


def provenance_rows(log: collections.Counter) -> list[dict]:
    """Rows {phase, op, platform, impl, reason, count, layout} of a dispatch's ``log``."""
    keys = ("phase", "op", "platform", "impl", "reason", "layout")
    return [dict(zip(keys, k, strict=True), count=n) for k, n in sorted(log.items())]


def _smap(kd: KernelDispatch, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=kd.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _label(spec: PartitionSpec) -> str:
    """A weight's layout for the provenance table: ``"shard_map ep@0xtp@2"`` = dim 0 split over ep, dim 2 over tp."""
    return "shard_map " + ("x".join(f"{a}@{i}" for i, a in enumerate(spec) if a) or "replicated")


def plain(kd: KernelDispatch, op: str, run: Callable[[], jax.Array]) -> jax.Array:
    """A call that builds no kernel (a plain-weight matmul: XLA partitions it), recorded in ``kd``'s log."""
    out = run()
    kd.record(op, kd.unsharded, None)
    return out


# ---- matmuls -----------------------------------------------------------------------------------------------
def dense(kd: KernelDispatch, x: jax.Array, w: Any, run: Callable[..., jax.Array]) -> jax.Array:
    """``run(x, w, impl=..., provenance=...)`` (a quantized-weight matmul, x [..., K] @ w [K, N] -> [..., N]) per
    ``kd``: column-parallel (N split), row-parallel (K split, psum) or replicated, per the weight's spec."""
    impl, op, built = kd.matmul_impl, f"dense:{type(w).__name__}", kd.sink()
    if not kd.sharded(impl):
        out = run(x, w, impl=impl, provenance=built)
        kd.record(op, kd.unsharded, built)
        return out
    spec = kd.spec(w)
    spec = spec if spec is not None else PartitionSpec(None, None)
    k_ax, n_ax = spec
    lead = (None,) * (x.ndim - 1)

    def local(x, w):
        out = run(x, w, impl=impl, provenance=built)
        return jax.lax.psum(out, k_ax) if k_ax else out

    f = _smap(kd, local, (PartitionSpec(*lead, k_ax), component_specs(w, spec)), PartitionSpec(*lead, n_ax))
    out = f(x, w)
    kd.record(op, _label(spec), built)
    return out


def grouped_dense(kd: KernelDispatch, x: jax.Array, w: Any, group_sizes: jax.Array,
                  run: Callable[..., jax.Array]) -> jax.Array:
    """``run(x, w, group_sizes, impl=..., provenance=...)`` (ragged expert matmul: x [M, K] sorted by expert,
    w [E, K, N], group_sizes i32[E] -> [M, N]) per ``kd``: experts split over EP (rotate the rank's rows to the front,
    psum), the expert width over TP (column- or row-parallel)."""
    impl, op, built = kd.matmul_impl, f"grouped:{type(w).__name__}", kd.sink()
    if not kd.sharded(impl):
        out = run(x, w, group_sizes, impl=impl, provenance=built)
        kd.record(op, kd.unsharded, built)
        return out
    spec = kd.spec(w)
    spec = spec if spec is not None else PartitionSpec(None, None, None)
    e_ax, k_ax, n_ax = spec

    def local(x, gs, w):  # x [M, K(/tp)], gs i32[E] (all experts), w [E/ep, K(/tp), N(/tp)]
        if e_ax is None:
            out = run(x, w, gs, impl=impl, provenance=built)
        else:
            el = gs.shape[0] // kd.mesh.shape[e_ax]
            first = jax.lax.axis_index(e_ax) * el
            start = jnp.sum(jnp.where(jnp.arange(gs.shape[0]) < first, gs, 0))  # rows of earlier ranks' experts
            mine = jax.lax.dynamic_slice(gs, (first,), (el,))
            out = jnp.roll(run(jnp.roll(x, -start, axis=0), w, mine, impl=impl, provenance=built), start, axis=0)
        axes = tuple(a for a in (e_ax, k_ax) if a)
        return jax.lax.psum(out, axes) if axes else out

    f = _smap(kd, local, (PartitionSpec(None, k_ax), PartitionSpec(), component_specs(w, spec)),
              PartitionSpec(None, n_ax))
    out = f(x, group_sizes, w)
    kd.record(op, _label(spec), built)
    return out


# ---- attention (implementation: ``kd.attn_impl``) -------------------------------------------------------------
def _heads(kd: KernelDispatch, op: str, run: Callable[..., jax.Array], args: tuple,
           layout: Callable[[], tuple[Any, PartitionSpec, str]]) -> jax.Array:
    """``run(*args, provenance=...)`` per ``kd``: directly, or under ``shard_map`` with the ``(in_specs, out_spec,
    label)`` that ``layout()`` gives (the label names them in the log)."""
    built = kd.sink()
    if not kd.sharded(kd.attn_impl):
        out = run(*args, provenance=built)
        kd.record(op, kd.unsharded, built)
        return out
    in_specs, out_spec, label = layout()
    out = _smap(kd, functools.partial(run, provenance=built), in_specs, out_spec)(*args)
    kd.record(op, label, built)
    return out


def paged_decode_attention(kd: KernelDispatch, q, k_pages, v_pages, page_table, lengths, *, k_scales=None,
                           v_scales=None, sm_scale=None):
    """``pallas_kernels.paged_attention.paged_decode_attention`` with the heads split over the head axis when the
    pool is (q [B, H, hd], pages [P, S, KV, hd], scales f32[P, S, KV] | None, page_table i32[B, P'],
    lengths i32[B] -> [B, H, hd])."""
    def run(q, k, v, pt, lens, ks, vs, *, provenance):
        return _paged.paged_decode_attention(q, k, v, pt, lens, k_scales=ks, v_scales=vs, sm_scale=sm_scale,
                                             impl=kd.attn_impl, provenance=provenance)

    def layout():
        ax = head_axis(kd.mesh, q.shape[1], k_pages.shape[2])
        pages, scales, rep = PartitionSpec(None, None, ax, None), PartitionSpec(None, None, ax), PartitionSpec()
        in_specs = (PartitionSpec(None, ax, None), pages, pages, rep, rep, scales, scales)  # None scales: no arrays
        return in_specs, PartitionSpec(None, ax, None), f"shard_map heads@{ax}" if ax else "shard_map replicated"

    return _heads(kd, "paged_decode_attention", run, (q, k_pages, v_pages, page_table, lengths, k_scales, v_scales),
                  layout)


def mla_decode_attention(kd: KernelDispatch, q_latent, q_rope, latent_pages, page_table, lengths, *, scales=None,
                         sm_scale):
    """``pallas_kernels.mla_attention.mla_decode_attention`` with the heads split over the head axis and the
    latent pages replicated (q_latent [B, H, r], q_rope [B, H, rope], latent_pages [P, S, r + rope],
    scales f32[P, S] | None -> [B, H, r])."""
    def run(ql, qr, lat, pt, lens, sc, *, provenance):
        return _mla.mla_decode_attention(ql, qr, lat, pt, lens, scales=sc, sm_scale=sm_scale, impl=kd.attn_impl,
                                         provenance=provenance)

    return _latent_heads(kd, "mla_decode_attention", run, q_latent, q_rope, latent_pages, page_table, lengths, scales)


def sparse_mla_decode_attention(kd: KernelDispatch, q_latent, q_rope, latent_pages, page_table, indices, lengths, *,
                                scales=None, sm_scale):
    """``pallas_kernels.sparse_mla.sparse_mla_decode_attention`` (GLM-5 DSA: the selected tokens, indices
    i32[B, K]) laid out as :func:`mla_decode_attention`: heads split, latent pages and selection replicated."""
    def run(ql, qr, lat, pt, idx, lens, sc, *, provenance):
        return _sparse.sparse_mla_decode_attention(ql, qr, lat, pt, idx, lens, scales=sc, sm_scale=sm_scale,
                                                   impl=kd.attn_impl, provenance=provenance)

    return _latent_heads(kd, "sparse_mla_decode_attention", run, q_latent, q_rope, latent_pages, page_table, indices,
                         lengths, scales)


def _latent_heads(kd: KernelDispatch, op: str, run: Callable[..., jax.Array], q_latent, q_rope, *rest):
    """``run(q_latent [B, H, r], q_rope [B, H, rope], *rest)`` with the heads split, everything in ``rest``
    (latent pages, tables, lengths, scales) replicated."""
    def layout():
        ax = head_axis(kd.mesh, q_latent.shape[1])
        heads, rep = PartitionSpec(None, ax, None), PartitionSpec()
        return ((heads, heads, *(rep,) * len(rest)), heads,
                f"shard_map heads@{ax}, latent replicated" if ax else "shard_map replicated")

    return _heads(kd, op, run, (q_latent, q_rope, *rest), layout)


def flash_prefill(kd: KernelDispatch, q, k, v, q_positions, lengths=None, *, sm_scale: float):
    """``pallas_kernels.flash_prefill.flash_prefill`` with the heads split over the head axis (q [B, T, H, dk],
    k [B, S, KV, dk], v [B, S, KV, dv], q_positions i32[B, T], lengths i32[B] | None -> [B, T, H, dv])."""
    def run(q, k, v, pos, lens, *, provenance):
        return _flash.flash_prefill(q, k, v, pos, lens, sm_scale=sm_scale, impl=kd.attn_impl, provenance=provenance)

    def layout():
        ax = head_axis(kd.mesh, q.shape[2], k.shape[2])
        heads, rep = PartitionSpec(None, None, ax, None), PartitionSpec()
        return (heads, heads, heads, rep, rep), heads, f"shard_map heads@{ax}" if ax else "shard_map replicated"

    return _heads(kd, "flash_prefill", run, (q, k, v, q_positions, lengths), layout)
