"""Disaggregated serving across processes: prefill and decode as Ray actors that own their devices, driven by the one
engine, with the KV between them over ``jax.experimental.transfer``.

- ``engine``: :class:`RayEngine` (the engine over remote workers), :class:`RayOptions` (cluster address, per-phase
  placement, restarts), :func:`connect`.
- ``workers``: the engine-side proxies of the phase workers (page tables here, device work in the actor).
- ``actor``: :class:`PhaseActor`, one phase's devices, weights, pool and KV transfer endpoint.
- ``protocol``: :class:`TransferDescriptor`, the typed errors that end a request because of the distributed
  machinery (:class:`StaleDescriptorError`, :class:`TransferTimeoutError`, :class:`TransferError`,
  :class:`PeerDeadError`), :class:`ModelSource` (how a process gets its weights), the transfer secret.
- ``transfer``: the KV transfer plane -- the source side's tag-checked :class:`StagingArea`, the receiving side's
  :class:`Puller`, descriptor signing.
- ``multihost``: ``jax.distributed`` bring-up for meshes that span processes or hosts.
"""

from phaseserve.distributed.engine import PhaseOptions, RayEngine, RayOptions, connect
from phaseserve.distributed.protocol import (
    DistributedError,
    ForgedDescriptorError,
    ModelSource,
    PeerDeadError,
    StaleDescriptorError,
    TransferDescriptor,
    TransferError,
    TransferTimeoutError,
)

__all__ = ["DistributedError", "ForgedDescriptorError", "ModelSource", "PeerDeadError", "PhaseOptions", "RayEngine",
           "RayOptions", "StaleDescriptorError", "TransferDescriptor", "TransferError", "TransferTimeoutError",
           "connect"]
