"""Pallas kernel calls under a phase's mesh: each one a ``jax.shard_map`` with explicit partition specs.

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

Scope: the engine's workers trace their steps inside :func:`kernel_scope` (``sharding.sharded_step`` builds it
from the model config and the params): it names the mesh, each weight's spec (keyed by the traced weight object),
and the ``matmul_impl`` / ``attn_impl`` switches. Outside a scope (training, tests, tools) the functions here call
the kernels directly, as before. Inside one, a call whose implementation resolves to the Pallas kernel on a mesh
of more than one device runs under ``shard_map``; the XLA reference path is left to GSPMD (plain XLA ops
partition). Every call is recorded (:meth:`KernelScope.trace`): op, platform, implementation (``pallas``,
``reference``, ``fallback`` with its reason, ``xla`` for plain weights), layout (``gspmd``: left to XLA;
``shard_map tp@1``: the weight's dim 1 split over tp; ``shard_map heads@tp``: attention heads split; ``shard_map
replicated``: whole operands on every device); once per trace, so a count is the number of traced call sites, not
of executions. Under ``impl="pallas"`` in a CPU process the kernels are built per lowering platform, so the table
lists the ``cuda`` and ``tpu`` bodies that were traced beside the ``default`` (interpret-mode) body that ran.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
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
# (phase, op, platform, impl, reason, layout) -> traced calls, over every scope of this process (benchmark JSON)
PROVENANCE: collections.Counter = collections.Counter()


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


# ---- the scope -----------------------------------------------------------------------------------------------
@dataclass
class KernelScope:
    """The mesh, weight specs and implementation switches for the steps traced inside :func:`kernel_scope`."""

    mesh: Mesh
    specs: dict[int, tuple[Any, PartitionSpec]]  # id(weight) -> (weight, spec): the traced params of the step
    matmul_impl: str = "auto"
    attn_impl: str = "auto"
    phase: str = ""
    log: collections.Counter = field(default_factory=collections.Counter)

    def spec(self, w: Any) -> PartitionSpec | None:
        hit = self.specs.get(id(w))
        return hit[1] if hit is not None and hit[0] is w else None

    def sharded(self, impl: str) -> bool:
        """shard_map this call: the Pallas kernel runs (not the reference) on more than one device."""
        return self.mesh.size > 1 and common.resolve_impl(impl) == "pallas"

    @property
    def unsharded(self) -> str:
        """Layout label of a call left to GSPMD (or run on a single device)."""
        return "gspmd" if self.mesh.size > 1 else "one device"

    def trace(self, op: str, layout: str, run: Callable[[], Any]) -> Any:
        """Run one call and record what it built (from ``pallas_kernels.common.PROVENANCE``); a call that built no
        kernel (a plain-weight matmul) is recorded as ``xla``."""
        before = collections.Counter(common.PROVENANCE)
        out = run()
        built = common.PROVENANCE - before
        rows = [(o, p, i, r) for (o, p, i, r) in built.elements()] or [(op, "any", "xla", "")]
        for o, p, i, r in rows:
            key = (self.phase, o, p, i, r, layout)
            self.log[key] += 1
            PROVENANCE[key] += 1
        return out


_SCOPE: contextvars.ContextVar[KernelScope | None] = contextvars.ContextVar("kernel_scope", default=None)


@contextlib.contextmanager
def kernel_scope(mesh: Mesh, weights: Iterable[tuple[Any, tuple]], *, matmul_impl: str = "auto",
                 attn_impl: str = "auto", phase: str = "", log: collections.Counter | None = None,
                 rules=DEFAULT_RULES) -> Iterator[KernelScope]:
    """Trace kernel calls on ``mesh``: ``weights`` are ``(weight, logical axes)`` pairs (the step's traced params)."""
    for name, impl in (("matmul_impl", matmul_impl), ("attn_impl", attn_impl)):
        if impl not in IMPLS:
            raise ValueError(f"{name} must be one of {IMPLS}, got {impl!r}")
    specs = {id(w): (w, weight_spec(ax, w, mesh, rules)) for w, ax in weights}
    scope = KernelScope(mesh, specs, matmul_impl, attn_impl, phase,
                        log if log is not None else collections.Counter())
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current() -> KernelScope | None:
    return _SCOPE.get()


def matmul_kernels_requested() -> bool:
    """True inside a scope whose ``matmul_impl`` resolves to the Pallas kernels (the MoE layer then dispatches
    through the grouped kernels, not the CPU's gathered / dense einsums)."""
    scope = _SCOPE.get()
    return scope is not None and common.resolve_impl(scope.matmul_impl) == "pallas"


def provenance_rows(log: collections.Counter | None = None) -> list[dict]:
    """Rows {phase, op, platform, impl, reason, layout, count} of ``log`` (default: this process's)."""
    log = PROVENANCE if log is None else log
    keys = ("phase", "op", "platform", "impl", "reason", "layout")
    return [dict(zip(keys, k, strict=True), count=n) for k, n in sorted(log.items())]


def _smap(scope: KernelScope, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=scope.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _label(spec: PartitionSpec) -> str:
    """A weight's layout for the provenance table: ``"shard_map ep@0xtp@2"`` = dim 0 split over ep, dim 2 over tp."""
    return "shard_map " + ("x".join(f"{a}@{i}" for i, a in enumerate(spec) if a) or "replicated")


def plain(op: str, run: Callable[[], jax.Array]) -> jax.Array:
    """A call that builds no kernel (a plain-weight matmul: XLA partitions it), recorded inside a scope."""
    scope = _SCOPE.get()
    return run() if scope is None else scope.trace(op, scope.unsharded, run)


# ---- matmuls -----------------------------------------------------------------------------------------------
def dense(x: jax.Array, w: Any, run: Callable[..., jax.Array]) -> jax.Array:
    """``run(x, w, impl=...)`` (a quantized-weight matmul, x [..., K] @ w [K, N] -> [..., N]) for this scope:
    column-parallel (N split), row-parallel (K split, psum) or replicated, per the weight's spec."""
    scope = _SCOPE.get()
    if scope is None:
        return run(x, w)
    impl, op = scope.matmul_impl, f"dense:{type(w).__name__}"
    spec = scope.spec(w)
    if not scope.sharded(impl):
        return scope.trace(op, scope.unsharded, lambda: run(x, w, impl=impl))
    spec = spec if spec is not None else PartitionSpec(None, None)
    k_ax, n_ax = spec
    lead = (None,) * (x.ndim - 1)

    def local(x, w):
        out = run(x, w, impl=impl)
        return jax.lax.psum(out, k_ax) if k_ax else out

    f = _smap(scope, local, (PartitionSpec(*lead, k_ax), component_specs(w, spec)), PartitionSpec(*lead, n_ax))
    return scope.trace(op, _label(spec), lambda: f(x, w))


def grouped_dense(x: jax.Array, w: Any, group_sizes: jax.Array, run: Callable[..., jax.Array]) -> jax.Array:
    """``run(x, w, group_sizes, impl=...)`` (ragged expert matmul: x [M, K] sorted by expert, w [E, K, N],
    group_sizes i32[E] -> [M, N]) for this scope: experts split over EP (rotate the rank's rows to the front,
    psum), the expert width over TP (column- or row-parallel)."""
    scope = _SCOPE.get()
    if scope is None:
        return run(x, w, group_sizes)
    impl, op = scope.matmul_impl, f"grouped:{type(w).__name__}"
    spec = scope.spec(w)
    if not scope.sharded(impl):
        return scope.trace(op, scope.unsharded, lambda: run(x, w, group_sizes, impl=impl))
    spec = spec if spec is not None else PartitionSpec(None, None, None)
    e_ax, k_ax, n_ax = spec

    def local(x, gs, w):  # x [M, K(/tp)], gs i32[E] (all experts), w [E/ep, K(/tp), N(/tp)]
        if e_ax is None:
            out = run(x, w, gs, impl=impl)
        else:
            el = gs.shape[0] // scope.mesh.shape[e_ax]
            first = jax.lax.axis_index(e_ax) * el
            start = jnp.sum(jnp.where(jnp.arange(gs.shape[0]) < first, gs, 0))  # rows of earlier ranks' experts
            mine = jax.lax.dynamic_slice(gs, (first,), (el,))
            out = jnp.roll(run(jnp.roll(x, -start, axis=0), w, mine, impl=impl), start, axis=0)
        axes = tuple(a for a in (e_ax, k_ax) if a)
        return jax.lax.psum(out, axes) if axes else out

    f = _smap(scope, local, (PartitionSpec(None, k_ax), PartitionSpec(), component_specs(w, spec)),
              PartitionSpec(None, n_ax))
    return scope.trace(op, _label(spec), lambda: f(x, group_sizes, w))


# ---- attention ---------------------------------------------------------------------------------------------
def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, k_scales=None, v_scales=None,
                           sm_scale=None, impl: str = "auto"):
    """``pallas_kernels.paged_attention.paged_decode_attention`` with the heads split over the head axis when the
    pool is (q [B, H, hd], pages [P, S, KV, hd], scales f32[P, S, KV] | None, page_table i32[B, P'],
    lengths i32[B] -> [B, H, hd])."""
    def run(q, k, v, pt, lens, ks, vs):
        return _paged.paged_decode_attention(q, k, v, pt, lens, k_scales=ks, v_scales=vs, sm_scale=sm_scale,
                                             impl=impl)

    args = (q, k_pages, v_pages, page_table, lengths, k_scales, v_scales)
    scope = _SCOPE.get()
    if scope is None:
        return run(*args)
    if not scope.sharded(impl):
        return scope.trace("paged_decode_attention", scope.unsharded, lambda: run(*args))
    ax = head_axis(scope.mesh, q.shape[1], k_pages.shape[2])
    pages, scales = PartitionSpec(None, None, ax, None), PartitionSpec(None, None, ax)
    rep = PartitionSpec()
    in_specs = (PartitionSpec(None, ax, None), pages, pages, rep, rep, scales, scales)  # None scales: no arrays
    f = _smap(scope, run, in_specs, PartitionSpec(None, ax, None))
    return scope.trace("paged_decode_attention", f"shard_map heads@{ax}" if ax else "shard_map replicated",
                       lambda: f(*args))


def mla_decode_attention(q_latent, q_rope, latent_pages, page_table, lengths, *, scales=None, sm_scale,
                         impl: str = "auto"):
    """``pallas_kernels.mla_attention.mla_decode_attention`` with the heads split over the head axis and the
    latent pages replicated (q_latent [B, H, r], q_rope [B, H, rope], latent_pages [P, S, r + rope],
    scales f32[P, S] | None -> [B, H, r])."""
    def run(ql, qr, lat, pt, lens, sc):
        return _mla.mla_decode_attention(ql, qr, lat, pt, lens, scales=sc, sm_scale=sm_scale, impl=impl)

    return _latent_heads("mla_decode_attention", impl, run, q_latent, q_rope, latent_pages, page_table, lengths,
                         scales)


def sparse_mla_decode_attention(q_latent, q_rope, latent_pages, page_table, indices, lengths, *, scales=None,
                                sm_scale, impl: str = "auto"):
    """``pallas_kernels.sparse_mla.sparse_mla_decode_attention`` (GLM-5 DSA: the selected tokens, indices
    i32[B, K]) laid out as :func:`mla_decode_attention`: heads split, latent pages and selection replicated."""
    def run(ql, qr, lat, pt, idx, lens, sc):
        return _sparse.sparse_mla_decode_attention(ql, qr, lat, pt, idx, lens, scales=sc, sm_scale=sm_scale,
                                                   impl=impl)

    return _latent_heads("sparse_mla_decode_attention", impl, run, q_latent, q_rope, latent_pages, page_table,
                         indices, lengths, scales)


def _latent_heads(op: str, impl: str, run: Callable[..., jax.Array], q_latent, q_rope, *rest):
    """``run(q_latent [B, H, r], q_rope [B, H, rope], *rest)`` with the heads split, everything in ``rest``
    (latent pages, tables, lengths, scales) replicated."""
    scope = _SCOPE.get()
    if scope is None:
        return run(q_latent, q_rope, *rest)
    if not scope.sharded(impl):
        return scope.trace(op, scope.unsharded, lambda: run(q_latent, q_rope, *rest))
    ax = head_axis(scope.mesh, q_latent.shape[1])
    heads, rep = PartitionSpec(None, ax, None), PartitionSpec()
    f = _smap(scope, run, (heads, heads, *(rep,) * len(rest)), heads)
    return scope.trace(op, f"shard_map heads@{ax}, latent replicated" if ax else "shard_map replicated",
                       lambda: f(q_latent, q_rope, *rest))


def flash_prefill(q, k, v, q_positions, lengths=None, *, sm_scale: float, impl: str | None = None):
    """``pallas_kernels.flash_prefill.flash_prefill`` with the heads split over the head axis (q [B, T, H, dk],
    k [B, S, KV, dk], v [B, S, KV, dv], q_positions i32[B, T], lengths i32[B] | None -> [B, T, H, dv]);
    ``impl=None``: the scope's ``attn_impl`` ("auto" outside a scope)."""
    scope = _SCOPE.get()
    impl = impl or (scope.attn_impl if scope is not None else "auto")

    def run(q, k, v, pos, lens):
        return _flash.flash_prefill(q, k, v, pos, lens, sm_scale=sm_scale, impl=impl)

    if scope is None:
        return run(q, k, v, q_positions, lengths)
    if not scope.sharded(impl):
        return scope.trace("flash_prefill", scope.unsharded, lambda: run(q, k, v, q_positions, lengths))
    ax = head_axis(scope.mesh, q.shape[2], k.shape[2])
    heads, rep = PartitionSpec(None, None, ax, None), PartitionSpec()
    f = _smap(scope, run, (heads, heads, heads, rep, rep), heads)
    return scope.trace("flash_prefill", f"shard_map heads@{ax}" if ax else "shard_map replicated",
                       lambda: f(q, k, v, q_positions, lengths))

