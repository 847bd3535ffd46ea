"""Logical axes -> mesh axes, and the prefill / decode meshes.

A mesh has two axes: ``ep`` (expert parallel) and ``tp`` (tensor parallel). Parameters carry logical axis
names (``phaseserve.model.params``); :data:`DEFAULT_RULES` (defined in ``phaseserve.kernel_mesh``, which the kernel
calls' ``shard_map`` specs come from too) maps them to mesh axes with flax's ``logical_to_mesh_axes``:

=============  ==========  =============================================================
logical axis   mesh axis   why
=============  ==========  =============================================================
q_heads        tp          attention heads split across TP ranks (column / row parallel)
kv_heads       tp          GQA KV heads (replicated when fewer than TP ranks divide them)
mlp            tp          dense FFN width
expert_mlp     tp          expert FFN width
experts        ep          routed experts split across EP ranks
kv_lora        (none)      MLA latent replicated across TP ranks, as real deployments do
everything     (none)      embeddings, norms, routers, q LoRA are replicated
=============  ==========  =============================================================

An axis whose size does not divide by its mesh axis is replicated instead (tiny test models). Quantized
weights (INT4 / FP8 pytrees) shard each of their arrays along the same logical axes as the plain weight, and only
where every array allows it (an INT4 group or FP8 scale block never straddles two devices).
:func:`sharded_step` hands a worker's step its kernel dispatch (``kernel_mesh.KernelDispatch``) with the traced
weights' specs bound, so its Pallas calls run under ``shard_map``.

Device sets that this machine does not have are a :class:`~phaseserve.config.ConfigError` that says how many
devices exist and how to simulate more on a CPU (:data:`SIMULATE_HINT`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from phaseserve.config import ConfigError, MeshConfig, ModelConfig
from phaseserve.kernel_mesh import DEFAULT_RULES, KernelDispatch, component_specs, head_axis, spec_for, weight_spec
from phaseserve.model.params import logical_axes, stored_params

__all__ = ["DEFAULT_RULES", "SIMULATE_HINT", "make_mesh", "mesh_of", "param_shardings", "phase_devices",
           "pick_devices", "pool_shardings", "replicated", "shard_params", "sharded_step", "spec_for",
           "split_devices", "weight_axes"]

SIMULATE_HINT = ("on a CPU, simulate N devices with XLA_FLAGS=--xla_force_host_platform_device_count=N, set "
                 "before jax is imported; or leave MeshConfig's device sets at None (they fit any machine)")


def _have(devices: list) -> str:
    kinds = sorted({d.platform for d in devices})
    return f"this machine has {len(devices)} {'/'.join(kinds)} device{'s' if len(devices) != 1 else ''}"


def pick_devices(devices: list, indices: tuple[int, ...], what: str) -> list:
    """``devices[i]`` for each index; an index the machine does not have is a ``ConfigError`` naming the fix."""
    bad = [i for i in indices if not 0 <= i < len(devices)]
    if bad:
        raise ConfigError(f"MeshConfig.{what}={tuple(indices)} names device(s) {bad}, but {_have(devices)} "
                          f"(indices 0..{len(devices) - 1}); {SIMULATE_HINT}")
    return [devices[i] for i in indices]


def make_mesh(devices: list, tp: int = 1, ep: int = 1) -> Mesh:
    """A ``(ep, tp)`` mesh over exactly ``tp * ep`` devices."""
    if len(devices) != tp * ep:
        raise ConfigError(f"a mesh of tp={tp} x ep={ep} needs {tp * ep} devices, got {len(devices)}; set the "
                          f"MeshConfig device set and tp/ep sizes to agree")
    return Mesh(np.asarray(devices, dtype=object).reshape(ep, tp), ("ep", "tp"))


def split_devices(devices: list, prefill: tuple[int, ...] | None, decode: tuple[int, ...] | None,
                  n_prefill: int, n_decode: int) -> tuple[list, list]:
    """Disjoint prefill and decode device lists (explicit indices, or the first n_prefill / next n_decode)."""
    if prefill is not None and decode is not None:
        pre, dec = pick_devices(devices, prefill, "prefill_devices"), pick_devices(devices, decode, "decode_devices")
    elif len(devices) >= n_prefill + n_decode:
        pre, dec = devices[:n_prefill], devices[n_prefill:n_prefill + n_decode]
    elif len(devices) == 1 and n_prefill == n_decode == 1:
        return devices, devices  # one device: the phases share it (still separate weights and representations)
    else:
        raise ConfigError(f"disaggregated serving with prefill_tp={n_prefill} and {n_decode} decode devices needs "
                          f"{n_prefill + n_decode} devices, but {_have(devices)}; {SIMULATE_HINT}")
    if set(map(id, pre)) & set(map(id, dec)):
        raise ConfigError("prefill and decode device sets overlap; disaggregated mode needs disjoint sets "
                          "(or use mode='colocated')")
    return pre, dec


def phase_devices(devices: list, mesh: MeshConfig, mode: str) -> tuple[list, list]:
    """(prefill, decode) device lists for ``mode``; colocated: one list used by both phases."""
    n_dec = mesh.decode_tp * mesh.decode_ep
    if mode == "disaggregated":
        return split_devices(devices, mesh.prefill_devices, mesh.decode_devices, mesh.prefill_tp, n_dec)
    if mesh.decode_devices is not None:
        dec = pick_devices(devices, mesh.decode_devices, "decode_devices")
    elif len(devices) >= n_dec:
        dec = devices[:n_dec]
    else:
        raise ConfigError(f"decode_tp={mesh.decode_tp} x decode_ep={mesh.decode_ep} needs {n_dec} devices, but "
                          f"{_have(devices)}; {SIMULATE_HINT}")
    return dec, dec


def weight_axes(cfg: ModelConfig, params: Any) -> list[tuple[Any, tuple]]:
    """``(weight, logical axes)`` for every weight of ``params`` (a quantized weight is one entry; the layouts derived
    for a phase, which no kernel call takes, left out)."""
    out: list[tuple[Any, tuple]] = []
    jax.tree.map(lambda ax, w: out.append((w, ax)), logical_axes(cfg), stored_params(params),
                 is_leaf=lambda x: isinstance(x, tuple))
    return out


def param_shardings(cfg: ModelConfig, params: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings for a params tree (plain or quantized leaves) on ``mesh``: each weight's
    :func:`~phaseserve.kernel_mesh.weight_spec`, the spec its kernel calls are ``shard_map``'d with."""
    def one(ax: tuple, w: Any) -> Any:
        specs = component_specs(w, weight_spec(ax, w, mesh, rules))
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    return jax.tree.map(one, logical_axes(cfg), params, is_leaf=lambda x: isinstance(x, tuple))


def mesh_of(params: Any) -> Mesh:
    """The mesh a placed params tree lives on (its first NamedSharding)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    raise ValueError("params are not placed on a mesh (no NamedSharding leaf); place them with shard_params")


def sharded_step(fn: Callable, cfg: ModelConfig, kd: KernelDispatch) -> Callable:
    """``step(params, *args)`` = ``fn(params, *args, kd=...)`` with ``kd`` (the worker's dispatch: its mesh,
    implementations and provenance log) bound to the traced params' weight specs
    (:meth:`~phaseserve.kernel_mesh.KernelDispatch.with_weights`): every kernel call in it is ``shard_map``'d with
    its weight's spec and recorded in ``kd.log``."""
    def step(params: Any, *args: Any) -> Any:
        return fn(params, *args, kd=kd.with_weights(weight_axes(cfg, params)))

    return step


def pool_shardings(pool: Any, mesh: Mesh) -> Any:
    """Decode page pool on ``mesh``: GQA K/V pages ``[N, S, KV, hd]`` (and their per-head scales) split over KV heads
    along ``tp`` when the heads divide; MLA latent pages replicated (every TP rank reads the whole latent)."""
    from phaseserve.cache.paged import GQAPages

    rep = NamedSharding(mesh, PartitionSpec())

    def layer(lp: Any) -> Any:
        ax = head_axis(mesh, lp.k.shape[2]) if isinstance(lp, GQAPages) else None
        if ax is None:
            return jax.tree.map(lambda _: rep, lp)
        heads = NamedSharding(mesh, PartitionSpec(None, None, ax, None))
        scales = NamedSharding(mesh, PartitionSpec(None, None, ax))
        return lp.replace(k=heads, v=heads, k_scale=None if lp.k_scale is None else scales,
                          v_scale=None if lp.v_scale is None else scales)

    return pool.replace(layers=tuple(layer(lp) for lp in pool.layers))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_params(cfg: ModelConfig, params: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """Place a params tree on ``mesh`` according to the rules."""
    return jax.device_put(params, param_shardings(cfg, params, mesh, rules))
