"""Disaggregated serving on Ray: prefill and decode as Ray actors that own their devices, driven by the one engine.

- ``engine``: :class:`RayEngine` (the engine over remote workers), :class:`RayOptions` (cluster address, per-phase
  placement, restarts), :func:`connect`.
- ``workers``: the engine-side proxies of the phase workers (page tables here, device work in the actor).
- ``actor``: :class:`PhaseActor`, one phase's devices, weights, pool and KV transfer endpoint.
"""

from phaseserve.distributed.engine import PhaseOptions, RayEngine, RayOptions, connect

__all__ = ["PhaseOptions", "RayEngine", "RayOptions", "connect"]
