"""Meshes that span processes or hosts: ``jax.distributed`` bring-up and a self-check.

Prefill and decode each run as their own JAX program (the phase actors of this package); *within* a phase, a mesh can
span several hosts through JAX's multi-controller runtime: every host runs the same server program, calls
:func:`initialize` with the same coordinator address, and ``jax.devices()`` then lists every host's devices, so
``sharding.make_mesh`` builds one mesh over all of them (each process feeds only its local shards).

On CPU, cross-process collectives need an implementation: :func:`initialize` selects gloo (``jax 0.10.2``; the
default "none" cannot run a computation whose devices span processes). Two local CPU processes emulate two hosts
in the tests (:func:`selfcheck_worker`): each contributes its shard of a global array and a jitted reduction over
the 2-device mesh returns the same value in both.
"""

from __future__ import annotations

import os
import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def initialize(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 60,
               cpu_collectives: str = "gloo") -> None:
    """``jax.distributed.initialize`` with CPU collectives selected (call before any other JAX use)."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s)


def global_mesh_sum(local: Any, axis: str = "x") -> tuple[float, dict]:
    """Sum of squares of a global array built from every process's ``local`` f32[n] shard, on a mesh over all
    processes' devices; returns the value and a description of the topology."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), (axis,))
    local = np.asarray(local, np.float32)
    g = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec(axis)), local,
                                               (local.shape[0] * jax.process_count(),))
    out = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, PartitionSpec()))(g)
    info = dict(process_index=jax.process_index(), process_count=jax.process_count(), global_devices=len(devices),
                local_devices=len(jax.local_devices()), spans=sorted({d.process_index for d in devices}))
    return float(out), info


def selfcheck_worker(process_id: int, num_processes: int, coordinator: str, result_q: Any) -> None:
    """Spawn target: join the distributed runtime, run :func:`global_mesh_sum`, report ``(value, info)`` or the
    error text."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    try:
        import jax

        initialize(coordinator, num_processes, process_id)
        value, info = global_mesh_sum([float(process_id * 10 + i) for i in range(4)])
        result_q.put(("ok", value, info))
        jax.distributed.shutdown()
    except Exception as e:  # reported to the parent, which fails the check with the text
        result_q.put(("error", f"{type(e).__name__}: {e}", {"process_id": process_id}))
