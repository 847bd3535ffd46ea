"""An authenticated, frame-checked front for a ``jax.experimental.transfer`` server's port.

Why. A jax 0.10.2 ``TransferServer`` trusts whatever reaches its listening (control) port. Measured on CPU (one
child process per payload, see ``docs/multihost.md``, "Faults"): a frame of length 0 -- four zero bytes, so also 64
-- aborts the process (``LOG(FATAL) Implement:`` on a message with no known field), and a well-formed pull frame
naming an armed uuid, sent before the peer set up its bulk transport, crashes it (SIGSEGV: a null bulk transport).
Random bytes, truncated frames, oversized length headers, other well-formed frames and a flood of 200 connections
did not; nor did garbage on its bulk-data port. Nothing on the control plane (signed descriptors) can see those
bytes, so the port itself is closed to strangers here:

- :class:`TransferGate` listens on the address peers are given (descriptors, ``PhaseActor.info()["address"]``);
  the jax server's control port listens on loopback only. A connection is relayed to it only after a challenge-
  response handshake keyed by the deployment's secret (HMAC-SHA256 over a fresh nonce from each side, so a recorded
  handshake does not replay), and every frame the peer sends after that is checked against the protocol's shape
  before it is forwarded: a non-empty length up to ``max_frame``, one known message, the bulk-transport setup first
  and once, then only pulls and the closing half-close, each field of its wire type. Anything else closes that
  connection; nothing reaches the jax server. Refusals are counted by kind (``unauthenticated``, ``busy``,
  ``frame``).
- :class:`Egress`, on the pulling side: the local jax server connects to a loopback listener of its own process,
  which dials the remote gate, proves the secret (and checks the gate's proof) and relays.

What it does not do: the bytes after the handshake are neither encrypted nor integrity-protected (an attacker who
can inject into an established TCP stream of the private network is out of scope: use IPsec / WireGuard there);
the jax server's bulk-data port still takes connections from anyone (garbage there was harmless in the
measurements, but a peer there can waste a transfer, which then times out typed); and the loopback control port
is reachable by any process on the same host (the same host is trusted: it can signal or ptrace the actor).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import socket
import struct
import threading
import time

GATE_MAGIC = b"phaseserve-transfer-gate-v1\n"
NONCE = 32
MAC = 32
# the control protocol's messages (jax 0.10.2, xla/python/transfer/transfer_socket.proto, SocketTransferRequest)
PULL, PACKET, BULK, HALF_CLOSE, ERROR = 1, 2, 3, 4, 5
VARINT, LEN = 0, 2
# per message: field number -> wire types it may come in (repeated scalars: packed LEN or one VARINT each)
FIELDS = {
    PULL: {1: (VARINT,), 2: (LEN, VARINT), 3: (VARINT,), 4: (VARINT,)},  # uuid, buffer_ids, req_id, timeout_us
    BULK: {1: (VARINT,), 2: (LEN,), 3: (LEN, VARINT)},  # impl kind, addresses, uuids
    HALF_CLOSE: {},
}


def gate_key(secret: bytes) -> bytes:
    """The handshake key: derived from the deployment secret, distinct from the key that signs descriptors."""
    return hmac.new(secret, b"phaseserve transfer gate handshake", hashlib.sha256).digest()


def _proof(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, side + server_nonce + client_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    for j in range(i, min(i + 10, len(buf))):
        value |= (buf[j] & 0x7F) << shift
        if not buf[j] & 0x80:
            return value, j + 1
        shift += 7
    raise ValueError("bad varint")


def _fields(buf: bytes) -> list[tuple[int, int, bytes | int]]:
    """The (field number, wire type, value) of a protobuf message (varint and length-delimited fields only)."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == VARINT:
            value, i = _varint(buf, i)
        elif wire == LEN:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("field past the frame's end")
            value, i = buf[i: i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        if num < 1:
            raise ValueError("field number 0")
        out.append((num, wire, value))
    return out


def check_frame(body: bytes, setup_done: bool) -> int:
    """The message kind of one control frame a pulling peer may send (``BULK`` first, then ``PULL`` /
    ``HALF_CLOSE``); raises ``ValueError`` saying why it is refused."""
    top = _fields(body)
    if len(top) != 1 or top[0][1] != LEN:
        raise ValueError(f"{len(top)} top-level fields (one message expected)")
    kind, _, inner = top[0]
    allowed = (PULL, HALF_CLOSE) if setup_done else (BULK,)
    if kind not in allowed:
        raise ValueError(f"message {kind} where {allowed} may come")
    for num, wire, value in _fields(inner):
        if wire not in FIELDS[kind].get(num, ()):
            raise ValueError(f"field {num} (wire type {wire}) in message {kind}")
        if kind == PULL or (kind == BULK and num == 3):
            if wire == LEN:  # packed varints: each must parse
                j = 0
                while j < len(value):
                    _, j = _varint(value, j)
        elif kind == BULK and num == 2 and not (0 < len(value) <= 255 and value.isascii()):
            raise ValueError("bulk-transport address")
    return kind


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _listen(host: str, backlog: int = 256) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(backlog)
    return s


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _close(*socks: socket.socket | None) -> None:
    for s in socks:
        if s is None:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either end closes; then close both."""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _close(src, dst)


class TransferGate:
    """The authenticated front of one transfer server's control port (module docstring).

    ``inner``: the jax server's control address (loopback); ``bind``: where peers reach the gate. At most
    ``max_pending`` connections may be in their handshake at once (each gets ``handshake_timeout_s``) and at most
    ``max_peers`` authenticated ones be relayed; one more of either is closed at once (``busy``)."""

    def __init__(self, inner: str, bind: str, key: bytes, *, max_pending: int = 64, max_peers: int = 64,
                 handshake_timeout_s: float = 2.0, max_frame: int = 1 << 20):
        self.inner, self.key = inner, key
        self.max_pending, self.max_peers = max_pending, max_peers
        self.handshake_timeout_s, self.max_frame = handshake_timeout_s, max_frame
        self.stats: collections.Counter = collections.Counter()  # connections, authenticated, frames
        self.refused: collections.Counter = collections.Counter()  # by kind
        self._lock = threading.Lock()
        self._pending = self._peers = 0
        self._sock = _listen(bind)
        self.address = _address(self._sock)
        self._closed = False
        threading.Thread(target=self._accept, name="phaseserve-transfer-gate", daemon=True).start()

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.stats, refused=dict(self.refused), pending=self._pending, peers=self._peers)

    def close(self) -> None:
        self._closed = True
        _close(self._sock)

    def _refuse(self, kind: str, *socks: socket.socket | None) -> None:
        with self._lock:
            self.refused[kind] += 1
        _close(*socks)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # e.g. EMFILE under a flood: back off, keep serving
                continue
            with self._lock:
                self.stats["connections"] += 1
                busy = self._pending >= self.max_pending
                if not busy:
                    self._pending += 1
            if busy:
                self._refuse("busy", conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="phaseserve-gate-peer", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(self.handshake_timeout_s)
        nonce = os.urandom(NONCE)
        try:
            conn.sendall(GATE_MAGIC + nonce)
            got = _recv_exact(conn, NONCE + MAC)
            if got is None or not hmac.compare_digest(got[NONCE:], _proof(self.key, b"c", nonce, got[:NONCE])):
                return False
            conn.sendall(_proof(self.key, b"s", nonce, got[:NONCE]))
        except OSError:  # includes the handshake timeout
            return False
        conn.settimeout(None)
        return True

    def _serve(self, conn: socket.socket) -> None:
        ok = self._handshake(conn)
        with self._lock:
            self._pending -= 1
            busy = ok and self._peers >= self.max_peers
            if ok and not busy:
                self._peers += 1
                self.stats["authenticated"] += 1
        if not ok or busy:
            self._refuse("busy" if busy else "unauthenticated", conn)
            return
        inner = None
        try:
            inner = socket.create_connection(_host_port(self.inner), timeout=10)
            inner.settimeout(None)
            inner.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(inner, conn), name="phaseserve-gate-back", daemon=True).start()
            self._frames(conn, inner)
        except OSError:
            _close(conn, inner)
        finally:
            with self._lock:
                self._peers -= 1

    def _frames(self, conn: socket.socket, inner: socket.socket) -> None:
        """Forward the peer's frames, each checked (:func:`check_frame`), until it closes or sends a bad one."""
        setup = False
        while True:
            head = _recv_exact(conn, 4)
            if head is None:
                _close(conn, inner)
                return
            (n,) = struct.unpack("<I", head)
            body = _recv_exact(conn, n) if 0 < n <= self.max_frame else None
            try:
                if body is None:
                    raise ValueError(f"frame length {n}" if not 0 < n <= self.max_frame else "truncated frame")
                kind = check_frame(body, setup)
            except ValueError:
                self._refuse("frame", conn, inner)
                return
            setup = setup or kind == BULK
            with self._lock:
                self.stats["frames"] += 1
            inner.sendall(head + body)


class Egress:
    """A loopback listener that relays each connection the local jax server opens to the gate at ``remote``,
    after proving the deployment secret to it (and checking its proof). A gate that refuses or does not answer is
    dialled again (it may be busy) until ``connect_timeout_s``; then the local connection is closed (the pull on
    it fails; the puller's deadline turns that into a typed error)."""

    def __init__(self, remote: str, key: bytes, connect_timeout_s: float = 10.0):
        self.remote, self.key, self.connect_timeout_s = remote, key, connect_timeout_s
        self._sock = _listen("127.0.0.1", backlog=16)
        self.address = _address(self._sock)
        self.stats: collections.Counter = collections.Counter()
        self._closed = False
        threading.Thread(target=self._accept, name="phaseserve-transfer-egress", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        _close(self._sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                local, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            threading.Thread(target=self._relay, args=(local,), name="phaseserve-egress-peer", daemon=True).start()

    def _dial(self) -> socket.socket | None:
        end = time.monotonic() + self.connect_timeout_s
        delay = 0.05
        while time.monotonic() < end:
            s = None
            try:
                s = socket.create_connection(_host_port(self.remote), timeout=max(end - time.monotonic(), 0.1))
                hello = _recv_exact(s, len(GATE_MAGIC) + NONCE)
                if hello is not None and hello.startswith(GATE_MAGIC):
                    nonce, mine = hello[len(GATE_MAGIC):], os.urandom(NONCE)
                    s.sendall(mine + _proof(self.key, b"c", nonce, mine))
                    theirs = _recv_exact(s, MAC)
                    if theirs is not None and hmac.compare_digest(theirs, _proof(self.key, b"s", nonce, mine)):
                        s.settimeout(None)
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        return s
                self.stats["refused"] += 1
            except OSError:
                self.stats["dial_errors"] += 1
            _close(s)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        return None

    def _relay(self, local: socket.socket) -> None:
        remote = self._dial()
        if remote is None:
            _close(local)
            return
        self.stats["relayed"] += 1
        local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(remote, local), name="phaseserve-egress-back", daemon=True).start()
        _pump(local, remote)


class GatedServer:
    """A transfer server behind a :class:`TransferGate`, with the interface :class:`~phaseserve.distributed.transfer.
    StagingArea` and :class:`~phaseserve.distributed.transfer.Puller` use: ``address()`` is the gate's,
    ``await_pull`` the jax server's, and ``connect(address)`` goes through an :class:`Egress` to that gate."""

    def __init__(self, server, gate: TransferGate, key: bytes):
        self.server, self.gate, self.key = server, gate, key
        self._egress: dict[str, Egress] = {}

    def address(self) -> str:
        return self.gate.address

    def await_pull(self, *args, **kw):
        return self.server.await_pull(*args, **kw)

    def connect(self, address: str):
        egress = self._egress.get(address)
        if egress is None:
            egress = self._egress[address] = Egress(address, self.key)
        return self.server.connect(egress.address)

    def forget(self, address: str) -> None:
        """Stop relaying to ``address`` (its peer is gone or its connection broke)."""
        egress = self._egress.pop(address, None)
        if egress is not None:
            egress.close()
