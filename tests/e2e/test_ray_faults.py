"""Faults of the Ray backend while requests stream through the HTTP server: its transfer ports under attack, hung
(SIGSTOP) actors, a prefill actor killed mid-transfer.

One module-wide deployment as in ``test_ray.py`` (a two-node ``ray.cluster_utils.Cluster`` on this machine, the
server built by ``launch.build_backend``, the in-process engine of the same config as the reference), with
``call_timeout_s`` shortened so that a hang past it is quick to reach. Checks:

- garbage, truncated frames, replayed frames and handshakes, frames the protocol does not allow, and a flood of
  200 connections on each actor's transfer port (``info()["address"]``, the gate) and on its bulk-data port, and
  forged / replayed descriptors through ``arm``, all while 8 streams run: no actor dies, every stream gives the
  in-process engine's greedy text, each refusal is counted by kind (the gate's ``port`` counters and the staging
  area's ``refused`` in ``snapshot()``), nothing leaks;
- a SIGSTOPped decode actor: ``/health`` is 503 within 5 s, 200 again after SIGCONT, and the streams finish with
  the reference text; stopped past ``call_timeout_s``, it is killed as hung, its streams end typed
  (``PeerDeadError``), Ray restarts it and the service heals;
- a SIGSTOPped prefill actor: decoding streams keep getting tokens, a new request waits and is served after
  SIGCONT;
- a prefill actor SIGKILLed between arming a handoff and its pull landing: the pull is abandoned (not timed out),
  the requests it held are requeued and served with the reference text, the service heals, nothing leaks.

Only loopback traffic; every wait is bounded; a stopped process is always continued (``finally``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import signal
import socket
import struct
import threading
import time

import openai
import pytest
import ray

from phaseserve.distributed import gate as G
from phaseserve.distributed.protocol import ForgedDescriptorError, StaleDescriptorError, deployment_secret
from phaseserve.distributed.transfer import DescriptorAuth
from tests.e2e.test_ray import (
    MODEL,
    TOK,
    _client,
    _health,
    _in_loop,
    _no_leaks,
    _stream,
    _texts,
    _until,
    serve_on_two_nodes,
)

CALL_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def deployment():
    yield from serve_on_two_nodes([f"experiment.ray.call_timeout_s={CALL_TIMEOUT_S}"])


def _info(engine, phase: str) -> dict:
    """The actor's own account of itself now (its incarnation, pid, transfer address)."""
    return ray.get(engine.actors[phase].info.remote(), timeout=60)


def _snapshot(engine, phase: str) -> dict:
    w = engine.phases[phase]
    return ray.get(w.handle.call.remote(w.incarnation, "snapshot"), timeout=60)


@contextlib.contextmanager
def _stopped(pid: int):
    """SIGSTOP ``pid`` for the block; SIGCONT after it whatever happens (unless the process is gone)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _streams_in_background(deployment: dict, prompts: list[str], max_tokens: int) -> concurrent.futures.Future:
    """``_texts`` of the Ray server in a thread (a burst admitted in one engine step): the future of the texts."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(_texts, deployment, "base", prompts, max_tokens)
    pool.shutdown(wait=False)
    return fut


def _until_status(base: str, status: int, timeout_s: float) -> float:
    """Seconds until ``/health`` answers ``status`` (asserts it does within ``timeout_s``)."""
    t0 = time.monotonic()
    while _health(base) != status:
        assert time.monotonic() - t0 < timeout_s, f"/health did not turn {status} within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


# ---- the transfer ports -------------------------------------------------------------------------------------
def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _len_field(num: int, body: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(body)) + body


def _pull_frame(uuid: int) -> bytes:
    """A well-formed pull request (jax 0.10.2's ``SocketTransferRequest.pull``): uuid, buffer ids [0], req id 0."""
    return _frame(_len_field(1, _varint(1 << 3) + _varint(uuid) + _len_field(2, b"\0") + _varint(3 << 3) + b"\0"))


def _bulk_frame(address: bytes = b"127.0.0.1:1") -> bytes:
    """A well-formed bulk-transport setup (``SocketTransferRequest.bulk_transport``) naming ``address``."""
    return _frame(_len_field(3, _len_field(2, address)))


def _send(address: str, payload: bytes, wait_s: float = 0.2, hello: bool = True) -> bytes:
    """Connect to ``address`` (loopback), send ``payload``, and return what comes back: with ``hello``, read until
    the gate's hello has come (or the connection ends; 10 s at most), then for ``wait_s`` more; without, for
    ``wait_s``."""
    want = len(G.GATE_MAGIC) + G.NONCE if hello else 0
    with socket.create_connection(_host_port(address), timeout=10) as s:
        with contextlib.suppress(OSError):
            s.sendall(payload)
        got, end = b"", time.monotonic() + 10
        with contextlib.suppress(OSError):
            while len(got) < want and time.monotonic() < end and (chunk := s.recv(4096)):
                got += chunk
            s.settimeout(wait_s)
            while chunk := s.recv(4096):
                got += chunk
        return got


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _authenticated(address: str, key: bytes) -> tuple[socket.socket, bytes]:
    """A connection to the gate at ``address`` past its handshake (``key``: the deployment's), and the bytes this
    side sent in the handshake."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
    hello = G._recv_exact(s, len(G.GATE_MAGIC) + G.NONCE)
    mine = os.urandom(G.NONCE)
    sent = mine + G._proof(key, b"c", hello[len(G.GATE_MAGIC):], mine)
    s.sendall(sent)
    assert G._recv_exact(s, G.MAC) == G._proof(key, b"s", hello[len(G.GATE_MAGIC):], mine)
    return s, sent


def _closed_by_peer(s: socket.socket, payload: bytes) -> bool:
    """Send ``payload`` on an authenticated connection and end this side's writing (a truncated frame is one the
    peer stopped sending); True once the gate has closed the connection."""
    with s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass
        except TimeoutError:
            return False
        except OSError:
            pass
        return True


def _attack(address: str, pid: int, key: bytes, rng: random.Random) -> dict[str, int]:
    """Everything a stranger (or a broken peer) can throw at the transfer port of the actor ``pid``; the refusals it
    should cause."""
    unauth = [b"\0" * 64, b"\0" * 4, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", _pull_frame(1)[:7],
              b"\x00\x00\x10\x00" + b"x" * 60, _bulk_frame() + _pull_frame(1 << 60), _pull_frame(1 << 60)]
    unauth += [rng.randbytes(64) for _ in range(8)]
    for payload in unauth:  # the gate's hello comes back, nothing else (no jax frame), and the actor lives
        got = _send(address, payload)
        assert got[:len(G.GATE_MAGIC)] == G.GATE_MAGIC and len(got) == len(G.GATE_MAGIC) + G.NONCE, \
            (payload[:16], got[:40], f"actor alive: {_alive(pid)}")
    s, recorded = _authenticated(address, key)
    s.close()
    assert _send(address, recorded, wait_s=1.0)[len(G.GATE_MAGIC) + G.NONCE:] == b""  # a replayed handshake
    socks = []
    try:
        for _ in range(200):  # a flood: 200 connections opened, then closed
            socks.append(socket.create_connection(_host_port(address), timeout=5))
    finally:
        for c in socks:
            c.close()
    # past the handshake (a peer holding the secret, broken): each frame the protocol does not allow is refused
    bad = [b"\0" * 4, _pull_frame(12345), _frame(b"\x08\x01"), _bulk_frame() + _frame(_len_field(2, b"\x08\x00")),
           _bulk_frame() + _bulk_frame(), _bulk_frame() + b"\xff\xff\xff\xff", _bulk_frame() + _pull_frame(7)[:9]]
    for payload in bad:
        assert _closed_by_peer(_authenticated(address, key)[0], payload)
    # the jax server's bulk-data port (learned from its answer to a bulk setup): garbage and a flood there too
    s, _ = _authenticated(address, key)
    with s:
        s.sendall(_bulk_frame())
        (n,) = struct.unpack("<I", G._recv_exact(s, 4))
        reply = G._recv_exact(s, n)
    (kind, _, setup), = G._fields(reply)
    bulk = next(v for num, _, v in G._fields(setup) if num == 2).decode()
    assert kind == G.BULK
    for payload in [b"\0" * 64, b"\0" * 8, b"\xff" * 64] + [rng.randbytes(256) for _ in range(4)]:
        _send(bulk, payload, hello=False)
    socks = [socket.create_connection(_host_port(bulk), timeout=5) for _ in range(100)]
    for c in socks:
        c.close()
    return {"unauthenticated_or_busy": len(unauth) + 1 + 200, "frame": len(bad), "authenticated": len(bad) + 2}


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    assert host in ("127.0.0.1", "[::1]"), address
    return host.strip("[]"), int(port)


_PORT_CHILD = """
import datetime, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import transfer
from phaseserve.distributed.transfer import Puller, StagingArea, start_endpoint
gated = sys.argv[1] == "gated"
if gated:
    server = start_endpoint(gate=True)
else:
    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
x = jnp.arange(16, dtype=jnp.float32)
server.await_pull(42, [x], timeout=datetime.datetime.now() + datetime.timedelta(seconds=60))
print(server.address(), flush=True)
sys.stdin.readline()  # the parent's payloads are in
if gated:  # and a genuine stage, arm and pull through the gates still lands
    staging = StagingArea(server, num_pages=2, page_size=4, ttl_s=60.0)
    desc = staging.stage("r", [jnp.arange(8, dtype=jnp.float32)], 8, "float32")
    staging.serve(desc)
    got = Puller(start_endpoint(gate=True), jax.devices()[0]).pull(desc)
    end = time.monotonic() + 30
    while not got[0].is_ready() and time.monotonic() < end:
        time.sleep(0.01)
    assert np.array_equal(np.asarray(got[0]), np.arange(8)), got
print("alive", flush=True)
"""


def _port_child(kind: str, payloads: list[bytes]) -> tuple[int | None, str]:
    """A transfer server in a child process (``kind`` "raw": jax's own, or "gated": ``start_endpoint(gate=True)``)
    with uuid 42 armed; each payload sent on a connection of its own; (its exit code, its stdout)."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    p = subprocess.Popen([sys.executable, "-c", _PORT_CHILD, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = p.stdout.readline().strip()
        for payload in payloads:
            with contextlib.suppress(OSError):
                _send(address, payload, wait_s=0.5, hello=False)
        with contextlib.suppress(OSError):
            p.stdin.write("go\n")
            p.stdin.flush()
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return p.returncode, out


def test_what_kills_a_raw_transfer_server_is_refused_by_the_gate():
    """Measured on jax 0.10.2 (why the gate exists): a zero-length frame aborts the jax transfer server's process,
    and a pull frame of an armed uuid before any bulk-transport setup crashes it. The gated endpoint takes both,
    and random bytes, and a genuine pull through it lands afterwards."""
    for payload in (b"\0" * 4, _pull_frame(42)):
        rc, out = _port_child("raw", [payload])
        assert rc not in (0, None) and "alive" not in out, (payload, rc)  # killed by its signal (SIGABRT, SIGSEGV)
    rc, out = _port_child("gated", [b"\0" * 4, _pull_frame(42), _bulk_frame() + _pull_frame(42),
                                    random.Random(1).randbytes(64)])
    assert rc == 0 and "alive" in out, rc


def _forge_through_arm(engine) -> dict[str, int]:
    """Forged, foreign, altered and replayed descriptors through the prefill actor's ``arm``, beside the engine
    (the actor serializes the calls): each refused typed. A descriptor of the null page is staged and released."""
    w = engine.prefill
    call = lambda *a: ray.get(w.handle.call.remote(w.incarnation, *a), timeout=60)  # noqa: E731
    desc = call("stage", [0], None, "attacker")
    refused = {}

    def refuse(bad, kind, typ=StaleDescriptorError):
        with pytest.raises(typ) as e:
            call("arm", bad, desc.request_id)
        assert e.value.kind == kind
        refused[kind] = refused.get(kind, 0) + 1

    try:
        refuse(desc.replace(length=desc.length + 1), "forged", ForgedDescriptorError)  # altered after signing
        refuse(DescriptorAuth(b"another deployment's secret").sign(desc), "forged", ForgedDescriptorError)
        refuse(DescriptorAuth().sign(desc.replace(uuid=desc.uuid + 10**6)), "unknown")
        call("arm", desc, desc.request_id)  # armed once (never pulled: released below)
        refuse(desc, "replayed")
        refuse(desc, "replayed")
    finally:
        assert call("release", desc.uuid)
    return refused


def test_attacks_on_the_transfer_ports_while_streaming_change_nothing(deployment):
    engine, rng = deployment["engine"], random.Random(0)
    key = G.gate_key(deployment_secret())
    before = {p: (_info(engine, p), _snapshot(engine, p)) for p in ("prefill", "decode")}
    prompts = [f"def attacked{i}(x):\n    return x * {i} + " for i in range(8)]
    statuses, done = [], threading.Event()  # /health all along (a compile in an actor must not read as a hang)

    def sample() -> None:
        while not done.wait(0.2):
            statuses.append(_health(deployment["base"]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fut = _streams_in_background(deployment, prompts, max_tokens=64)
        steps = engine.metrics.decode_steps
        _until(lambda: engine.metrics.decode_steps > steps + 2, "the streams to decode")
        expected = {p: _attack(before[p][0]["address"], before[p][0]["pid"], key, rng) for p in ("prefill", "decode")}
        forged = _forge_through_arm(engine)
        got = fut.result(timeout=300)
    finally:
        done.set()
        sampler.join(30)
    assert statuses and set(statuses) == {200}, statuses
    assert got == _texts(deployment, "ref_base", prompts, max_tokens=64)
    for p in ("prefill", "decode"):
        info, snap = _info(engine, p), _snapshot(engine, p)
        assert (info["pid"], info["incarnation"]) == (before[p][0]["pid"], before[p][0]["incarnation"])
        old, new = before[p][1]["port"], snap["port"]
        delta = {k: new["refused"].get(k, 0) - old["refused"].get(k, 0) for k in ("unauthenticated", "busy", "frame")}
        assert delta["unauthenticated"] + delta["busy"] == expected[p]["unauthenticated_or_busy"], (p, delta)
        assert delta["frame"] == expected[p]["frame"], (p, delta)
        assert new["authenticated"] - old["authenticated"] >= expected[p]["authenticated"]
    refused = _snapshot(engine, "prefill")["refused"]
    for kind, n in forged.items():
        assert refused.get(kind, 0) - before["prefill"][1]["refused"].get(kind, 0) == n, (kind, refused)
    assert engine.prefill.deaths == engine.decode.deaths == 0 and engine.prefill.hangs == engine.decode.hangs == 0
    _in_loop(deployment["app"], _no_leaks)


# ---- hung and killed actors -----------------------------------------------------------------------------------
def _stream_into(base: str, prompt: str, max_tokens: int, chunks: list) -> str:
    """One greedy stream; each chunk's arrival time appended to ``chunks``."""
    stream = _client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    text = ""
    for c in stream:
        if c.choices and c.choices[0].text:
            text += c.choices[0].text
            chunks.append(time.monotonic())
    return text


def _burst(deployment: dict, prompts: list[str], max_tokens: int, chunks: list) -> concurrent.futures.Future:
    """Streams from the Ray server admitted in one engine step (as ``_texts``: the loop held until every request
    waits in its inbox), in the background; the future of their texts (each an exception if it failed)."""
    loop = deployment["app"].state.loops[0]
    gate = threading.Event()
    held = loop.run_exclusive(lambda backend: gate.wait(300))
    pool = concurrent.futures.ThreadPoolExecutor(len(prompts) + 1)
    try:
        _until(held.running, "the engine loop to be held")
        futs = [pool.submit(_stream_into, deployment["base"], p, max_tokens, chunks) for p in prompts]
        _until(lambda: loop.queued >= len(prompts), "every request to wait in the inbox")
    finally:
        gate.set()
    done = pool.submit(lambda: [f.exception(timeout=300) or f.result() for f in futs])
    pool.shutdown(wait=False)
    return done


def test_a_stopped_decode_actor_is_reported_within_5_s_and_resumes_after_sigcont(deployment):
    engine, base = deployment["engine"], deployment["base"]
    info = _info(engine, "decode")
    prompts = [f"def paused{i}(x):\n    return x - {i} * " for i in range(4)]
    chunks: list[float] = []
    fut = _burst(deployment, prompts, 120, chunks)
    _until(lambda: len(chunks) >= 8, "the streams to get text")
    with _stopped(info["pid"]):
        t_503 = _until_status(base, 503, 5.0)
        assert "decode actor is not answering" in _health_text(base)
        print(f"decode actor stopped: /health 503 after {t_503:.2f} s")
        n = len(chunks)
        time.sleep(1.0)
        assert len(chunks) - n <= len(prompts), "tokens kept coming from a stopped decode actor"
        assert t_503 + 1.0 < CALL_TIMEOUT_S - 2  # resumed well before the engine gives the actor up
    _until_status(base, 200, 10.0)
    got = fut.result(timeout=300)
    assert got == _texts(deployment, "ref_base", prompts, max_tokens=120)
    assert _info(engine, "decode")["incarnation"] == info["incarnation"]
    assert engine.decode.hangs == 0 and engine.decode.deaths == 0
    _in_loop(deployment["app"], _no_leaks)


def test_a_decode_actor_stopped_past_the_call_timeout_is_killed_its_streams_end_typed_and_the_service_heals(
        deployment):
    engine, base = deployment["engine"], deployment["base"]
    info, deaths = _info(engine, "decode"), engine.decode.deaths
    prompts = [f"def hung{i}(x):\n    return x + {i} - " for i in range(4)]
    chunks: list[float] = []
    fut = _burst(deployment, prompts, 200, chunks)
    _until(lambda: len(chunks) >= 8, "the streams to get text")
    t0 = time.monotonic()
    with _stopped(info["pid"]):
        outcomes = fut.result(timeout=CALL_TIMEOUT_S + 20)  # the streams end once the engine gives the actor up
        waited = time.monotonic() - t0
    print(f"decode actor stopped: its streams ended after {waited:.2f} s (call_timeout_s {CALL_TIMEOUT_S})")
    assert CALL_TIMEOUT_S - 1.0 <= waited <= CALL_TIMEOUT_S + 6.0, waited
    assert all(isinstance(o, openai.APIError) and "PeerDeadError" in str(o) and "hung" in str(o)
               for o in outcomes), outcomes
    _until_status(base, 200, 180.0)
    assert engine.decode.hangs == 1 and engine.decode.deaths == deaths + 1 and engine.prefill.deaths == 0
    assert _info(engine, "decode")["incarnation"] != info["incarnation"]
    fresh = [f"class Healed{i}:\n    size = {i} + " for i in range(4)]
    assert _texts(deployment, "base", fresh) == _texts(deployment, "ref_base", fresh)
    _in_loop(deployment["app"], _no_leaks)


def test_a_stopped_prefill_actor_lets_decoding_streams_go_on(deployment):
    engine, base = deployment["engine"], deployment["base"]
    info = _info(engine, "prefill")
    prompts = [f"def going{i}(x):\n    return x * x - {i} + " for i in range(4)]
    chunks: list[float] = []
    fut = _burst(deployment, prompts, 200, chunks)
    _until(lambda: len(chunks) >= 8, "the streams to get text")
    late_prompt = "class Late:\n    stopped = "
    with concurrent.futures.ThreadPoolExecutor(1) as pool, _stopped(info["pid"]):
        _until_status(base, 503, 5.0)
        assert "prefill actor is not answering" in _health_text(base)
        late = pool.submit(_stream, base, late_prompt)  # needs the stopped prefill actor: waits
        n = len(chunks)
        time.sleep(2.0)
        assert len(chunks) - n >= 8, "the decoding streams stalled behind the stopped prefill actor"
        assert not late.done()
    _until_status(base, 200, 10.0)
    assert len(TOK.encode(late.result(timeout=120))) >= 8
    texts = fut.result(timeout=300)
    assert all(isinstance(t, str) and len(TOK.encode(t)) >= 150 for t in texts), texts
    assert _info(engine, "prefill")["incarnation"] == info["incarnation"]
    assert engine.prefill.hangs == 0 and engine.prefill.deaths == 0
    _in_loop(deployment["app"], _no_leaks)


def _prefill_fault_mid_handoff(deployment: dict, worker, method: str, sig: int, tag: str) -> float:
    """Send ``sig`` to the prefill actor as soon as the engine's ``worker`` sends ``method`` (a handoff's ``arm`` to
    the prefill actor, or its ``pull_land`` to the decode actor) for a burst of 6 fresh prompts; check that the
    burst is then served with the reference text (requeued: none had emitted a token) and the service heals. The
    seconds from the signal to the engine handling the prefill actor as lost. A stopped actor is continued after."""
    engine = deployment["engine"]
    pid, deaths = _info(engine, "prefill")["pid"], engine.prefill.deaths
    sent: list[float] = []
    name = "call" if method == "arm" else "submit"
    send = getattr(worker, name)

    def signal_when_sent(m, *args):
        out = send(m, *args)
        if m == method and not sent:
            os.kill(pid, sig)
            sent.append(time.monotonic())
        return out

    setattr(worker, name, signal_when_sent)
    try:
        prompts = [f"def {tag}{i}(x):\n    return x // {i + 1} + " for i in range(6)]
        fut = _burst(deployment, prompts, 24, [])
        _until(lambda: sent, f"a handoff's {method}")
        _until(lambda: engine.prefill.deaths > deaths, "the engine to give the prefill actor up", CALL_TIMEOUT_S + 20)
        handled = time.monotonic() - sent[0]
    finally:
        delattr(worker, name)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert fut.result(timeout=300) == _texts(deployment, "ref_base", prompts, max_tokens=24)
    _until(lambda: not _alive(pid), "the old prefill process to be gone", 30.0)
    assert engine.prefill.deaths == deaths + 1 and _info(engine, "prefill")["pid"] != pid
    _until_status(deployment["base"], 200, 60.0)
    return handled


def test_a_prefill_actor_hung_or_killed_mid_transfer_requeues_its_requests_and_the_service_heals(deployment):
    engine = deployment["engine"]
    before, decode_deaths = _snapshot(engine, "decode"), engine.decode.deaths
    # stopped once it armed the handoff (the decode actor's pull hangs on it): given up after call_timeout_s,
    # not left to block the engine
    handled = _prefill_fault_mid_handoff(deployment, engine.prefill, "arm", signal.SIGSTOP, "hung")
    print(f"prefill actor stopped after arming: given up after {handled:.2f} s")
    assert CALL_TIMEOUT_S - 1.0 <= handled <= CALL_TIMEOUT_S + 4.0, handled
    # killed once the pull was sent (the kill races the bytes): the pull is abandoned at once, not at its deadline
    handled = _prefill_fault_mid_handoff(deployment, engine.decode, "pull_land", signal.SIGKILL, "killed")
    print(f"prefill actor killed as the pull was sent: handled after {handled:.2f} s")
    assert handled < 5.0, handled  # far below transfer_timeout_s (30 s)
    after = _snapshot(engine, "decode")
    assert after.get("timeouts", 0) == before.get("timeouts", 0)
    failed = sum(after.get(k, 0) - before.get(k, 0) for k in ("abandoned", "transfer_errors"))
    assert failed == 2, (before, after)
    assert engine.prefill.hangs >= 1 and engine.decode.deaths == decode_deaths
    _in_loop(deployment["app"], _no_leaks)


def _health_text(base: str) -> str:
    import http.client

    host, port = _host_port(base.split("//")[1])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/health")
    text = conn.getresponse().read().decode()
    conn.close()
    return text
