"""Experiment: the HTTP server under load, as the official ``openai`` client sees it, beside the same engine in-process.
Settings in ``configs/experiment/http_load.yaml``; entry point ``experiments/http_load.py``.

One engine (the configured representation, e.g. the kv_dtype / weight_dtype / integrity workloads' quant and cache
groups) is warmed up, then served over HTTP (:mod:`phaseserve.server`, uvicorn in a thread of this process, on
127.0.0.1). For each concurrency and repeat, the same requests are played in each arm, order rotated:

- ``in-process``: :func:`lab.bench.workload.drive` (closed loop) on the served engine, run by the engine
  loop thread while no HTTP request is in flight (:meth:`~phaseserve.server.EngineLoop.run_exclusive`);
- ``http``: a client process (spawned, so the client does not share this process's interpreter lock) runs
  ``AsyncOpenAI`` with ``concurrency`` streamed completions in flight (token-id prompts, ``stream_options.
  include_usage``) and measures, per request, TTFT (send -> first chunk), TPOT ((last chunk - first chunk) /
  (completion tokens - 1)) and e2e (send -> end of stream); throughput is completion tokens over the run's wall
  time (first send -> last stream end). The client process keeps one ``AsyncOpenAI`` client for the whole
  experiment, as a load generator keeps its session: the untimed warm-up run opens its connections and the timed
  runs reuse them (the server keeps idle connections for ``timeout_s``). The server sends every token as its own
  event (``stream_interval`` 1);
- ``http-coalesced`` (when ``experiment.coalesced_interval`` > 1): the same, with the server sending one event per
  ``coalesced_interval`` tokens (:class:`~phaseserve.server.EngineLoop`'s ``stream_interval``; the first token and
  the end at once): fewer events for the server to write and the client to parse;
- ``in-process-loaded`` (when ``experiment.loaded_control``; needs ``client_cpus``): the in-process arm while the
  client process keeps its CPUs busy the fraction of the time the client of the last ``http`` run did (its CPU
  seconds over its wall time), doing the client's per-event work (:func:`busy`: parsing a completion chunk into the
  ``openai`` model). Where the client's CPUs are not independent of the server's (two vCPUs of one VM can share a
  physical core or its caches), the client's work slows the engine; this arm measures that alone, and
  ``ratio_http_over_loaded`` is the ``http`` arm's throughput over it, paired per repeat;
- ``in-process-replay`` (when ``experiment.replay_control``): the in-process arm with the arrivals the server's engine
  loop saw in the last ``http`` run (:func:`replay`): the first wave's requests at the offsets from the client's first
  send at which the server received them, each replacement that long after the finish it replaces as the server
  received it then. ``ratio_http_over_replay`` is the ``http`` arm's throughput over it, paired per repeat: the
  overhead that remains when the engine sees the same arrivals (their delays include the server writing a stream's
  last event and reading the next request, so this understates the server's share);
- ``http-frontend`` (when ``experiment.frontend_cpus`` is set, e.g. ``[1]``): as ``http``, with uvicorn's thread
  moved to those CPUs for the run and back after (the engine loop and XLA's workers stay where they are): the HTTP
  frontend on a host core of its own, as on an accelerator server, where the HTTP layer's CPU time does not come
  out of the engine's compute; the GIL still serializes its Python with the engine loop's. With the client on
  the same CPUs, the frontend also competes with the client for them.

The engine's numbers use the same definitions on its own clock (``RequestMetrics``: arrival at ``add_request``).
``overhead`` = HTTP throughput / in-process throughput per repeat (paired), and the same ratios of TTFT, TPOT and
e2e p50. On a CPU the client process, uvicorn and the engine share the machine's cores, so the HTTP arm also pays
for its client's CPU time. Where the time goes, per run: the CPU seconds of the server process (engine, XLA
threads, HTTP), split by thread (:func:`thread_cpu_s`: the engine loop's Python, uvicorn's event loop, and every
other thread, where XLA runs the compiled steps), and of the client process; the client's build (its first send
to its ``concurrency``-th request built, by a request hook on its HTTP client; :data:`BUILD`); the engine's own counters
(prefill batches, decode steps, mean running batch, seconds inside prefill and decode calls), the fill: from the
engine's first arrival to its ``concurrency``-th (in-process microseconds), and the refill: how long a slot a finished
request freed stayed empty until its replacement arrived, over HTTP split into its way back to the client, the
client's next request, its way to the server's handler (``RequestMetrics.received``) and its wait in the engine
loop's inbox (:func:`engine_gaps`, :func:`refill_parts`).

``experiment.client_cpus`` (e.g. ``[1]``) stands in for a client on another machine: the client process is pinned
to those CPUs and every thread of the server process (engine, XLA workers, uvicorn) to the others, for every arm,
the in-process one included, so both arms get the same cores and the client's CPU time no longer competes with
the server's. The server process is pinned before JAX starts, so XLA sizes its worker pools to the server's CPUs
(pinned after, a 2-core machine's server ran XLA's two-thread pools on its one CPU). ``null`` (the default) pins
nothing: client and server share every core.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import aggregate, compile_free, environment, paired, rotated
from lab.bench.schema import experiment_spec
from lab.bench.workload import concurrencies, drive, make_requests, num_requests, reset_engine, warmup
from phaseserve.config_hydra import to_container
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.engine import Engine, Request
from phaseserve.engine.metrics import percentiles

ARMS = ["in-process", "in-process-loaded", "in-process-replay", "http", "http-coalesced", "http-frontend"]
LOADED = "in-process-loaded"  # the in-process arm with the client's CPUs kept as busy as in the last http run
REPLAY = "in-process-replay"  # the in-process arm with the last http run's arrivals outside the server (replay)
CONTROLS = {LOADED: "ratio_http_over_loaded", REPLAY: "ratio_http_over_replay"}
THREADS = ["engine_loop", "http", "other"]  # server CPU by thread: the engine loop, uvicorn, the rest (XLA pools)
SPLIT = ["ramp_s", "engine_wall_s", "tail_s", "engine_tok_per_s"]  # split_wall; the in-process arm: 0, wall, 0, tok/s
FILL = "fill_s"  # the engine's first arrival to its concurrency-th: how long the first batch took to come in
BUILD = "build_s"  # the client's first send to its concurrency-th request built: the client's share of the ramp
REFILL = "refill_s"  # closed loop: the engine's k-th finish to its (concurrency + k)-th arrival, mean (refill_parts)
DELIVER = "deliver_s"  # the refill's parts over HTTP: the engine's k-th finish to the client's k-th stream end,
CLIENT_REFILL = "client_refill_s"  # then to the client's (concurrency + k)-th request built,
TRANSIT = "transit_s"  # then to the server's (concurrency + k)-th received (queued for the engine loop),
INBOX = "inbox_s"  # then to the engine's (concurrency + k)-th arrival
PARTS = [DELIVER, CLIENT_REFILL, TRANSIT, INBOX]
MS_COLS = {"ramp_s": "ramp ms", BUILD: "client build ms", "tail_s": "tail ms", FILL: "fill ms", REFILL: "refill ms",
           DELIVER: "deliver ms", CLIENT_REFILL: "client refill ms", TRANSIT: "transit ms", INBOX: "inbox ms"}
ENGINE_COUNTERS = ["prefill_batches", "decode_steps", "mean_running", "prefill_time_s", "decode_time_s"]
METRICS = ["output_tok_per_s", "ttft.p50", "ttft.p95", "ttft.p99", "tpot.p50", "tpot.p95", "tpot.p99", "e2e.p50",
           "e2e.p95", "e2e.p99"]


@dataclass
class HttpLoadSpec:
    name: str = "http_load"
    repeats: int = 3
    model_name: str = "phaseserve-default"
    headline_concurrency: int = 32  # where the overhead goal (<= 10% of in-process throughput) is judged
    coalesced_interval: int = 4  # the http-coalesced arm's tokens per streamed event (<= 1: no such arm)
    timeout_s: float = 300.0  # one client run
    client_cpus: list[int] | None = None  # pin the client here and the server to the other CPUs (None: no pinning)
    frontend_cpus: list[int] | None = None  # the http-frontend arm: uvicorn's thread here (None: no such arm)
    loaded_control: bool = False  # the in-process-loaded arm (needs client_cpus)
    replay_control: bool = False  # the in-process-replay arm


# ---- the client process -----------------------------------------------------------------------------------
async def _one(client: Any, model: str, req: dict, sem: asyncio.Semaphore) -> dict:
    async with sem:
        sent = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=req["prompt"], max_tokens=req["max_tokens"], temperature=req["temperature"],
            seed=req["seed"], stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": req["ignore_eos"]})
        first = last = None
        tokens = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                first = first or now
                last = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
    return {"sent": sent, "end": end, "tokens": tokens, "ttft": None if first is None else first - sent,
            "tpot": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None, "e2e": end - sent}


async def _client_run(client: Any, model: str, reqs: list[dict], concurrency: int, built: list[float]) -> dict:
    """One closed-loop run; ``built`` collects the times the HTTP client finished building each request (its
    request hook: the request is built and about to be sent)."""
    sem = asyncio.Semaphore(concurrency)  # closed loop: a new request starts when one of `concurrency` ends
    cpu0 = _cpu_s()
    built.clear()
    recs = await asyncio.gather(*(_one(client, model, r, sem) for r in reqs))
    first_sent, last_end = min(r["sent"] for r in recs), max(r["end"] for r in recs)
    wall = last_end - first_sent
    out_tokens = sum(r["tokens"] for r in recs)
    return {"requests": len(recs), "output_tokens": out_tokens, "wall_s": wall, "output_tok_per_s": out_tokens / wall,
            "first_sent": first_sent, "last_end": last_end,
            BUILD: sorted(built)[min(concurrency, len(built)) - 1] - first_sent,
            "built": sorted(built), "ends": sorted(r["end"] for r in recs),
            "client_cpu_s": _cpu_s() - cpu0, **{k: percentiles([r[k] for r in recs]) for k in ("ttft", "tpot", "e2e")}}


def _cpu_s() -> float:
    """CPU seconds (user + system) this process has used, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu_s(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds run so far by this process's threads, summed per group (group -> native thread id); every other
    thread (XLA's worker pools, the main thread) under ``other``. Read from ``/proc/self/task/*/schedstat`` (ns)."""
    by_tid = {tid: g for g, tid in groups.items()}
    out = dict.fromkeys([*groups, "other"], 0.0)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        out[by_tid.get(int(tid), "other")] += ns * 1e-9
    return out


def pin_process(cpus: set[int]) -> None:
    """Restrict every thread of this process (and, by inheritance, the threads it starts later) to ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def split_cpus(client_cpus: list[int] | None) -> tuple[set[int], set[int]] | None:
    """(client CPUs, server CPUs) from ``experiment.client_cpus``: the server gets every other CPU this process may
    use; None without pinning. Raises ValueError when either side would be empty."""
    if not client_cpus:
        return None
    usable = os.sched_getaffinity(0)
    client = set(client_cpus)
    if not client <= usable or not usable - client:
        raise ValueError(f"experiment.client_cpus={sorted(client)} must be a proper subset of the usable CPUs "
                         f"{sorted(usable)} (the server keeps the rest)")
    return client, usable - client


def frontend_cpus(spec_cpus: list[int] | None) -> set[int] | None:
    """The CPUs of the HTTP thread from ``experiment.frontend_cpus`` (None: it stays on the server's). Raises
    ValueError for a CPU this process may not use."""
    if not spec_cpus:
        return None
    usable, front = os.sched_getaffinity(0), set(spec_cpus)
    if not front <= usable:
        raise ValueError(f"experiment.frontend_cpus={sorted(front)} must be among the usable CPUs {sorted(usable)}")
    return front


def busy(conn: Any, duty: float, slice_s: float = 0.002) -> dict:
    """Keep this process's CPU busy a ``duty`` fraction of the time, doing what the client does per event (parse a
    streamed completion chunk into the ``openai`` model, unvalidated as the client does), until a message arrives on
    ``conn``; returns the CPU and wall seconds it ran. Busy ``slice_s``, then asleep ``slice_s * (1 - duty) / duty``."""
    from openai.types import Completion

    chunk = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m", "usage": None,
                        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]})
    duty = min(max(duty, 0.01), 1.0)
    cpu0, t0 = _cpu_s(), time.perf_counter()
    while not conn.poll():
        end = time.perf_counter() + slice_s
        while time.perf_counter() < end:
            Completion.construct(**json.loads(chunk))  # as the client builds its chunks: no validation
        if duty < 1.0:
            time.sleep(slice_s * (1 - duty) / duty)
    conn.recv()
    return {"client_cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - t0}


def client_main(conn: Any, base_url: str, model: str, timeout_s: float, cpus: set[int] | None = None) -> None:
    """The client process: run each ``(requests, concurrency)`` job received on ``conn``, or a ``("busy", duty)``
    job (:func:`busy`, until the next message); ``None`` ends it. One ``AsyncOpenAI`` client (one connection pool,
    on one event loop) serves every job, as a load generator keeps its session: connections opened by one run (the
    untimed warm-up) are reused by the next. Its HTTP client is ``openai``'s default one with a request hook that
    records when each request is built (:data:`BUILD`)."""
    import openai

    if cpus:
        pin_process(cpus)
    aio = asyncio.new_event_loop()
    built: list[float] = []

    async def on_request(_) -> None:
        built.append(time.perf_counter())

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s,
                                http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request]}))
    try:
        while (job := conn.recv()) is not None:
            try:
                if job[0] == "busy":
                    conn.send(busy(conn, job[1]))
                    continue
                conn.send(aio.run_until_complete(_client_run(client, model, job[0], job[1], built)))
            except Exception as e:  # report, don't hang the parent
                conn.send(RuntimeError(f"client run failed: {e!r}"))
    finally:
        aio.run_until_complete(client.close())
        aio.close()


class Client:
    """A spawned client process driving the server (see :func:`client_main`)."""

    def __init__(self, base_url: str, model: str, timeout_s: float, cpus: set[int] | None = None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=client_main, args=(child, base_url, model, timeout_s, cpus), daemon=True)
        self.proc.start()

    def run(self, reqs: list[Request], concurrency: int) -> dict:
        self.conn.send(([{"prompt": list(r.prompt), "max_tokens": r.max_tokens, "temperature": r.temperature,
                          "seed": r.seed, "ignore_eos": r.ignore_eos} for r in reqs], concurrency))
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def start_busy(self, duty: float) -> None:
        """The client process keeps its CPUs busy ``duty`` of the time (:func:`busy`) until :meth:`stop_busy`."""
        self.conn.send(("busy", duty))

    def stop_busy(self) -> dict:
        self.conn.send("stop")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


# ---- the experiment ---------------------------------------------------------------------------------------
def _http_run(loop: Any, client: Client, engine: Engine, reqs: list[Request], c: int, interval: int = 1,
              pin: tuple[int, set[int], set[int]] | None = None) -> dict:
    """One HTTP run; ``pin`` = (uvicorn's thread id, its CPUs for this run, its CPUs after)."""
    def prepare(_):
        reset_engine(engine, max_batch=c)
        loop.stream_interval = interval

    loop.run_exclusive(prepare).result()
    if pin is not None:
        os.sched_setaffinity(pin[0], pin[1])
    try:
        rec = client.run(reqs, c)
    finally:
        if pin is not None:
            os.sched_setaffinity(pin[0], pin[2])
    outputs = loop.run_exclusive(lambda _: list(engine.outputs.values())).result()
    return rec | split_wall(rec, outputs) | engine_gaps(outputs, c, rec.pop("ends"), rec.pop("built")) | {
        "replay": replay_marks(outputs, c, rec["first_sent"])}


def replay_marks(outputs: list, c: int, first_sent: float) -> dict:
    """What :func:`replay` plays from an HTTP run at concurrency ``c``: ``first``, the server's first ``c`` receipts
    after the client's first send; ``later``, its ``(c + k)``-th receipt after the engine's ``k``-th finish."""
    received, finished = sorted(o.metrics.received for o in outputs), sorted(o.metrics.finished for o in outputs)
    return {"first": [t - first_sent for t in received[:c]],
            "later": [t - f for t, f in zip(received[c:], finished, strict=False)]}


def replay(engine: Engine, requests: list[Request], c: int, first: list[float], later: list[float]) -> dict:
    """The in-process closed loop at concurrency ``c`` with an HTTP run's arrivals at the server: the ``i``-th
    request of the first wave is due ``first[i]`` s after the start (an HTTP run: the server received it that long
    after the client's first send), and the one replacing the ``k``-th to finish ``later[k]`` s after that finish
    (the server received the ``(c + k)``-th that long after the engine's ``k``-th finish: back to the client, its
    next request, to the server's handler). Due requests are added before each step, as the server's engine loop
    reads its inbox. The engine's summary, as :func:`~lab.bench.workload.drive` returns it."""
    reset_engine(engine, max_batch=c)
    pending, outs, due = deque(requests), [], []
    m = engine.metrics
    m.start = start = time.perf_counter()
    for d in first[:c]:
        bisect.insort(due, start + d)
    replaced = 0
    while pending or engine.has_work:
        now = time.perf_counter()
        while due and due[0] <= now and pending:
            due.pop(0)
            outs.append(engine.add_request(pending.popleft()))
        if not engine.has_work:
            if not due:  # nothing due and nothing running: the rest can never come (a short `later`)
                raise RuntimeError(f"replay stalled with {len(pending)} requests pending")
            time.sleep(max(due[0] - now, 0.0))
            continue
        engine.step()
        ended = sorted(o.metrics.finished for o in outs if o.finished)[replaced:]
        for f in ended:
            if replaced < len(requests) - c:
                bisect.insort(due, f + later[min(replaced, len(later) - 1)])
            replaced += 1
    m.end = time.perf_counter()
    return engine.summary()


def engine_gaps(outputs: list, c: int, ends: list[float] | None = None, built: list[float] | None = None) -> dict:
    """A closed loop at concurrency ``c``: the fill (:data:`FILL`: the engine's first arrival to its ``c``-th, how
    long the first batch took to come in; in-process microseconds, the batch is added in one loop) and
    :func:`refill_parts` (its parts over HTTP, given the client's stream ends and requests built)."""
    arrivals = sorted(o.metrics.arrival for o in outputs)
    finished = sorted(o.metrics.finished for o in outputs)
    received = None if ends is None else sorted(o.metrics.received for o in outputs)
    return {FILL: arrivals[min(c, len(arrivals)) - 1] - arrivals[0],
            **refill_parts(c, finished, arrivals, None if ends is None else sorted(ends),
                           None if built is None else sorted(built), received)}


def refill_parts(c: int, finished: list[float], arrivals: list[float], ends: list[float] | None = None,
                 built: list[float] | None = None, received: list[float] | None = None) -> dict:
    """How long a slot freed by a finishing request stays empty in a closed loop at concurrency ``c`` (every list
    sorted): the ``k``-th request to finish frees the slot the ``(c + k)``-th takes, so the refill (:data:`REFILL`)
    is the engine's ``(c + k)``-th arrival minus its ``k``-th finish, a mean over the run's replacements
    (in-process, the rest of the step it finished in). Over HTTP (``ends``, ``built``, ``received`` given) it is
    split into :data:`PARTS`, means that add up to it: the ``k``-th finish to the client's ``k``-th stream end, to
    its ``(c + k)``-th request built, to the server's ``(c + k)``-th received, to the ``(c + k)``-th arrival. Zeros
    when every request was in the first ``c``."""
    n, http = len(finished) - c, ends is not None
    if n <= 0:
        return dict.fromkeys([REFILL, *PARTS] if http else [REFILL], 0.0)
    chain = [finished[:n], *([ends[:n], built[c:], received[c:]] if http else []), arrivals[c:]]
    gaps = [statistics.fmean(b - a for a, b in zip(x, y, strict=True)) for x, y in itertools.pairwise(chain)]
    return {REFILL: sum(gaps), **(dict(zip(PARTS, gaps, strict=True)) if http else {})}


def split_wall(rec: dict, outputs: list) -> dict:
    """The HTTP arm's wall time in three parts, on one clock (``time.perf_counter`` is the system-wide monotonic
    clock, shared by the client and server processes): ``ramp_s`` from the client's first send to the engine's
    first arrival (client request building, connection, HTTP parsing, handler, engine-loop inbox), ``engine_wall_s``
    from that arrival to the engine's last finish, ``tail_s`` from there to the client's last stream end; and
    ``engine_tok_per_s``, the run's tokens over ``engine_wall_s`` -- the throughput the engine's own clock sees,
    defined as the in-process arm's is."""
    arrival = min(o.metrics.arrival for o in outputs)
    finished = max(o.metrics.finished for o in outputs)
    engine_wall = finished - arrival
    return {"ramp_s": arrival - rec["first_sent"], "engine_wall_s": engine_wall, "tail_s": rec["last_end"] - finished,
            "engine_tok_per_s": sum(len(o.tokens) for o in outputs) / engine_wall}


def _engine_counters(engine: Engine) -> dict:
    """What the engine did during the last run (its metrics are reset at the start of each)."""
    m = engine.metrics
    return {"prefill_batches": m.prefill_batches, "decode_steps": m.decode_steps, "mean_running": m.mean_running,
            "prefill_time_s": m.prefill_time, "decode_time_s": m.decode_time}


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    from phaseserve.server import EngineBackend, EngineLoop, create_app
    from phaseserve.server.launch import http_stack, start_in_thread

    spec, out_dir = experiment_spec(cfg, HttpLoadSpec), Path(out_dir)
    if spec.loaded_control and not spec.client_cpus:
        raise ValueError("experiment.loaded_control needs experiment.client_cpus (the CPUs to keep busy)")
    cpus, front = split_cpus(spec.client_cpus), frontend_cpus(spec.frontend_cpus)
    usable = os.sched_getaffinity(0)  # given back to every thread at the end
    if cpus is not None:  # before JAX starts: XLA sizes its thread pools to the CPUs it may use
        pin_process(cpus[1])  # every server thread (engine loop, XLA workers, uvicorn) inherits it
    env = environment()
    engine = Engine.from_hydra(cfg)
    concs = concurrencies(cfg.workload)
    vocab = engine.cfg.vocab_size
    t0 = time.perf_counter()
    warmup(engine, cfg.workload, max(concs), vocab)
    log(f"engine built and warmed up in {time.perf_counter() - t0:.1f}s ({engine.num_pages} pages)")
    app = create_app(EngineBackend(engine), ByteTokenizer(), spec.model_name)
    server, thread, base = start_in_thread(app, keep_alive_s=spec.timeout_s)  # connections kept between runs
    loop: EngineLoop = app.state.loops[0]
    tids = {"engine_loop": loop.native_id, "http": thread.native_id}
    client = Client(base, spec.model_name, spec.timeout_s, None if cpus is None else cpus[0])
    arms = [a for a in ARMS if (a != "http-coalesced" or spec.coalesced_interval > 1)
            and (a != "http-frontend" or front is not None) and (a != LOADED or spec.loaded_control)
            and (a != REPLAY or spec.replay_control)]
    intervals = {"http": 1, "http-coalesced": spec.coalesced_interval, "http-frontend": 1}
    pins = {"http-frontend": (thread.native_id, front, os.sched_getaffinity(thread.native_id))} if front else {}
    records = []
    try:
        for c in concs:
            n = num_requests(cfg.workload, c)
            warm = make_requests(cfg.workload, vocab, n, seed=c, tag=f"warm{c}")
            warm_rec = _http_run(loop, client, engine, warm, c)  # untimed: the client, server, request paths warm
            duty = warm_rec["client_cpu_s"] / warm_rec["wall_s"]  # the loaded arm's, until an http run measures it
            marks = warm_rec["replay"]  # the replay arm's, likewise
            for rep in range(spec.repeats):
                reqs = make_requests(cfg.workload, vocab, n, seed=1000 * (rep + 1) + c, tag=f"c{c}r{rep}")
                for order, arm in enumerate(rotated(arms, rep + c)):
                    def timed(arm=arm, reqs=reqs, c=c, duty=duty, marks=marks) -> dict:
                        cpu0, threads0 = time.process_time(), thread_cpu_s(tids)
                        if arm in intervals:
                            rec = _http_run(loop, client, engine, reqs, c, intervals[arm], pins.get(arm))
                        else:
                            if arm == LOADED:
                                client.start_busy(duty)
                            try:
                                play = (lambda: replay(engine, reqs, c, **marks)) if arm == REPLAY else \
                                    (lambda: drive(engine, reqs, c, "closed"))
                                rec = loop.run_exclusive(lambda _: play() | engine_gaps(list(engine.outputs.values()),
                                                                                        c)).result()
                            finally:
                                load = client.stop_busy() if arm == LOADED else {}
                            rec |= {"ramp_s": 0.0, "engine_wall_s": rec["wall_s"], "tail_s": 0.0,
                                    "engine_tok_per_s": rec["output_tok_per_s"], "busy_duty": duty if load else 0.0,
                                    "client_cpu_s": load.get("client_cpu_s", 0.0)}
                        threads = thread_cpu_s(tids)
                        return rec | {"server_cpu_s": time.process_time() - cpu0,
                                      **{f"cpu_{g}_s": threads[g] - threads0[g] for g in THREADS}}

                    # a run during which JAX compiled (a prefill shape the warm-up missed) is run again
                    rec, reruns = compile_free(timed, f"concurrency {c} repeat {rep + 1} {arm}")
                    if arm == "http":  # the replay arm plays this run's arrivals next
                        marks = rec["replay"]
                    rec = {k: rec[k] for k in ("requests", "output_tokens", "wall_s", "output_tok_per_s", "ttft",
                                               "tpot", "e2e", "server_cpu_s", *(f"cpu_{g}_s" for g in THREADS))} | {
                        k: rec.get(k, 0.0) for k in ("client_cpu_s", *SPLIT, BUILD, FILL, REFILL, *PARTS,
                                            "busy_duty")}
                    rec.update(engine=_engine_counters(engine), arm=arm, point=c, repeat=rep, order=order,
                               reruns=reruns, load_1m=round(os.getloadavg()[0], 2))
                    records.append(rec)
                    if arm == "http":  # the loaded arm keeps the client's CPUs as busy as this run's client was
                        duty = rec["client_cpu_s"] / rec["wall_s"]
                    log(f"concurrency {c} repeat {rep + 1}/{spec.repeats} {arm}: {rec['output_tok_per_s']:.1f} tok/s, "
                        f"TTFT p50 {rec['ttft']['p50'] * 1e3:.0f} ms, TPOT p50 {rec['tpot']['p50'] * 1e3:.1f} ms")
    finally:
        client.close()
        server.should_exit = True
        thread.join(30)
        if cpus is not None:
            pin_process(usable)
    ratios = {arm: {m: paired(records, arm, "in-process", m) for m in ("output_tok_per_s", "engine_tok_per_s",
                                                                       "ttft.p50", "tpot.p50", "e2e.p50")}
              for arm in arms[1:]}
    over = {key: {m: paired(records, "http", arm, m) for m in ("output_tok_per_s", "engine_tok_per_s")}
            if arm in arms else None for arm, key in CONTROLS.items()}
    env["kernels"] = rp.kernel_rows(engine)
    results = {"experiment": "http_load", "environment": env,
               "settings": {"model": to_container(cfg.model), "quant": to_container(cfg.quant),
                            "cache": to_container(cfg.cache), "engine": to_container(cfg.engine),
                            "workload": to_container(cfg.workload), "repeats": spec.repeats,
                            "coalesced_interval": spec.coalesced_interval, "http_stack": http_stack(),
                            "loaded_control": spec.loaded_control, "replay_control": spec.replay_control,
                            "cpus": None if cpus is None else {"client": sorted(cpus[0]), "server": sorted(cpus[1])},
                            "frontend_cpus": None if front is None else sorted(front)},
               "records": records, "ratio_http_over_in_process": ratios, **over,
               "aggregate": aggregate(records, METRICS + ["server_cpu_s", *(f"cpu_{g}_s" for g in THREADS),
                                                        "client_cpu_s", "wall_s", *SPLIT, BUILD, FILL, REFILL,
                                                        *PARTS, "busy_duty"]
                                      + [f"engine.{k}" for k in ENGINE_COUNTERS]),
               "headline_concurrency": spec.headline_concurrency}
    rp.write_outputs(out_dir, cfg, results, markdown(results))
    for line in headline(results):
        log(line)
    return results


def headline(results: dict) -> list[str]:
    c = results["headline_concurrency"]
    lines = []
    for arm, by_metric in results["ratio_http_over_in_process"].items():
        tok = by_metric["output_tok_per_s"]
        r = tok.get(c) or tok.get(str(c))
        if not r or r.get("median") is None:
            lines.append(f"{arm}: no run at concurrency {c}: no headline")
            continue
        if arm == LOADED:
            d = results["aggregate"][arm]
            d = d.get(c) or d.get(str(c))
            lines.append(f"{arm} (the client's CPUs kept busy {d['busy_duty']['median']:.0%} of the time, as in the "
                         f"last http run, while the engine runs in-process): {r['median']:.3f}x in-process "
                         f"[{r['min']:.3f}, {r['max']:.3f}] at concurrency {c}: what the client's CPU use alone costs "
                         "the engine here")
            continue
        if arm == REPLAY:
            lines.append(f"{arm} (the engine in-process, its requests arriving when the last http run's server "
                         f"received them): {r['median']:.3f}x in-process [{r['min']:.3f}, {r['max']:.3f}] at "
                         f"concurrency {c}: what the HTTP run's arrival pattern alone costs the engine")
            continue
        verdict = "met" if r["median"] >= 0.9 else "NOT met"
        lines.append(f"{arm} throughput at concurrency {c}: {r['median']:.3f}x in-process (median of {r['n']} paired "
                     f"repeats, range {r['min']:.3f}..{r['max']:.3f}); overhead {(1 - r['median']) * 100:.1f}% -- goal "
                     f"<= 10%: {verdict}")
        e = by_metric.get("engine_tok_per_s", {})
        e = e.get(c) or e.get(str(c))
        a = results["aggregate"][arm]
        a = a.get(c) or a.get(str(c))
        if e and e.get("median") is not None and a:
            lines.append(f"  of which the server side (tokens over the engine's first arrival to last finish): "
                         f"{e['median']:.3f}x [{e['min']:.3f}, {e['max']:.3f}]; the client's ramp (first send to the "
                         f"engine's first arrival) {a['ramp_s']['median'] * 1e3:.0f} ms{_build_words(a, c)} and tail "
                         "(last finish to last "
                         f"stream end) {a['tail_s']['median'] * 1e3:.0f} ms per run (medians), of a "
                         f"{a['wall_s']['median']:.2f} s run")
    for arm, what in ((LOADED, "whose client CPUs are as busy"), (REPLAY, "whose requests arrive as the server "
                                                                         "received them")):
        over = (results.get(CONTROLS[arm]) or {}).get("output_tok_per_s", {})
        r = over.get(c) or over.get(str(c))
        if r and r.get("median") is not None:
            verdict = "met" if r["median"] >= 0.9 else "NOT met"
            lines.append(f"http over {arm} at concurrency {c}: {r['median']:.3f}x (median of {r['n']} paired repeats, "
                         f"range {r['min']:.3f}..{r['max']:.3f}): against a control {what}, the overhead is "
                         f"{(1 - r['median']) * 100:.1f}% -- goal <= 10% against that control: {verdict}")
    return lines


def _build_words(agg: dict, c: int) -> str:
    if BUILD not in agg:  # older results
        return ""
    return f" (its first send to its {c}-th request built: {agg[BUILD]['median'] * 1e3:.0f} ms)"


CONTROL_WORDS = {
    LOADED: "whose client CPUs are kept as busy as the http arm's client kept them (parsing completion chunks into the "
            "openai model, the duty cycle of the last http run: `busy_duty` in results.json)",
    REPLAY: "whose requests arrive when the last http run's server received them (the first wave at its offsets from "
            "the client's first send, each replacement that long after the finish it replaces: the way back to the "
            "client, its next request and the way to the server's handler, which include the server writing a "
            "stream's last event and reading the next request): what remains is the rest of the server's cost"}


def _loaded_section(results: dict, points: list) -> list[str]:
    out = []
    for arm, key in CONTROLS.items():
        over = results.get(key)
        if not over:
            continue
        rows = [[c, *(rp.spread(over[m].get(c) or over[m].get(str(c))) for m in over)] for c in points]
        out += [f"## http / {arm} (paired per repeat): the HTTP overhead against an in-process run "
                f"{CONTROL_WORDS[arm]}",
                rp.markdown_table(["concurrency", *(f"{m} ratio" for m in over)], rows)]
    return out


def _cpus_line(cpus: dict | None) -> str:
    if not cpus:
        return "CPUs: not pinned (the client process, uvicorn and the engine share every core)."
    return (f"CPUs: the client process pinned to {cpus['client']}, every server thread (engine, XLA workers, uvicorn) "
            f"to {cpus['server']} (before JAX started: XLA's worker pools are sized to them), in every arm (the "
            "in-process arm runs on the same cores as the server): the client stands in for one on another machine.")


def _frontend_words(settings: dict) -> str:
    front = settings.get("frontend_cpus")
    if not front:
        return ""
    return (f"; `http-frontend` streams every token with uvicorn's thread moved to CPUs {front} for the run (the "
            "engine loop and XLA keep theirs): the HTTP frontend on a host core of its own, as on an accelerator "
            "server, where it does not take the engine's compute")


def _stack_line(stack: dict | None) -> str:
    if not stack:
        return "its defaults (not recorded)"
    return f"the {stack['loop']} event loop and the {stack['http']} parser"


def markdown(results: dict) -> str:
    agg, ratios = results["aggregate"], results["ratio_http_over_in_process"]
    points = sorted({rec["point"] for rec in results["records"]})
    arms = [a for a in ARMS if a in agg]
    s = results["settings"]
    rows, where = [], []
    split = f"cpu_{THREADS[0]}_s" in next(iter(agg[arms[0]].values()))  # older runs: one server CPU column
    threads_cols = ["engine-loop thread CPU s", "uvicorn thread CPU s", "other threads CPU s"] if split else []
    cpu_cols = ["wall_s", "server_cpu_s", *(f"cpu_{g}_s" for g in THREADS if split), "client_cpu_s"]
    first = next(iter(agg[arms[0]].values()))
    ms_cols = [m for m in MS_COLS if m in first]  # older results lack the later columns
    for c in points:
        for arm in arms:
            a = agg[arm][c]
            rows.append([c, arm, rp.spread(a["output_tok_per_s"]),
                         *(rp.spread({k: (v * 1e3 if isinstance(v, float) else v) for k, v in a[m].items()})
                           for m in METRICS[1:])])
            where.append([c, arm, *(rp.spread(a[m]) for m in cpu_cols),
                          *(rp.spread({k: v * 1e3 if isinstance(v, float) else v for k, v in a[m].items()})
                            for m in ms_cols),
                          *(rp.spread(a[f"engine.{k}"]) for k in ENGINE_COUNTERS)])
    ratio_rows = [[c, arm, *(rp.spread(by_metric[m][c]) for m in by_metric)] for arm, by_metric in ratios.items()
                  for c in points]
    w = s["workload"]
    return "\n\n".join([
        "# HTTP server under load: the official openai client against the same engine in-process",
        "\n".join(headline(results)),
        f"Workload: prompts {w['prompt']}, outputs {w['output']}, closed loop, {w['waves']} waves per client; "
        f"engine {s['engine']['mode']}, quant {s['quant']}, cache {s['cache']}. Medians over "
        f"{s['repeats']} repeats [min, max]; times in ms. Client numbers are measured by an `AsyncOpenAI` client "
        "in its own process (streamed completions); in-process numbers by the engine's own clock on the same "
        "requests, run by the server's engine loop between HTTP runs. `http` streams every token as an event, "
        f"`http-coalesced` one event per {s.get('coalesced_interval')} tokens{_frontend_words(s)}. Timed runs "
        "repeated because JAX "
        f"compiled inside them: {sum(r.get('reruns', 0) for r in results['records'])}. {_cpus_line(s.get('cpus'))} "
        f"Server: uvicorn with {_stack_line(s.get('http_stack'))}.",
        rp.markdown_table(["concurrency", "arm", "tok/s", "TTFT p50", "TTFT p95", "TTFT p99", "TPOT p50", "TPOT p95",
                           "TPOT p99", "e2e p50", "e2e p95", "e2e p99"], rows),
        "## HTTP / in-process (paired per repeat; tok/s below 1 and times above 1 are the HTTP overhead)",
        rp.markdown_table(["concurrency", "arm", *(f"{m} ratio" for m in next(iter(ratios.values())))], ratio_rows),
        *_loaded_section(results, points),
        "## Where the time goes (per run, medians [min, max]; CPU seconds of the server process -- engine, XLA "
        "threads, HTTP -- split by thread (the engine loop, which runs the in-process arm too; uvicorn's; every other "
        "thread, XLA's worker pools among them), and of the client process; the client's ramp (its first send to the "
        "engine's first arrival), the client's build (its first send to its concurrency-th request built, by its HTTP "
        "client's request hook) and tail (the engine's last finish to the client's last stream end), on the clock "
        "both processes share; the fill: the engine's first arrival to its concurrency-th, i.e. how long the first "
        "batch took to come in; the refill: from the engine's k-th finish to its (concurrency + k)-th arrival, i.e. "
        "how long a slot freed by a finishing request stayed empty until its replacement came in (a mean over the "
        "run's replacements; in-process, the rest of the step it finished in), over HTTP in four parts that add up to "
        "it (means): deliver, the k-th finish to the client's k-th stream end; client refill, to its (concurrency + "
        "k)-th request built; transit, to the server's (concurrency + k)-th received (its handler queued it for the "
        "engine loop); inbox, to the engine's (concurrency + k)-th arrival (the loop reads its inbox between steps); "
        "engine's counters; seconds inside prefill / decode calls)",
        rp.markdown_table(["concurrency", "arm", "wall s", "server CPU s", *threads_cols, "client CPU s",
                           *(MS_COLS[m] for m in ms_cols), *ENGINE_COUNTERS], where),
        rp.environment_section(results["environment"]),
    ])
