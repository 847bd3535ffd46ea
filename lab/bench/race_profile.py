"""Where phaseserve's milliseconds go under ``vllm bench serve`` (issue 44): the server in this process, its engine
loop's phases timed, at each concurrency of the vllm_race experiment (``experiment.profile=true``).

The server is built as ``python -m phaseserve.server`` builds it (``configs/server.yaml`` with the experiment's
``phaseserve_overrides`` and the generated checkpoint) and served by uvicorn in a thread of this process; ``vllm
bench serve`` (its own process) drives it exactly as in the comparison. :class:`Timers` wraps, on the live instances
only (no library code changes), the engine loop's phases: draining the HTTP inbox (``drain``, which includes the
loop's blocking wait while idle), ``schedule`` and ``plan_chunks`` (the scheduler), a prefix hit's cached pages copied
into the prefill pool (``prefix.load``), the prefill launch (``prefill.launch``: padding to a bucket, dispatching the
jitted forward to the prefill device, that call alone also as ``prefill.dispatch``), its collection
(``prefill.collect``: the wait for its result where the step had to wait, the first tokens back to the host, the
bookkeeping; its calls that collected nothing count toward the time but not the p50) and the handoff of its KV to the
decode pool inside it (``handoff``, reported apart from ``prefill.collect``), the decode step (``decode.step``: building
the batch, the jitted step, the tokens back to the host), the rest of ``Engine.step`` (emitting tokens, finishing
requests), handing tokens to the HTTP handlers (``deliver``) and the ``/metrics`` gauges (``on_step``). Per level it
reports each phase's milliseconds per engine step and its share of the loop thread's wall time, the CPU seconds of the
loop thread, of uvicorn's thread and of every other thread (XLA's pools), and per request the wait in the inbox
(received -> arrival), the engine's TTFT (arrival -> first token) beside the server's (:class:`HttpTimes`: HTTP
request in -> first streamed chunk out) and the client's (send -> first streamed chunk), and per prefill launch the
time from its launch until its tokens are ready on the device (seen by a thread waiting on them) and until its
results are handled (the chunk step's compute, the wait for the engine step that collects it, the handoff and the
first tokens emitted) and the prompt chunks it carried.
With engine replicas (``mesh.replicas``) every replica's loop is instrumented: phases are summed over the replicas
(per step of any replica; shares of the wall time can then pass 1), ``decode_rows_mean`` is per replica's step, and
``engine_loop`` CPU sums their threads.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from lab.bench import report as rp
from lab.bench.http_load import thread_cpu_s

PHASES = ("drain", "schedule", "plan_chunks", "prefix.load", "prefill.launch", "prefill.collect", "handoff",
          "decode.step", "deliver", "on_step")


class HttpTimes:
    """A pure ASGI middleware around the served app: per HTTP request, when its ASGI call came in and when the server
    handed its first non-empty response body (the first streamed chunk) to uvicorn: the server's own TTFT, which
    with the engine's (arrival -> first token) and the client's splits a first token's time between the client, the
    HTTP side before the engine and after it, and the engine."""

    def __init__(self, app: Any, spans: list):
        self.app, self.spans = app, spans

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or not scope.get("path", "").endswith("/completions"):
            return await self.app(scope, receive, send)
        t0, first = time.perf_counter(), []

        async def timed_send(message):
            if not first and message.get("type") == "http.response.body" and message.get("body"):
                first.append(time.perf_counter())
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            if first:
                self.spans.append((t0, first[0]))


class Timers:
    """Wall seconds and calls per phase; :meth:`wrap` times one method of one live object."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.durations: dict[str, list[float]] = {}
        self.rows = 0  # decode rows over every decode step
        self.launches: dict[int, tuple[float, int]] = {}  # prefill launch -> (start, chunks), until collected
        self.in_flight: list[tuple[float, int]] = []  # (launch -> results handled seconds, chunks) per launch
        self.computed: list[float] = []  # launch -> its sampled tokens ready on the device, seconds per launch
        self.joined: set[int] = set()  # ids of the metrics of requests whose last prompt token ran as a decode row
        self.events: list[tuple[str, float, float, bool]] = []  # (phase, start, seconds, in the p50) per call

    def wrap(self, obj: Any, attr: str, name: str, counts: Any = None) -> None:
        """Time ``obj.attr`` as phase ``name``; ``counts(result)`` false: the call's time counts, not its duration
        in the phase's p50."""
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0, out = time.perf_counter(), None
            try:
                out = fn(*a, **kw)
                return out
            finally:
                self.events.append((name, t0, time.perf_counter() - t0, counts is None or bool(counts(out))))

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.events, self.rows, self.in_flight, self.computed = [], 0, [], []
        self.joined = set()

    def clip(self, start: float, end: float) -> None:
        """Totals, calls and durations of the calls that overlap ``[start, end]``, each total cut to it (the idle
        wait before the first request and after the last is not the server's time)."""
        self.seconds, self.calls, self.durations = {}, {}, {}
        for name, t0, dt, counted in self.events:
            a, b = max(t0, start), min(t0 + dt, end)
            if b <= a and not start <= t0 <= end:
                continue
            self.seconds[name] = self.seconds.get(name, 0.0) + max(b - a, 0.0)
            self.calls[name] = self.calls.get(name, 0) + 1
            if counted:
                self.durations.setdefault(name, []).append(dt)


def instrument(loop: Any, timers: Timers, finished: list) -> None:
    """Wrap the loop's and its engine's phases (see the module docstring); finished requests' metrics go to
    ``finished``."""
    engine = loop.backend.engine
    timers.wrap(loop, "_drain", "drain")
    timers.wrap(loop, "_deliver", "deliver")
    if loop.on_step is not None:
        timers.wrap(loop, "on_step", "on_step")
    timers.wrap(engine, "step", "step")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "plan_chunks", "plan_chunks")
    timers.wrap(engine, "_launch_prefill", "prefill.launch")
    timers.wrap(engine, "_collect_prefill", "prefill.collect", counts=bool)
    timers.wrap(engine, "_hand_off", "handoff")
    timers.wrap(engine, "_load_prefixes", "prefix.load")
    load = engine._load_prefixes
    engine._load_prefixes = lambda seqs: load(seqs) if seqs else None  # timed when a hit's pages are copied
    timers.wrap(engine.prefill, "dispatch", "prefill.dispatch")
    step = engine.decode.step

    def counted(rows, *a, **kw):
        timers.rows += len(rows)
        return step(rows, *a, **kw)

    engine.decode.step = counted
    timers.wrap(engine.decode, "step", "decode.step")
    launch, collect = engine._launch, engine._finish_prefill

    def launched(group, *a, **kw):
        t0 = time.perf_counter()
        f = launch(group, *a, **kw)
        timers.launches[id(f)] = (t0, len(group))
        first = f.launched.first
        if isinstance(first, jax.Array):  # when the device finished it, seen from a waiting thread (GIL released)
            threading.Thread(target=lambda: (first.block_until_ready(),
                                             timers.computed.append(time.perf_counter() - t0)), daemon=True).start()
        return f

    def collected(f, *a, **kw):
        t0, n = timers.launches.pop(id(f), (None, 0))
        try:
            return collect(f, *a, **kw)
        finally:
            if t0 is not None:
                timers.in_flight.append((time.perf_counter() - t0, n))

    engine._launch, engine._finish_prefill = launched, collected
    finish = engine._finish

    def on_finish(seq, reason, error=None):
        finish(seq, reason, error)
        finished.append(seq.output.metrics)

    engine._finish = on_finish
    join = engine._join_hit_suffixes

    def joined():  # which requests' last prompt token ran as a decode row (not rows handed off, also joining)
        before = set(engine._joining)
        join()
        timers.joined.update(id(engine._seqs[i].output.metrics) for i in engine._joining - before if i in engine._seqs)

    engine._join_hit_suffixes = joined


def compiles(engine: Any) -> dict[str, int]:
    """The engine's step executables compiled so far, by phase and where (``engine.compiled.ShapeCache`` stats:
    ``background``, ``inline``), and the calls run on a larger compiled shape (``cover``)."""
    return {f"{phase} {k}": int(getattr(engine, phase).steps.stats.get(k, 0)) for phase in ("prefill", "decode")
            for k in ("background", "inline", "cover", "cover_at_limit")}


def lookahead(loops: list) -> dict[str, int]:
    """Decode steps launched ahead so far over the replicas: ``used`` (the next step had exactly its inputs) and
    ``dropped``."""
    stats = [loop.backend.engine.decode.lookahead_stats for loop in loops]
    return {k: sum(int(s.get(k, 0)) for s in stats) for k in ("used", "dropped")}


def loop_cpu_s(threads: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of the engine loops' threads (summed as ``engine_loop``), uvicorn's and every other
    thread's (:func:`~lab.bench.http_load.thread_cpu_s`)."""
    cpu = thread_cpu_s(threads)
    loops = sum(v for k, v in cpu.items() if k.startswith("engine_loop_"))
    return {"engine_loop": loops, **{k: v for k, v in cpu.items() if not k.startswith("engine_loop_")}}


def level_profile(timers: Timers, finished: list, wall_s: float, cpu: dict[str, float], bench: dict,
                  spans: list[tuple[float, float]] = ()) -> dict:
    """One concurrency's numbers (see the module docstring); ``spans``: :class:`HttpTimes`' per request."""
    steps = timers.calls.get("step", 0)
    step_s = timers.seconds.get("step", 0.0)
    inner = {p: timers.seconds.get(p, 0.0) for p in ("schedule", "plan_chunks", "prefix.load", "prefill.launch",
                                                     "prefill.collect",
                                                     "decode.step")}  # handoff runs inside prefill.collect
    phases = {**{p: timers.seconds.get(p, 0.0) for p in PHASES}, "step (rest)": step_s - sum(inner.values())}
    phases["prefill.collect"] -= phases["handoff"]
    phases["loop (rest)"] = wall_s - sum(phases.values())
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else None  # noqa: E731
    ttft = [m.ttft for m in finished if m.ttft is not None]
    inbox = [m.arrival - m.received for m in finished if m.received is not None]
    queue = [m.admitted - m.arrival for m in finished if m.admitted is not None]
    by_path = {k: [m.ttft for m in finished if m.ttft is not None and (id(m) in timers.joined) == (k == "decode_row")]
               for k in ("decode_row", "prefill")}
    return {
        "wall_s": wall_s, "steps": steps, "requests": len(finished),
        "phases_ms_per_step": {p: 1e3 * s / max(steps, 1) for p, s in phases.items()},
        "phases_share": {p: s / wall_s for p, s in phases.items()},
        "calls": dict(timers.calls),
        "step_ms_p50": ms(timers.durations.get("step", [])),
        "prefill_launch_ms_p50": ms(timers.durations.get("prefill.launch", [])),
        "prefill_dispatch_ms_p50": ms(timers.durations.get("prefill.dispatch", [])),  # inside prefill.launch
        "prefix_load_ms_p50": ms(timers.durations.get("prefix.load", [])),
        "prefill_collect_ms_p50": ms(timers.durations.get("prefill.collect", [])),
        "decode_step_ms_p50": ms(timers.durations.get("decode.step", [])),
        "decode_rows_mean": timers.rows / max(timers.calls.get("decode.step", 0), 1),
        "prefill_in_flight_ms_p50": ms([s for s, _ in timers.in_flight]),  # launch -> first tokens emitted
        "prefill_computed_ms_p50": ms(timers.computed),  # launch -> its tokens ready on the device
        "prefill_chunks_per_launch": sum(n for _, n in timers.in_flight) / max(len(timers.in_flight), 1),
        "inbox_wait_ms_p50": ms(inbox), "queue_wait_ms_p50": ms(queue), "engine_ttft_ms_p50": ms(ttft),
        "requests_last_token_decode_row": len(by_path["decode_row"]),
        "engine_ttft_decode_row_ms_p50": ms(by_path["decode_row"]),
        "engine_ttft_prefilled_ms_p50": ms(by_path["prefill"]),
        "server_ttft_ms_p50": ms([b - a for a, b in spans]),  # ASGI call in -> first streamed chunk out
        "engine_ttft_ms_p99": 1e3 * float(np.percentile(ttft, 99)) if ttft else None,
        "client_ttft_ms_p50": bench["ttft_p50_ms"], "client_ttft_ms_mean": bench.get("ttft_mean_ms"),
        "client_ttft_ms_p99": bench.get("ttft_p99_ms"), "client_tpot_ms_p50": bench["tpot_p50_ms"],
        "output_tok_per_s": bench["output_tok_per_s"],
        "cpu_s": cpu, "cpu_share_of_wall": {k: v / wall_s for k, v in cpu.items()},
        "timeline": request_timeline(finished, timers.joined),
    }


def request_timeline(finished: list, joined: set[int] = frozenset()) -> list[dict]:
    """Each request's times (ms from the level's first request in): into the HTTP inbox, into the engine, admitted,
    first token, finished; its prompt tokens served from the prefix cache, and whether its last prompt token ran as a
    decode row (``joined``: ids of those requests' metrics)."""
    if not finished:
        return []
    t0 = min(m.received if m.received is not None else m.arrival for m in finished)
    ms = lambda t: None if t is None else round(1e3 * (t - t0), 2)  # noqa: E731
    return [{"received": ms(m.received), "arrival": ms(m.arrival), "admitted": ms(m.admitted),
             "first_token": ms(m.first_token), "finished": ms(m.finished), "prefix_hit_tokens": m.prefix_hit_tokens,
             "decode_row": id(m) in joined}
            for m in sorted(finished, key=lambda m: m.arrival)]


def run(spec: Any, ckpt: Path, name: str, out_dir: Path, log=print, passes: int = 2) -> dict:
    """Serve ``ckpt`` in-process, instrumented; ``vllm bench serve`` at each concurrency: pass 0 as the comparison
    runs it (an untimed warm-up run at the level, then the timed one: shapes not met in the warm-up compile inside
    it), then ``passes - 1`` more timed passes over the levels with every shape met before already compiled.
    Returns and writes ``profile.json`` and ``profile.md`` into ``out_dir``."""
    from lab.bench import vllm_race as vr
    from lab.bench.schema import setup_jax
    from phaseserve.server.app import create_app
    from phaseserve.server.launch import build_backend, compose, replica_fill, start_in_thread, tokenizer_of, warm_up

    overrides = [f"model.checkpoint={ckpt}", f"model.name={name}", f"experiment.model_name={name}",
                 *spec.phaseserve_overrides]
    cfg = compose(overrides)
    setup_jax(cfg)
    tok = tokenizer_of(cfg)
    backend = build_backend(cfg)
    warm_up(backend if isinstance(backend, list) else [backend], str(cfg.experiment.get("warmup", "auto")))  # as serve
    app = create_app(backend, tok, name, stream_interval=int(cfg.experiment.stream_interval),
                     replica_fill=replica_fill(cfg))
    spans: list[tuple[float, float]] = []  # (ASGI call in, first body out) per completions request
    app.add_middleware(HttpTimes, spans=spans)
    server, thread, url = start_in_thread(app, port=spec.port_phaseserve, keep_alive_s=600.0)
    timers, finished, levels = Timers(), [], {}
    try:
        loops = app.state.loops  # one per engine replica: every one instrumented, their phases summed
        for loop in loops:
            instrument(loop, timers, finished)
        threads = {f"engine_loop_{i}": loop.native_id for i, loop in enumerate(loops)}
        threads["uvicorn"] = thread.native_id
        engine = loops[0].backend.engine  # compile counts: the first replica's (replicas may share its steps)
        for pass_ in range(passes):
            for c in spec.concurrency:
                n = int(spec.prompts.get(str(c), 4 * c))
                if pass_ == 0:
                    vr.warm(spec, url, name, ckpt, c, out_dir / "raw" / f"profile_c{c}_warmup.json")
                timers.reset()
                finished.clear()
                spans.clear()
                cpu0 = loop_cpu_s(threads)
                comp0, ahead0 = compiles(engine), lookahead(loops)
                bench = vr.bench_once(spec, url, name, ckpt, c, n, spec.seed + pass_,
                                      out_dir / "raw" / f"profile_p{pass_}_c{c}.json")
                cpu1 = loop_cpu_s(threads)
                start = min(m.received if m.received is not None else m.arrival for m in finished)
                end = max(m.finished for m in finished)
                timers.clip(start, end)
                cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
                lv = level_profile(timers, finished, end - start, cpu, bench, spans)
                lv["compiles"] = {k: v - comp0.get(k, 0) for k, v in compiles(engine).items()}
                lv["lookahead"] = {k: v - ahead0[k] for k, v in lookahead(loops).items()}
                levels.setdefault(pass_, {})[c] = lv
                log(f"[profile] pass {pass_} c={c}: {bench['output_tok_per_s']:.0f} tok/s, {lv['steps']} steps, "
                    f"step p50 {lv['step_ms_p50']:.2f} ms, decode.step p50 {lv['decode_step_ms_p50']:.2f} ms")
    finally:
        server.should_exit = True
        thread.join(30)
    result = {"model": name, "checkpoint": str(ckpt), "overrides": list(spec.phaseserve_overrides),
              "levels": levels, "cpu_count": os.cpu_count()}
    rp.write_json(out_dir / "profile.json", result)
    (out_dir / "profile.md").write_text("\n\n".join(f"### pass {p}\n\n{markdown(lv)}" for p, lv in levels.items())
                                        + "\n")
    return result


def markdown(levels: dict) -> str:
    """One pass's tables."""
    cs = sorted(levels, key=int)
    rows = []
    names = list(next(iter(levels.values()))["phases_ms_per_step"])
    for p in names:
        rows.append([p, *[f"{levels[c]['phases_ms_per_step'][p]:.3f} ({100 * levels[c]['phases_share'][p]:.0f}%)"
                          for c in cs]])
    lines = ["| phase (ms per engine step, share of wall) | " + " | ".join(f"c={c}" for c in cs) + " |",
             "|---|" + "---|" * len(cs), *["| " + " | ".join(map(str, r)) + " |" for r in rows], ""]
    keys = [("output tok/s (client)", "output_tok_per_s", "{:.0f}"), ("engine steps", "steps", "{}"),
            ("requests", "requests", "{}"), ("decode rows per step (mean)", "decode_rows_mean", "{:.1f}"),
            ("step p50 ms", "step_ms_p50", "{:.2f}"), ("prefill.launch p50 ms", "prefill_launch_ms_p50", "{:.2f}"),
            ("prefill.dispatch p50 ms (the jitted call, inside prefill.launch)", "prefill_dispatch_ms_p50", "{:.2f}"),
            ("prefix.load p50 ms (a hit's pages to the prefill pool)", "prefix_load_ms_p50", "{:.2f}"),
            ("prefill.collect p50 ms (calls that collected)", "prefill_collect_ms_p50", "{:.2f}"),
            ("prefill launch -> first tokens emitted p50 ms", "prefill_in_flight_ms_p50", "{:.1f}"),
            ("prefill launch -> tokens ready on the device p50 ms", "prefill_computed_ms_p50", "{:.1f}"),
            ("prompt chunks per prefill launch (mean)", "prefill_chunks_per_launch", "{:.2f}"),
            ("decode.step p50 ms", "decode_step_ms_p50", "{:.2f}"), ("inbox wait p50 ms", "inbox_wait_ms_p50",
                                                                     "{:.2f}"),
            ("queue wait p50 ms (arrival -> admitted)", "queue_wait_ms_p50", "{:.2f}"),
            ("engine TTFT p50 ms (arrival -> first token)", "engine_ttft_ms_p50", "{:.1f}"),
            ("requests whose last prompt token ran as a decode row", "requests_last_token_decode_row", "{}"),
            ("engine TTFT p50 ms, those requests", "engine_ttft_decode_row_ms_p50", "{:.1f}"),
            ("engine TTFT p50 ms, the prefilled ones", "engine_ttft_prefilled_ms_p50", "{:.1f}"),
            ("engine TTFT p99 ms", "engine_ttft_ms_p99", "{:.1f}"),
            ("server TTFT p50 ms (HTTP request in -> first chunk out)", "server_ttft_ms_p50", "{:.1f}"),
            ("client TTFT p50 ms (vllm bench)", "client_ttft_ms_p50", "{:.1f}"),
            ("client TTFT mean ms", "client_ttft_ms_mean", "{:.1f}"),
            ("client TTFT p99 ms", "client_ttft_ms_p99", "{:.1f}"),
            ("client TPOT p50 ms (vllm bench)", "client_tpot_ms_p50", "{:.2f}")]
    lines += ["| per level | " + " | ".join(f"c={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    for label, k, f in keys:
        lines.append(f"| {label} | " + " | ".join("–" if levels[c].get(k) is None else f.format(levels[c][k])
                                                   for c in cs) + " |")
    for k in ("used", "dropped"):
        lines.append(f"| decode steps launched ahead, {k} | " + " | ".join(
            str(levels[c].get("lookahead", {}).get(k, "–")) for c in cs) + " |")
    for k in next(iter(levels.values())).get("compiles", {}):
        lines.append(f"| {k} | " + " | ".join(str(levels[c].get("compiles", {}).get(k, "–")) for c in cs) + " |")
    for thr in ("engine_loop", "uvicorn", "other"):
        lines.append(f"| CPU s / span s: {thr} | " + " | ".join(f"{levels[c]['cpu_share_of_wall'][thr]:.2f}"
                                                                for c in cs) + " |")
    return "\n".join(lines)
