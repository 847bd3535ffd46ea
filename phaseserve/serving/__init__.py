"""Multi-process (and multi-host) disaggregated serving: prefill and decode server processes and a router.

- ``protocol``: control messages, :class:`TransferDescriptor`, typed errors (:class:`StaleDescriptorError`,
  :class:`TransferTimeoutError`, :class:`PeerDeadError`), server specs, spawn environment.
- ``transfer``: KV over ``jax.experimental.transfer`` -- the prefill side's tag-checked :class:`StagingArea`,
  the decode side's :class:`Puller` and :class:`PendingPull`, and :class:`DescriptorAuth` (descriptors signed by
  the control plane with the deployment's secret; :class:`ForgedDescriptorError` for any other).
- ``prefill_server`` / ``decode_server``: the two server processes.
- ``router``: :class:`Router` starts both, admits requests, relays the control plane, notices dead peers.
- ``multihost``: ``jax.distributed`` bring-up for meshes that span processes or hosts.
"""

from phaseserve.serving.protocol import (
    ForgedDescriptorError,
    ModelSpec,
    PeerDeadError,
    ServerSpec,
    ServingError,
    StaleDescriptorError,
    TransferDescriptor,
    TransferTimeoutError,
)
from phaseserve.serving.router import Router

__all__ = ["ForgedDescriptorError", "ModelSpec", "PeerDeadError", "Router", "ServerSpec", "ServingError",
           "StaleDescriptorError", "TransferDescriptor", "TransferTimeoutError"]
