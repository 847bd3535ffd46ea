"""The router: starts the prefill and decode server processes, admits requests, relays the control plane.

It runs in the caller's process and owns no devices. Requests are validated here (a bad one ends with a typed
error and never reaches a server), sent to the prefill server, and, once prefilled, handed to the decode server
together with the :class:`~phaseserve.serving.protocol.TransferDescriptor` saying where to pull their KV from.
All server-to-server control messages pass through :meth:`Router.poll` (hub and spoke), which is also where
peer death is noticed::

    prefill dies  ->  requests still waiting for their prefill end with PeerDeadError
                      (those already at the decode side miss their grant deadline: TransferTimeoutError)
                      (those already pulling get an errored pull: TransferError; the decode server lives on)
    decode dies   ->  requests handed to it end with PeerDeadError; the prefill side frees their staged KV
                      at its TTL; :meth:`restart` brings up a fresh decode server and serving goes on
    either side   ->  :meth:`restart` brings up a fresh one and it serves the requests submitted after

A request or control message that makes a server raise ends that request alone with ``("failed", rid, error)``
(``finish_reason="error"``, the error's own class rebuilt here); no request can end a server process.

Fault hooks for tests: ``tamper`` (``rid -> fn(descriptor) -> descriptor`` applied when a descriptor is forwarded)
and :meth:`inject` (hand the decode side an arbitrary descriptor, e.g. a replay of a consumed one).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import queue
import time
from pathlib import Path
from typing import Any

from phaseserve.config import ModelConfig
from phaseserve.engine.request import CancelledError, Limits, Request, RequestOutput, open_request
from phaseserve.engine.workers import stop_reason
from phaseserve.serving.decode_server import serve_decode
from phaseserve.serving.prefill_server import serve_prefill
from phaseserve.serving.protocol import PeerDeadError, ServerSpec, TransferDescriptor, child_env, rebuild_error

TARGETS = {"prefill": serve_prefill, "decode": serve_decode}


def model_config(spec: ServerSpec) -> ModelConfig:
    """The model config alone (no weights): enough to validate requests in the router."""
    if spec.model.checkpoint:
        return ModelConfig.from_hf_config(json.loads((Path(spec.model.checkpoint) / "config.json").read_text()))
    return ModelConfig.from_hf_config(dict(spec.model.hf_config))


class Router:
    def __init__(self, prefill: ServerSpec, decode: ServerSpec, *, start_timeout_s: float = 180.0):
        self.specs = {"prefill": prefill, "decode": decode}
        self.ctx = mp.get_context("spawn")
        # One queue per server towards the router, made anew at each (re)start: a process killed while its queue's
        # feeder thread holds the queue's write lock leaves that lock held forever, so a queue shared with the
        # restarted server (or the peer) would swallow every later message, its "ready" included.
        self.outboxes: dict[str, Any] = {}
        self.cfg = model_config(decode)
        self.limits = Limits.of(self.cfg, decode.serve, decode.serve.cache.num_pages, prefill.staging_pages)
        self.max_context = self.limits.max_context
        self.procs: dict[str, Any] = {}
        self.inboxes: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}
        self.dead: set[str] = set()
        self.outputs: dict[str, RequestOutput] = {}
        self.requests: dict[str, Request] = {}
        self.state: dict[str, str] = {}  # rid -> "prefill" | "decode" | "done"
        self.descriptors: dict[str, TransferDescriptor] = {}
        self.tamper: dict[str, Any] = {}
        self.seen: set[tuple[str, str]] = set()  # (message kind, rid) relayed: ("serve", rid), ("serve_reply", rid)
        self._stats: dict[str, dict] = {}
        for role in ("prefill", "decode"):
            self._start(role)
        self._wait_ready(set(self.procs), start_timeout_s)

    # ---- processes ----------------------------------------------------------------------------------------
    def _start(self, role: str) -> None:
        spec = self.specs[role]
        self.inboxes[role] = inbox = self.ctx.Queue()
        self.outboxes[role] = outbox = self.ctx.Queue()
        with child_env(spec.host_devices, spec.compilation_cache_dir):
            proc = self.ctx.Process(target=TARGETS[role], args=(spec, inbox, outbox), name=f"ps-{role}",
                                    daemon=True)
            proc.start()
        self.procs[role] = proc
        self.addresses.pop(role, None)
        self.dead.discard(role)

    def _wait_ready(self, roles: set[str], timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not roles <= set(self.addresses):
            if time.monotonic() > end:
                raise TimeoutError(f"servers {sorted(roles - set(self.addresses))} did not start in {timeout_s}s")
            for r in roles - set(self.addresses):
                if not self.procs[r].is_alive():
                    raise RuntimeError(f"the {r} server exited during start (exit code {self.procs[r].exitcode})")
            self.poll(0.1)

    def kill(self, role: str) -> None:
        """Kill a server process (fault tests); :meth:`poll` then ends the requests it held."""
        self.procs[role].kill()
        self.procs[role].join(10)

    def restart(self, role: str, timeout_s: float = 180.0) -> None:
        """Start a fresh server for ``role`` (after it died) and wait until it is ready."""
        if self.procs[role].is_alive():
            raise RuntimeError(f"the {role} server is still alive")
        self.poll(0)
        self._start(role)
        self._wait_ready({role}, timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for role, proc in self.procs.items():
            if proc.is_alive():
                self.inboxes[role].put(("shutdown",))
        for proc in self.procs.values():
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests -----------------------------------------------------------------------------------------
    def submit(self, req: Request) -> RequestOutput:
        req, out = open_request(req, self.limits, self.outputs)  # ids stay in use after they finish here
        if req is None:
            return out
        self.outputs[req.id], self.requests[req.id] = out, req
        if "prefill" in self.dead:
            self._end(req.id, "aborted", PeerDeadError("the prefill server is dead"))
        else:
            self.state[req.id] = "prefill"
            self.inboxes["prefill"].put(("prompt", req))
        return out

    def inject(self, req: Request, first_token: int, desc: TransferDescriptor) -> RequestOutput:
        """Hand the decode side ``desc`` for a new request (fault tests: replayed or forged descriptors)."""
        out = RequestOutput(id=req.id, tokens=[first_token])
        out.metrics.arrival = time.perf_counter()
        self.outputs[req.id], self.requests[req.id], self.state[req.id] = out, req, "decode"
        self.inboxes["decode"].put(("kv_ready", req, first_token, desc))
        return out

    def cancel(self, rid: str) -> bool:
        if not isinstance(rid, str) or self.state.get(rid) not in ("prefill", "decode"):
            return False
        if self.state[rid] == "decode":
            self.inboxes["decode"].put(("cancel", rid))
        self._end(rid, "aborted", CancelledError(f"request {rid!r} was cancelled"))
        return True

    def _end(self, rid: str, reason: str, err: Exception | None = None) -> None:
        out = self.outputs[rid]
        if out.finish_reason is None:
            out.finish_reason, out.error = reason, err
            out.metrics.finished = time.perf_counter()
            out.metrics.num_output_tokens = len(out.tokens)
        self.state[rid] = "done"

    @property
    def has_work(self) -> bool:
        return any(s != "done" for s in self.state.values())

    # ---- control plane ------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.05) -> int:
        """Relay and apply queued messages (waiting up to ``timeout`` for the first); check peers' liveness."""
        end = time.monotonic() + timeout
        n = self._drain()
        while n == 0 and time.monotonic() < end:  # nothing queued yet: wait up to ``timeout`` for a first message
            time.sleep(min(0.002, max(end - time.monotonic(), 0.0)))
            n = self._drain()
        self._check_peers()
        return n

    def _drain(self) -> int:
        """Apply every message already queued by either server; returns how many."""
        n = 0
        for q in list(self.outboxes.values()):
            with contextlib.suppress(queue.Empty):
                while True:
                    self._dispatch(q.get_nowait())
                    n += 1
        return n

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            self.addresses[msg[1]] = msg[2]
        elif kind == "prefilled":
            self._on_prefilled(*msg[1:])
        elif kind == "tokens":
            for rid, tok in msg[1]:
                out = self.outputs.get(rid)
                if out is not None and out.finish_reason is None:
                    out.tokens.append(tok)
        elif kind == "failed":  # the prefill side could not serve it (the error says why); nothing is staged
            if msg[1] in self.outputs:
                self._end(msg[1], "error", rebuild_error(msg[2]))
        elif kind == "finished":  # the decode side is done with the request, its transfer included
            rid, reason, err = msg[1], msg[2], rebuild_error(msg[3])
            self._release_staged(rid)
            if rid in self.outputs:
                self._end(rid, reason, err)
        elif kind in ("serve", "release"):  # decode -> prefill
            if kind == "serve":
                self.seen.add(("serve", msg[1]))
            if "prefill" not in self.dead:
                self.inboxes["prefill"].put(msg)
        elif kind == "serve_reply":  # prefill -> decode
            self.seen.add(("serve_reply", msg[1]))
            if "decode" not in self.dead:
                self.inboxes["decode"].put(msg)
        elif kind == "stats":
            self._stats[msg[1]] = msg[2]

    def _on_prefilled(self, rid: str, first: int, desc: TransferDescriptor | None) -> None:
        out = self.outputs.get(rid)
        if out is None or out.finish_reason is not None:  # cancelled meanwhile: free the staged KV now
            if desc is not None and "prefill" not in self.dead:
                self.inboxes["prefill"].put(("release", desc.uuid))
            return
        out.tokens.append(first)
        out.metrics.first_token = time.perf_counter()
        req = self.requests[rid]
        if desc is None:
            self._end(rid, stop_reason(req, first, 1, self.cfg.eos_token_ids) or "length")
            return
        self.descriptors[rid] = desc
        if "decode" in self.dead:
            self.inboxes["prefill"].put(("release", desc.uuid))
            self._end(rid, "aborted", PeerDeadError("the decode server is dead"))
            return
        if rid in self.tamper:
            desc = self.tamper[rid](desc)
        self.state[rid] = "decode"
        self.inboxes["decode"].put(("kv_ready", req, first, desc))

    def _release_staged(self, rid: str) -> None:
        """Free ``rid``'s staged KV on the prefill side now (idempotent; a consumed uuid is ignored there)."""
        desc = self.descriptors.get(rid)
        if desc is not None and "prefill" not in self.dead:
            self.inboxes["prefill"].put(("release", desc.uuid))

    def _check_peers(self) -> None:
        for role, proc in self.procs.items():
            if role in self.dead or proc.is_alive():
                continue
            self.dead.add(role)
            for rid, st in list(self.state.items()):
                if st == role:
                    if role == "decode":  # it can never pull now: free what the prefill side staged for it
                        self._release_staged(rid)
                    self._end(rid, "aborted", PeerDeadError(f"the {role} server died (exit code {proc.exitcode})"))

    # ---- drivers ------------------------------------------------------------------------------------------
    def run(self, timeout_s: float = 120.0) -> None:
        """Poll until every request has finished (or raise ``TimeoutError``)."""
        end = time.monotonic() + timeout_s
        while self.has_work:
            if time.monotonic() > end:
                raise TimeoutError(f"requests still unfinished after {timeout_s}s: "
                                   f"{[r for r, s in self.state.items() if s != 'done'][:8]}")
            self.poll(0.01)

    def generate(self, requests: list[Request], timeout_s: float = 120.0) -> list[RequestOutput]:
        outs = [self.submit(r) for r in requests]
        self.run(timeout_s)
        return outs

    def stats(self, role: str, timeout_s: float = 30.0) -> dict:
        """A server's counters (pages in use, transfers, refusals, event log ...), fetched over the control plane."""
        self._stats.pop(role, None)
        self.inboxes[role].put(("stats",))
        end = time.monotonic() + timeout_s
        while role not in self._stats:
            if time.monotonic() > end or role in self.dead:
                raise TimeoutError(f"no stats from the {role} server")
            self.poll(0.02)
        return self._stats[role]
