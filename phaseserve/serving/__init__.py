"""The cross-process pieces of disaggregated serving (the Ray backend, ``phaseserve.distributed``, uses them).

- ``protocol``: :class:`TransferDescriptor`, the typed errors that end a request because of the distributed
  machinery (:class:`StaleDescriptorError`, :class:`TransferTimeoutError`, :class:`TransferError`,
  :class:`PeerDeadError`), :class:`ModelSpec` (how a process gets its weights).
- ``transfer``: KV over ``jax.experimental.transfer`` -- the source side's tag-checked :class:`StagingArea`, the
  receiving side's :class:`Puller`.
- ``multihost``: ``jax.distributed`` bring-up for meshes that span processes or hosts.
"""

from phaseserve.serving.protocol import (
    ForgedDescriptorError,
    ModelSpec,
    PeerDeadError,
    ServingError,
    StaleDescriptorError,
    TransferDescriptor,
    TransferError,
    TransferTimeoutError,
)

__all__ = ["ForgedDescriptorError", "ModelSpec", "PeerDeadError", "ServingError", "StaleDescriptorError",
           "TransferDescriptor", "TransferError", "TransferTimeoutError"]
