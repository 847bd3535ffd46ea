"""KV transfer between processes over ``jax.experimental.transfer``, with ownership checked on the serving side.

Each server process starts one ``TransferServer`` (:func:`start_endpoint`). The prefill side *stages* each
prompt's KV; the decode side *pulls* it into fresh buffers on its own devices and scatters it into its pages.

Prefill side, :class:`StagingArea`. Staged KV is accounted in pages of a :class:`~phaseserve.cache.allocator.
PageAllocator` (capacity, leak counting, and above all *tags*: every staging allocation gets a fresh tag that is
never reused while held). The descriptor names those pages and tags. When the decode side asks for a pull,
:meth:`StagingArea.verify` checks, in order: the server incarnation, that the uuid is still staged, that every
other field (request id and the requester's id, address, pages, length, page size, KV dtype, leaf shapes and
dtypes) equals what was staged, that every page still carries the descriptor's tag with a live reference, and that
the entry was not already served (a replay). Only then is ``await_pull`` armed. Entries are freed when the decode
side acknowledges the landed transfer (:meth:`release`) or when their TTL passes (a dead or slow peer);
``await_pull`` is armed with the same deadline, so the transfer server drops its reference too.

Why verify-then-arm instead of arming at staging time. Measured with jax 0.10.2 on CPU: a ``pull`` of a uuid
that is not (or no longer) armed never completes -- the ``timeout`` argument of ``pull`` does not fire, and a
pull issued after ``await_pull``'s own timeout hangs too. A replayed descriptor must therefore never reach
``pull``: it is refused on the control plane with a typed :class:`StaleDescriptorError`, and the decode side
enforces its own deadline by polling the pulled arrays' ``is_ready()`` (never touching an unready array).

Authentication, :class:`DescriptorAuth`. The transfer ports themselves have no authentication (anyone who can
reach one can ask it for bytes, or send it garbage), so a descriptor is honoured only if the control plane signed
it: :meth:`StagingArea.stage` signs each descriptor it issues (HMAC-SHA256 over
:meth:`~phaseserve.distributed.protocol.TransferDescriptor.canonical_bytes` with the deployment's secret, and a signed
expiry), :meth:`StagingArea.verify` checks the MAC and the expiry before anything else, and :meth:`Puller.pull`
checks them again before it connects to the address the descriptor names. A forged, altered, foreign (another
deployment's secret) or expired descriptor is refused with a typed
:class:`~phaseserve.distributed.protocol.ForgedDescriptorError` and changes nothing: no entry is marked served, no
page is freed. The secret (:func:`~phaseserve.distributed.protocol.deployment_secret`): ``PHASESERVE_TRANSFER_SECRET``
when set (every host of a deployment sets the same value), else one generated per run and exported to the
environment, so the server processes this process spawns inherit it.

Decode side, :class:`PendingPull`. ``pull`` returns immediately with arrays that become ready when the bytes
have landed, in buffers the transfer allocates (never inside the page pool). The pages a request was given stay
held until the pull is *done*: landed and scattered, or abandoned at its deadline (after which its buffers are
never scattered). A cancel during the transfer only marks the request; its pages are released at completion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import random
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer

from phaseserve.cache.allocator import PageAllocator
from phaseserve.distributed.gate import GatedServer, TransferGate, gate_key
from phaseserve.distributed.protocol import (
    ForgedDescriptorError,
    StaleDescriptorError,
    TransferDescriptor,
    deployment_secret,
)


class DescriptorAuth:
    """Signs and verifies transfer descriptors with one deployment's secret (HMAC-SHA256, constant-time compare).

    ``sign(desc)`` returns a copy with ``expires`` (now + ``ttl_s``, Unix time) and ``mac`` set; ``verify(desc)``
    returns ``desc`` if its MAC is this secret's over its canonical bytes and it has not expired, else raises
    :class:`~phaseserve.distributed.protocol.ForgedDescriptorError` (``kind`` "forged" or "expired"). Hosts of one
    deployment need clocks in sync to well within ``ttl_s`` (NTP)."""

    def __init__(self, secret: bytes | str | None = None, ttl_s: float = 120.0):
        self._key = deployment_secret(secret)
        self.ttl_s = ttl_s

    def _mac(self, desc: TransferDescriptor) -> str:
        return hmac.new(self._key, desc.canonical_bytes(), hashlib.sha256).hexdigest()

    def sign(self, desc: TransferDescriptor, ttl_s: float | None = None,
             now: float | None = None) -> TransferDescriptor:
        now = time.time() if now is None else now
        desc = desc.replace(expires=float(now + (self.ttl_s if ttl_s is None else ttl_s)), mac="")
        return desc.replace(mac=self._mac(desc))

    def verify(self, desc: Any, now: float | None = None) -> TransferDescriptor:
        rid, uuid = getattr(desc, "request_id", None), getattr(desc, "uuid", None)
        what = f"transfer descriptor of {rid!r:.60} (uuid {uuid!r:.30})"
        if not isinstance(desc, TransferDescriptor):
            raise ForgedDescriptorError(f"not a TransferDescriptor: {type(desc).__name__}")
        try:
            expected = self._mac(desc)
        except (TypeError, ValueError, RecursionError) as e:  # a field JSON cannot hold: nobody signed this
            raise ForgedDescriptorError(f"{what} refused: unsignable field ({e!s:.80})") from None
        given = desc.mac.encode("utf-8", "surrogatepass") if isinstance(desc.mac, str) else b""
        if not hmac.compare_digest(expected.encode(), given):
            raise ForgedDescriptorError(f"{what} refused: its MAC does not verify (not signed by this deployment's "
                                        f"control plane, or altered since)")
        now = time.time() if now is None else now
        if not desc.expires > now:
            raise ForgedDescriptorError(f"{what} refused: expired {now - desc.expires:.1f} s ago", "expired")
        return desc


def start_endpoint(bind: str = "127.0.0.1", device: jax.Device | None = None, gate: bool = False,
                   secret: bytes | str | None = None) -> Any:
    """One TransferServer for this process, listening on an ephemeral port of ``bind``. With ``gate``, its control
    port listens on loopback only and peers reach it through a :class:`~phaseserve.distributed.gate.TransferGate`
    on ``bind`` (authenticated with the deployment's secret, frames checked); its pulls go out through an
    :class:`~phaseserve.distributed.gate.Egress` (a :class:`~phaseserve.distributed.gate.GatedServer`)."""
    client = (device or jax.local_devices()[0]).client
    if not gate:
        return transfer.start_transfer_server(client, f"{bind}:0", [f"{bind}:0"])
    server = transfer.start_transfer_server(client, "127.0.0.1:0", [f"{bind}:0"])
    key = gate_key(deployment_secret(secret))
    return GatedServer(server, TransferGate(server.address(), bind, key), key)


def _same(a: Any, b: Any) -> bool:
    """Field equality that never raises (a forged field may be of any type)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def deadline_after(seconds: float):
    import datetime

    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


# ---- prefill side -----------------------------------------------------------------------------------------
@dataclass
class StagedKV:
    descriptor: TransferDescriptor
    arrays: list  # flat leaves, each [T, ...] on the prefill process's first device
    expires: float  # time.monotonic() deadline
    served: bool = False


class StagingArea:
    """Prompt KV waiting to be pulled, keyed by uuid; page-accounted and tag-checked (see module docstring)."""

    def __init__(self, server: Any, num_pages: int, page_size: int, ttl_s: float,
                 auth: DescriptorAuth | None = None):
        """``auth``: signs the descriptors :meth:`stage` issues and checks those :meth:`verify` gets (default: the
        :func:`deployment_secret`'s, descriptors valid for ``ttl_s``)."""
        self.auth = auth or DescriptorAuth(ttl_s=ttl_s)
        self.server = server
        self.address = server.address()
        self.server_id = random.getrandbits(63)
        self.allocator = PageAllocator(num_pages + 1)  # + the null page
        self.page_size = page_size
        self.ttl_s = ttl_s
        self.entries: dict[int, StagedKV] = {}
        self._uuid = random.getrandbits(40) << 20  # distinct ranges per incarnation; + a counter
        self.refused: dict[str, int] = {}
        self.expired = 0
        self.bytes_staged = 0

    @property
    def pages_in_use(self) -> int:
        return self.allocator.num_used

    def stage(self, request_id: str, leaves: list, length: int, kv_dtype: str) -> TransferDescriptor | None:
        """Stage one request's KV (flat leaves ``[T, ...]``, ``T`` a multiple of the page size); ``None`` when
        the staging area is full (the caller retries later)."""
        n = leaves[0].shape[0] // self.page_size
        pages = self.allocator.allocate(n)
        if pages is None:
            return None
        self._uuid += 1
        desc = TransferDescriptor(
            request_id=request_id, uuid=self._uuid, address=self.address, server_id=self.server_id,
            pages=tuple(pages), tags=tuple(int(self.allocator.tags[p]) for p in pages), length=length,
            page_size=self.page_size, kv_dtype=kv_dtype,
            leaves=tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves))
        desc = self.auth.sign(desc, ttl_s=self.ttl_s)
        self.entries[desc.uuid] = StagedKV(desc, leaves, time.monotonic() + self.ttl_s)
        self.bytes_staged += desc.nbytes
        return desc

    def verify(self, desc: TransferDescriptor, requester: str | None = None) -> StagedKV:
        """The staged entry ``desc`` names, or a :class:`StaleDescriptorError` saying why it is not honoured.

        ``requester``: the request id the puller wants the KV for (must be the one it was staged for)."""
        def refuse(kind: str, why: str):
            self.refused[kind] = self.refused.get(kind, 0) + 1
            rid, uuid = getattr(desc, "request_id", None), getattr(desc, "uuid", None)
            return StaleDescriptorError(f"transfer of {rid!r:.60} (uuid {uuid!r:.30}) refused: {why}", kind)

        if not isinstance(desc, TransferDescriptor):
            raise refuse("mismatch", f"not a TransferDescriptor: {type(desc).__name__}")
        try:
            self.auth.verify(desc)  # first: nothing else is looked at for a descriptor nobody signed
        except ForgedDescriptorError as e:
            self.refused[e.kind] = self.refused.get(e.kind, 0) + 1
            raise
        if not _same(desc.server_id, self.server_id):
            raise refuse("wrong_server", "descriptor from another prefill server incarnation")
        entry = self.entries.get(desc.uuid) if type(desc.uuid) is int else None
        if entry is None:
            raise refuse("unknown", "nothing staged under this uuid (already consumed, expired or never staged)")
        mine = entry.descriptor
        wrong = [f.name for f in dataclasses.fields(mine) if f.name not in ("tags", "expires", "mac")  # signature:
                 and not _same(getattr(mine, f.name), getattr(desc, f.name))]  # checked by auth.verify above
        if requester is not None and requester != mine.request_id:
            wrong.append("requester")
        if wrong:
            raise refuse("mismatch", f"descriptor does not describe the staged entry (differs in {', '.join(wrong)})")
        pages = list(desc.pages)
        a = self.allocator
        if not (_same(desc.tags, mine.tags) and (a.tags[pages] == np.asarray(mine.tags, np.uint32)).all()
                and (a.refcount[pages] > 0).all()):
            raise refuse("stale_tag", f"staging page tags {a.tags[pages].tolist()} != descriptor {desc.tags!r:.80}")
        if entry.served:
            raise refuse("replayed", "this descriptor was already served")
        return entry

    def serve(self, desc: TransferDescriptor, requester: str | None = None) -> None:
        """Verify ``desc`` and arm its pull (raises :class:`StaleDescriptorError` without arming anything)."""
        entry = self.verify(desc, requester)
        entry.served = True
        remaining = max(entry.expires - time.monotonic(), 0.1)
        self.server.await_pull(desc.uuid, entry.arrays, timeout=deadline_after(remaining))

    def release(self, uuid: int) -> bool:
        """The decode side has the KV: free the entry and its pages (False if it was already gone)."""
        entry = self.entries.pop(uuid, None)
        if entry is None:
            return False
        self.allocator.free(list(entry.descriptor.pages))
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Free entries past their TTL (nobody pulled, or the puller never acknowledged); their request ids."""
        now = time.monotonic() if now is None else now
        dead = [u for u, e in self.entries.items() if e.expires <= now]
        ids = [self.entries[u].descriptor.request_id for u in dead]
        for u in dead:
            self.release(u)
        self.expired += len(dead)
        return ids


# ---- decode side ------------------------------------------------------------------------------------------
def avals_for(desc: TransferDescriptor, sharding: jax.sharding.Sharding) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=sharding) for s, d in desc.leaves]


@dataclass
class PendingPull:
    """One request's transfer on the decode side: pages held from admission until the transfer is done."""

    descriptor: TransferDescriptor
    deadline: float  # time.monotonic()
    state: str = "requested"  # "requested" (waiting for the grant) -> "pulling" -> done
    arrays: list | None = None
    cancelled: bool = False
    started: float = field(default_factory=time.monotonic)

    def ready(self) -> bool:
        return self.arrays is not None and all(x.is_ready() for x in self.arrays)

    def expired(self, now: float) -> bool:
        return now >= self.deadline


class Puller:
    """Connections to prefill servers (one per address, reused) and the pull call; a descriptor whose MAC or expiry
    does not verify is refused (:class:`~phaseserve.distributed.protocol.ForgedDescriptorError`) before connecting."""

    def __init__(self, server: Any, device: jax.Device, auth: DescriptorAuth | None = None):
        self.auth = auth or DescriptorAuth()
        self.server = server
        self.sharding = jax.sharding.SingleDeviceSharding(device)
        self._conns: dict[str, Any] = {}
        self.bytes_pulled = 0

    def pull(self, desc: TransferDescriptor) -> list:
        self.auth.verify(desc)
        conn = self._conns.get(desc.address)
        if conn is None:
            conn = self._conns[desc.address] = self.server.connect(desc.address)
        out = conn.pull(desc.uuid, avals_for(desc, self.sharding))
        self.bytes_pulled += desc.nbytes
        return out

    def forget(self, address: str) -> None:
        """Drop the connection to ``address`` (a pull on it failed or timed out: the peer died, or the connection
        broke), so the next pull from that address connects afresh."""
        self._conns.pop(address, None)
        if hasattr(self.server, "forget"):
            self.server.forget(address)
