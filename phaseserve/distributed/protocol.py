"""Typed errors, transfer descriptors and model specs of cross-process serving (``phaseserve.distributed``).

The KV itself never crosses the control plane: a :class:`TransferDescriptor` names where it is (the source's
transfer address and incarnation, the pull ``uuid``), what it is (flat leaf shapes and dtypes, the length), and
which staging pages hold it with the tag each had when it was staged. The source checks the descriptor when the
pull is requested and arms ``await_pull`` only if it matches (see ``transfer.StagingArea``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from phaseserve.config import ConfigError


# ---- typed errors ---------------------------------------------------------------------------------------
class DistributedError(RuntimeError):
    """Base class of errors that end one request because of the multi-process machinery (not its input)."""


class StaleDescriptorError(DistributedError):
    """The prefill side refused a transfer descriptor: unknown/consumed uuid, wrong tags, replay, wrong server."""

    def __init__(self, message: str, kind: str = "stale"):
        super().__init__(message)
        self.kind = kind  # "unknown" | "stale_tag" | "replayed" | "wrong_server" | "mismatch"

    def __reduce__(self):
        return (StaleDescriptorError, (str(self), self.kind))


class ForgedDescriptorError(StaleDescriptorError):
    """A transfer descriptor the control plane did not sign, or signed with another deployment's secret, or altered
    after signing, or past its signed expiry (``kind``: "forged" | "expired"); refused before any pull is armed or
    issued (:class:`~phaseserve.distributed.transfer.DescriptorAuth`)."""

    def __init__(self, message: str, kind: str = "forged"):
        super().__init__(message, kind)

    def __reduce__(self):
        return (ForgedDescriptorError, (str(self), self.kind))


class TransferTimeoutError(DistributedError):
    """A KV transfer (or the grant for it) did not complete before its deadline."""


class PeerDeadError(DistributedError):
    """The process that held the request (or its KV) died."""


class TransferError(DistributedError):
    """A KV transfer failed: the pulled buffers carry an error (e.g. the prefill peer died mid-pull), or landing
    them in the request's pages raised."""


# ---- the transfer plane's secret ------------------------------------------------------------------------
SECRET_ENV = "PHASESERVE_TRANSFER_SECRET"
MIN_SECRET_BYTES = 16


def deployment_secret(configured: str | bytes | None = None) -> bytes:
    """The transfer plane's HMAC key: ``configured`` if given, else ``$PHASESERVE_TRANSFER_SECRET``, else a random
    256-bit secret generated once for this run and exported to ``$PHASESERVE_TRANSFER_SECRET`` (processes spawned
    from here share it; processes on other hosts must be given the same value). A given secret shorter than
    16 bytes is a :class:`~phaseserve.config.ConfigError`."""
    value = configured if configured is not None else os.environ.get(SECRET_ENV)
    if value is None:
        value = os.environ[SECRET_ENV] = secrets.token_hex(32)
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigError(f"the transfer secret ({SECRET_ENV} or the configured one) has {len(key)} bytes; "
                          f"use at least {MIN_SECRET_BYTES} (e.g. secrets.token_hex(32))")
    return key


# ---- descriptors ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferDescriptor:
    """Where one prompt's KV waits to be pulled, and the ownership it was staged under.

    ``leaves``: the flat pytree leaves of the per-request KV, ``[(shape, dtype name)]`` in the order of
    ``jax.tree.leaves(kvq)`` (per layer: values ``[T, ...]`` then the FP8 scale ``[T, ...]`` when scaled);
    ``T = len(pages) * page_size`` -- whole staging pages cross the wire. ``server_id`` is the prefill server's
    incarnation (a random 64-bit number drawn at start), so a descriptor from a dead server is never honoured
    by its successor even if the uuid counter repeats.

    ``expires`` (Unix time) and ``mac`` are set by the control plane when it signs the descriptor
    (:class:`~phaseserve.distributed.transfer.DescriptorAuth`): an HMAC-SHA256 over :meth:`canonical_bytes` (every
    field but ``mac``) with the deployment's secret. Only a descriptor whose MAC verifies and whose expiry has not
    passed is armed or pulled.
    """

    request_id: str
    uuid: int
    address: str  # the prefill TransferServer's address
    server_id: int
    pages: tuple[int, ...]  # staging pages holding the KV
    tags: tuple[int, ...]  # their tags when staged
    length: int  # valid prompt tokens
    page_size: int
    kv_dtype: str
    leaves: tuple[tuple[tuple[int, ...], str], ...]
    expires: float = 0.0  # Unix time after which the descriptor is stale (signed)
    mac: str = ""  # hex HMAC-SHA256 of canonical_bytes() ("" until signed)

    def canonical_bytes(self) -> bytes:
        """The signed bytes: every field but ``mac``, as compact JSON with a version prefix. Raises ``TypeError`` /
        ``ValueError`` for field values JSON cannot hold (a forged descriptor; the verifier refuses it)."""
        fields = [[f.name, getattr(self, f.name)] for f in dataclasses.fields(self) if f.name != "mac"]
        return b"phaseserve-transfer-descriptor-v1\n" + json.dumps(fields, separators=(",", ":"),
                                                                    allow_nan=False).encode()

    @property
    def nbytes(self) -> int:
        import numpy as np

        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self.leaves)

    def replace(self, **kw: Any) -> TransferDescriptor:
        return dataclasses.replace(self, **kw)


@dataclass
class ModelSource:
    """How a server process gets its weights: an HF checkpoint directory, or an HF config dict + seed (random)."""

    checkpoint: str | None = None
    hf_config: dict | None = None
    seed: int = 0
    dtype: str = "float32"

    @classmethod
    def from_hydra(cls, cfg: Any) -> ModelSource:
        """The spec of a composed Hydra tree's ``model`` group (checkpoint, or an HF config + seed)."""
        from phaseserve.config_hydra import hf_dict, repo_path

        m = cfg.model
        if m.get("checkpoint"):
            return cls(checkpoint=str(repo_path(m.checkpoint)), dtype=str(m.dtype))
        return cls(hf_config=hf_dict(m), seed=int(m.get("seed") or 0), dtype=str(m.dtype))

    def load(self):
        import jax

        import phaseserve as ps

        if self.checkpoint:
            return ps.load_checkpoint(self.checkpoint, dtype=self.dtype)
        cfg = ps.ModelConfig.from_hf_config(dict(self.hf_config))
        return cfg, ps.init_params(cfg, jax.random.key(self.seed), self.dtype)


# ---- process launch -------------------------------------------------------------------------------------
@contextlib.contextmanager
def child_env(host_devices: int, cache_dir: str | None = None):
    """Environment a spawned server inherits: JAX on CPU with ``host_devices`` simulated devices (and the
    persistent compilation cache in ``cache_dir``, so restarted or sibling servers skip recompiling).

    Spawned children read ``os.environ`` at start (before they import jax), so it is set around ``start()``.
    On a real accelerator host set ``JAX_PLATFORMS`` yourself; only an unset value is filled in here. The
    transfer plane's secret (``PHASESERVE_TRANSFER_SECRET``) is generated here if unset and stays exported, so
    every server this process starts -- restarted ones included -- signs and verifies with the same key.
    """
    deployment_secret()
    keys = ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["JAX_PLATFORMS"] = os.environ.get("PHASESERVE_CHILD_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={host_devices}"
    if cache_dir:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
