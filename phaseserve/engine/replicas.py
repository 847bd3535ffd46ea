"""Data-parallel engine replicas: one :class:`~phaseserve.engine.Engine` per block of devices, each with its own
weights, page pool, scheduler and jitted steps, driven from one thread each so their device calls run at once.

Why: a decode step of a small batch keeps about one core busy on XLA:CPU (``benchmarks/engine/trials/split_batch.md``:
the step of each half of a batch-32 batch on its own simulated CPU device took 0.785x the time of the whole batch on
one device), and on an accelerator a model that fits one chip is served faster by replicas than by sharding it. The
same layout as data-parallel serving in vLLM or SGLang (engine replicas behind a load balancer), inside one process.

Routing: a call's requests are split over the replicas by load, in order: each goes to the replica with the fewest
tokens assigned so far (prompt length + ``max_tokens``; ties to the lowest index), and a repeated id follows the
first request of that id (so the replica reports the duplicate as the engine would). A replica runs its share with
its own continuous batching; outputs do not depend on which replica ran a request except through its batch-mates,
as on one engine.

Drivers: :meth:`ReplicatedEngine.generate` (outputs in input order) and :meth:`ReplicatedEngine.stream`
(``(request_id, token)`` events from every replica as they are produced; closing it early cancels the unfinished
requests, in each replica's own thread). A replica's ``generate``/``stream`` that raises is re-raised here after
the other replicas finished their share. :meth:`ReplicatedEngine.summary` merges the replicas' run metrics over the
wall time of this object's own calls; each replica's own summary is under ``"replicas"``.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import jax

from phaseserve.config import ConfigError, MeshConfig, ModelConfig, ServeConfig
from phaseserve.engine.engine import Engine, EngineBusyError, hydra_engine_args
from phaseserve.engine.metrics import percentiles
from phaseserve.engine.request import Request, RequestOutput
from phaseserve.model.params import Params
from phaseserve.sharding import SIMULATE_HINT, _have

SUMMED = ("requests", "completed", "aborted", "errors", "output_tokens", "prefill_tokens", "decode_steps",
          "preemptions", "integrity_checks", "prefill_tokens_saved")


def replica_devices(devices: list, mesh: MeshConfig, mode: str) -> list[list]:
    """Consecutive device blocks, one per replica: ``decode_tp * decode_ep`` devices each (colocated), plus
    ``prefill_tp`` (disaggregated; with every size 1 and one device per replica, the phases share it as an engine on a
    one-device machine does). ``mesh.replica_devices == "shared"``: all of ``devices`` for every replica (each lays
    its phases out over them as one engine would: the mesh's explicit device indices, or the defaults)."""
    if mesh.replica_devices == "shared":
        return [list(devices)] * mesh.replicas
    per = mesh.decode_tp * mesh.decode_ep + (mesh.prefill_tp if mode == "disaggregated" else 0)
    if mode == "disaggregated" and per == 2 and len(devices) < 2 * mesh.replicas:
        per = 1
    if len(devices) < per * mesh.replicas:
        raise ConfigError(f"MeshConfig.replicas={mesh.replicas} of {per} device(s) each needs {per * mesh.replicas} "
                          f"devices, but {_have(devices)}; {SIMULATE_HINT}")
    return [devices[i * per:(i + 1) * per] for i in range(mesh.replicas)]


def request_load(req: Request) -> int:
    """Tokens a request may hold (prompt + output): what routing by load counts (here and in the HTTP server's
    balancer); 0 for a malformed one (its replica reports the error)."""
    try:
        return len(req.prompt) + max(int(req.max_tokens), 0)
    except (TypeError, ValueError):
        return 0


def route(requests: list[Request], n: int) -> list[int]:
    """The replica index of each request: least tokens assigned so far, ties to the lowest index; a repeated id
    goes where its first occurrence went."""
    load, where, out = [0] * n, {}, []
    for r in requests:
        key = r.id if isinstance(getattr(r, "id", None), str) else None
        i = where.get(key) if key is not None else None
        if i is None:
            i = min(range(n), key=lambda j: (load[j], j))
            if key is not None:
                where[key] = i
        load[i] += request_load(r)
        out.append(i)
    return out


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_DONE = object()


class ReplicatedEngine:
    """``serve.mesh.replicas`` engines, one per device block (:func:`replica_devices`), each built as
    ``Engine(cfg, params, serve with replicas=1, devices=block)``."""

    def __init__(self, cfg: ModelConfig, params: Params, serve: ServeConfig | None = None, *,
                 replicas: int | None = None, devices: list | None = None, **engine_kw: Any):
        serve = serve or ServeConfig()
        n = replicas if replicas is not None else serve.mesh.replicas
        mesh = dataclasses.replace(serve.mesh, replicas=n)
        blocks = replica_devices(devices if devices is not None else jax.devices(), mesh, serve.mode)
        one = dataclasses.replace(serve, mesh=dataclasses.replace(mesh, replicas=1))
        self.cfg, self.serve = cfg, dataclasses.replace(serve, mesh=mesh)
        self.engines = [Engine(cfg, params, one, devices=block, **engine_kw) for block in blocks]
        if mesh.replica_devices == "shared":  # one mesh: one executable per shape serves every replica
            for e in self.engines[1:]:
                e.prefill.steps, e.decode.steps = self.engines[0].prefill.steps, self.engines[0].decode.steps
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="phaseserve-replica")
        self._driving = False
        self.busy_s = 0.0  # summed wall time of this object's generate()/stream() calls since reset_metrics()

    @classmethod
    def from_hydra(cls, hydra_cfg: Any) -> ReplicatedEngine:
        """Replicas from a composed ``configs/config.yaml`` tree (``mesh.replicas`` of them)."""
        cfg, params, serve, attn_impl, matmul_impl = hydra_engine_args(hydra_cfg)
        return cls(cfg, params, serve, attn_impl=attn_impl, matmul_impl=matmul_impl)

    @property
    def num_pages(self) -> int:
        """Pages of all the replicas' decode pools together."""
        return sum(e.num_pages for e in self.engines)

    @property
    def max_batch(self) -> int:
        """The replicas' concurrency caps summed (after setting ``n``: ``replicas * ceil(n / replicas)``)."""
        return sum(e.scheduler.max_batch for e in self.engines)

    @max_batch.setter
    def max_batch(self, total: int) -> None:
        """Split a concurrency cap over the replicas (each gets ``ceil(total / replicas)``)."""
        for e in self.engines:
            e.scheduler.max_batch = math.ceil(total / len(self.engines))

    @property
    def outputs(self) -> dict[str, RequestOutput]:
        return {k: v for e in self.engines for k, v in e.outputs.items()}

    def _enter(self) -> float:
        if self._driving:
            raise EngineBusyError("these replicas are already running a generate()/stream(); finish or close it first")
        self._driving = True
        return time.perf_counter()

    def _shares(self, requests: list[Request]) -> list[tuple[Engine, list[int]]]:
        """``(replica, indices of its requests)`` for every replica that gets any."""
        where = route(requests, len(self.engines))
        return [(e, idx) for i, e in enumerate(self.engines) if (idx := [k for k, w in enumerate(where) if w == i])]

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run ``requests`` to completion over the replicas at once; outputs in input order."""
        start = self._enter()
        try:
            shares = self._shares(requests)
            futs = [self._pool.submit(e.generate, [requests[k] for k in idx]) for e, idx in shares]
            wait(futs)
            out: list[Any] = [None] * len(requests)
            for (_, idx), f in zip(shares, futs, strict=True):
                for k, o in zip(idx, f.result(), strict=True):
                    out[k] = o
            return out
        finally:
            self.busy_s += time.perf_counter() - start
            self._driving = False

    def stream(self, requests: list[Request]) -> Iterator[tuple[str, int]]:
        """Yield ``(request_id, token)`` from every replica as produced, until all of ``requests`` finish. Closing
        the generator early stops each replica after its current step and cancels its unfinished requests."""
        start = self._enter()
        events: queue.Queue = queue.Queue()
        stop = threading.Event()

        def drive(engine: Engine, reqs: list[Request]) -> None:
            gen = engine.stream(reqs)
            try:
                for ev in gen:
                    events.put(ev)
                    if stop.is_set():
                        break
            except BaseException as exc:  # noqa: BLE001  (re-raised in the consumer's thread)
                events.put(_Failed(exc))
            finally:
                gen.close()
                events.put(_DONE)

        futs = []
        try:
            futs = [self._pool.submit(drive, e, [requests[k] for k in idx]) for e, idx in self._shares(requests)]
            live = len(futs)
            while live:
                item = events.get()
                if item is _DONE:
                    live -= 1
                elif isinstance(item, _Failed):
                    raise item.exc
                else:
                    yield item
        finally:
            stop.set()
            wait(futs)
            self.busy_s += time.perf_counter() - start
            self._driving = False

    def reset_metrics(self) -> None:
        for e in self.engines:
            e.reset_metrics()
        self.busy_s = 0.0

    def summary(self) -> dict:
        """The replicas' counters summed (:data:`SUMMED`), latency percentiles over every replica's finished
        requests, tokens/s over :attr:`busy_s`, the mean ``host_fraction_of_decode`` of the replicas that served
        requests, and each replica's own summary under ``"replicas"``."""
        parts = [e.summary() for e in self.engines]
        outs = [o for e in self.engines for o in e.outputs.values()]
        done = [o for o in outs if o.finish_reason in ("length", "stop")]
        wall = max(self.busy_s, 1e-9)
        used = [p for p in parts if p["requests"]]
        out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in SUMMED}
        out.update(wall_s=wall, output_tok_per_s=out["output_tokens"] / wall,
                   ttft=percentiles([o.metrics.ttft for o in done]), tpot=percentiles([o.metrics.tpot for o in done]),
                   e2e=percentiles([o.metrics.e2e for o in done]),
                   host_fraction_of_decode=sum(p["host_fraction_of_decode"] for p in used) / max(len(used), 1),
                   replicas=[{k: v for k, v in p.items() if k != "kernels"} for p in parts],
                   kernels=parts[0]["kernels"])
        return out

    def check_invariants(self) -> None:
        for e in self.engines:
            e.check_invariants()

    def close(self) -> None:
        """Stop the replicas' driver threads (idle ones exit at once)."""
        self._pool.shutdown(wait=True)
