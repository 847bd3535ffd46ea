"""Reliability soak of the HTTP server: sustained mixed load for a bounded time, then memory, pages and health.

The server (:func:`phaseserve.server.create_app` over an in-process :class:`~phaseserve.server.EngineBackend`,
uvicorn in a thread of this process, API keys on) takes ``concurrency`` client threads (stdlib ``http.client``, in
this process) for ``seconds``, each drawing its next request from ``mix``:

- ``good``: a completion (non-streamed) or a streamed chat completion read to ``[DONE]``; prompts from a few
  templates with shared prefixes (prefix-cache hits), two tenants; expected 200;
- ``bad``: one client mistake from :data:`BAD` (malformed JSON, a lone surrogate, a parameter out of range, a token
  outside the vocabulary, a prompt beyond the context, an unknown model / route, a wrong method, no or a wrong API
  key); expected its 4xx in OpenAI's error shape;
- ``cancelled``: a long streamed completion whose client reads a few events and then closes the connection;
- ``duplicate``: the same request id submitted twice at once to the engine loop (HTTP clients cannot choose ids:
  this is what a second frontend or a retrying gateway would do); expected: one served, the other a typed
  ``DuplicateRequestError``; plus the same HTTP body sent twice at once (two requests, both 200);
- ``oversized``: a body over ``max_body_bytes``, with ``Content-Length`` or chunked; expected 413.

After ``warmup_seconds`` of load the baseline RSS is taken; the process's RSS, the engine's pages in use and the
requests in flight are sampled every ``sample_s``. When the load stops the server drains, and the run checks:
RSS growth since the baseline under ``rss_growth_limit_mib``, every page free and ``check_invariants()`` clean
(run in the engine-loop thread), no request left in flight, ``/health`` 200, the engine's finished outputs within
their bound, and every response of the expected status and error code (``unexpected`` lists the others).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import http.client
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import environment
from lab.bench.schema import experiment_spec
from lab.bench.workload import reset_engine
from phaseserve.engine import Engine, Request
from phaseserve.engine.request import DuplicateRequestError
from phaseserve.server import EngineBackend, create_app
from phaseserve.server.launch import start_in_thread, tokenizer_of

PLOT = "rss.png"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
MODEL = "phaseserve-default"
PROMPTS = ["def add(a, b):\n    return", "def add(a, b):\n    # add two numbers\n", "import os\nimport sys\n",
           "class Stack:\n    def push(self, x):", "What are 12 EUR worth in yen?", "Write a haiku about pages."]


def _completion(prompt: Any, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


# (name, method, path, body (dict -> JSON, bytes raw, None), key, expected status, expected error code -- or the
# typed error a 400 names -- or None: any)
BAD: list[tuple[str, str, str, Any, str | None, int, str | None]] = [
    ("malformed JSON", "POST", "/v1/completions", b'{"prompt": "ab", ', "key-a", 400, None),
    ("lone surrogate", "POST", "/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 2}', "key-a", 400, None),
    ("max_tokens out of range", "POST", "/v1/completions", _completion("hi", -1), "key-a", 400, None),
    ("token outside the vocabulary", "POST", "/v1/completions", _completion([1, 10**6], 2), "key-a", 400,
     "InvalidTokenError"),
    ("prompt beyond the context", "POST", "/v1/completions", _completion("x" * 5000, 2), "key-b", 400,
     "context_length_exceeded"),
    ("unknown model", "POST", "/v1/completions", {**_completion("hi", 2), "model": "gpt-9"}, "key-a", 404,
     "model_not_found"),
    ("unknown route", "GET", "/v1/nothing", None, "key-a", 404, "not_found"),
    ("wrong method", "GET", "/v1/completions", None, "key-a", 405, "method_not_allowed"),
    ("no API key", "POST", "/v1/completions", _completion("hi", 2), None, 401, "invalid_api_key"),
    ("wrong API key", "POST", "/v1/completions", _completion("hi", 2), "key-z", 401, "invalid_api_key"),
]


@dataclass
class ReliabilitySpec:
    name: str = "reliability"
    seconds: float = 180.0  # sustained load
    warmup_seconds: float = 15.0  # load before the baseline RSS is taken (compilation, caches, pools warm)
    concurrency: int = 8  # client threads
    mix: dict[str, float] = field(default_factory=lambda: {"good": 0.4, "bad": 0.25, "cancelled": 0.15,
                                                           "duplicate": 0.1, "oversized": 0.1})
    max_tokens: list[int] = field(default_factory=lambda: [1, 16])  # good requests, uniform inclusive
    cancel_after_events: list[int] = field(default_factory=lambda: [1, 4])  # a cancelled stream's events read
    cancel_max_tokens: int = 200  # a cancelled stream's max_tokens (its pages are reserved for all of them)
    max_body_bytes: int = 65536
    max_in_flight: int = 64
    keep_finished: int = 256  # the engine's finished outputs kept (Engine.keep_finished)
    rss_growth_limit_mib: float = 64.0
    sample_s: float = 0.5
    drain_timeout_s: float = 60.0
    seed: int = 0


class Client:
    """One client thread's requests; every response is tallied as (kind, case, status, code) and checked."""

    def __init__(self, port: int, spec: ReliabilitySpec, loop: Any, seed: int, deadline: float):
        self.port, self.spec, self.loop, self.deadline = port, spec, loop, deadline
        self.rng = random.Random(seed)
        self.tally: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []
        self.latency_s: list[float] = []

    # ---- plumbing -------------------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def _send(self, conn, method: str, path: str, body: Any, key: str | None, chunked: bool = False) -> Any:
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if chunked:
            conn.request(method, path, body=iter([data[i:i + 8192] for i in range(0, len(data), 8192)]),
                         headers=headers, encode_chunked=True)
        else:
            conn.request(method, path, body=data, headers=headers)
        return conn.getresponse()

    def _record(self, kind: str, case: str, status: int, text: str, want: int, code: str | None = None) -> None:
        got_code = None
        if status >= 400:
            try:
                err = json.loads(text)["error"]
                got_code = err.get("code") or _error_class(err["message"])
                shaped = set(err) == {"message", "type", "param", "code"} and bool(err["message"])
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not shaped:
                self.unexpected.append(f"{kind}/{case}: {status} not in OpenAI's error shape: {text[:120]!r}")
        self.tally[(kind, case, status, got_code or "")] += 1
        if status != want or (code is not None and got_code != code):
            self.unexpected.append(f"{kind}/{case}: got {status} {got_code!r}, expected {want} {code!r}: "
                                   f"{text[:160]!r}")

    # ---- kinds ----------------------------------------------------------------------------------------------
    def good(self) -> None:
        key = self.rng.choice(list(KEYS))
        prompt = self.rng.choice(PROMPTS)
        n = self.rng.randint(*self.spec.max_tokens)
        conn = self._conn()
        t0 = time.perf_counter()
        try:
            if self.rng.random() < 0.5:
                r = self._send(conn, "POST", "/v1/completions", _completion(prompt, n, temperature=0.7), key)
                text = r.read().decode()
                ok = r.status == 200 and json.loads(text)["usage"]["completion_tokens"] >= 1
                self._record("good", "completion", r.status, text if not ok else "", 200)
            else:
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                        "stream": True}
                r = self._send(conn, "POST", "/v1/chat/completions", body, key)
                text = r.read().decode()
                if r.status == 200 and not (text.rstrip().endswith("data: [DONE]") and '"error"' not in text):
                    self.unexpected.append(f"good/chat stream: ended without [DONE] or with an error: {text[-200:]!r}")
                self._record("good", "chat stream", r.status, text[-300:], 200)
            self.latency_s.append(time.perf_counter() - t0)
        finally:
            conn.close()

    def bad(self) -> None:
        case, method, path, body, key, want, code = self.rng.choice(BAD)
        conn = self._conn()
        try:
            r = self._send(conn, method, path, body, key)
            self._record("bad", case, r.status, r.read().decode(), want, code)
        finally:
            conn.close()

    def cancelled(self) -> None:
        conn = self._conn()
        try:
            body = _completion(self.rng.choice(PROMPTS), self.spec.cancel_max_tokens, stream=True, ignore_eos=True)
            r = self._send(conn, "POST", "/v1/completions", body, self.rng.choice(list(KEYS)))
            events = 0
            want = self.rng.randint(*self.spec.cancel_after_events)
            while r.status == 200 and events < want:
                line = r.readline()
                if not line:
                    break
                events += line.startswith(b"data: ")
            self._record("cancelled", "stream closed by the client", r.status if events == want else 599,
                         "" if events == want else r.read(300).decode(errors="replace"), 200)
        finally:
            conn.close()  # the server sees the disconnect and cancels the request

    def duplicate(self) -> None:
        rid = f"dup-{self.rng.getrandbits(48):012x}"
        req = Request(id=rid, prompt=[256, *PROMPTS[0].encode()], max_tokens=4, ignore_eos=True)

        async def both():
            handles = [self.loop.submit(req), self.loop.submit(req)]
            outs = []
            for h in handles:
                while not (up := await h.get()).final:
                    pass
                outs.append(up.done)
            return outs

        outs = asyncio.run(both())
        dup = [o for o in outs if isinstance(o.error, DuplicateRequestError)]
        served = [o for o in outs if o.finish_reason == "length" and len(o.tokens) == 4]
        for o in outs:
            self.tally[("duplicate", "same id twice at the engine loop", "engine", o.finish_reason if o.error is None
                        else type(o.error).__name__)] += 1
        if len(dup) != 1 or len(served) != 1:
            self.unexpected.append(f"duplicate id: {[(o.finish_reason, repr(o.error)) for o in outs]}")
        results: list = [None, None]  # the same HTTP body twice at once: two requests, both served

        def send(i: int) -> None:
            conn = self._conn()
            try:
                r = self._send(conn, "POST", "/v1/completions", _completion(PROMPTS[1], 3), "key-a")
                results[i] = (r.status, r.read().decode())
            finally:
                conn.close()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for status, text in results:
            self._record("duplicate", "same body twice over HTTP", status, text, 200)

    def oversized(self) -> None:
        chunked = self.rng.random() < 0.5
        body = json.dumps(_completion("y" * (self.spec.max_body_bytes + 1), 2)).encode()
        conn = self._conn()
        try:
            r = self._send(conn, "POST", "/v1/completions", body, "key-a", chunked=chunked)
            self._record("oversized", "chunked" if chunked else "content-length", r.status, r.read().decode(), 413,
                         "request_too_large")
        except (BrokenPipeError, ConnectionResetError):  # answered 413 and closed before the whole body was sent
            self.tally[("oversized", "chunked" if chunked else "content-length", 413, "connection closed")] += 1
        finally:
            conn.close()

    def run(self) -> None:
        kinds, weights = zip(*self.spec.mix.items(), strict=True)
        while time.monotonic() < self.deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                getattr(self, kind)()
            except Exception as e:  # a client-side failure (timeout, reset) is a finding too
                self.tally[(kind, "client exception", 0, type(e).__name__)] += 1
                self.unexpected.append(f"{kind}: {e!r:.200}")


def _error_class(message: str) -> str | None:
    """The typed error a 400 names (``"InvalidTokenError: ..."`` -> ``"InvalidTokenError"``), else None."""
    head = message.split(":", 1)[0]
    return head if head.endswith("Error") and head.isidentifier() else None


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def soak(engine: Engine, tokenizer: Any, spec: ReliabilitySpec, log=print) -> dict:
    """Run the mixed load against a server over ``engine``; the counters and checks (see the module docstring)."""
    engine.keep_finished = spec.keep_finished
    backend = EngineBackend(engine)
    app = create_app(backend, tokenizer, MODEL, api_keys=KEYS, max_body_bytes=spec.max_body_bytes,
                     max_in_flight=spec.max_in_flight)
    srv, thread, base = start_in_thread(app)
    port = int(base.rsplit(":", 1)[1])
    try:
        loop = app.state.loops[0]
        t0 = time.monotonic()
        rss_start = _rss_mib()
        deadline = t0 + spec.warmup_seconds + spec.seconds
        clients = [Client(port, spec, loop, spec.seed * 1000 + i, deadline) for i in range(spec.concurrency)]
        threads = [threading.Thread(target=c.run, name=f"soak-client-{i}", daemon=True)
                   for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        samples, baseline = [], None
        while any(t.is_alive() for t in threads):
            now = time.monotonic() - t0
            rss = _rss_mib()
            if baseline is None and now >= spec.warmup_seconds:
                baseline = rss
            samples.append({"t": round(now, 2), "rss_mib": round(rss, 1), "pages_used": engine.allocator.num_used,
                            "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting)})
            time.sleep(spec.sample_s)
        for t in threads:
            t.join()
        load_s = time.monotonic() - t0
        drained = _drain(app, engine, spec.drain_timeout_s)
        invariants = loop.run_exclusive(lambda b: b.engine.check_invariants() or "ok").result(timeout=60)
        rss_end = _rss_mib()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        health = conn.getresponse().status
        conn.close()
    finally:
        srv.should_exit = True
        thread.join(30)
    tally: collections.Counter = sum((c.tally for c in clients), collections.Counter())
    unexpected = [u for c in clients for u in c.unexpected]
    latency = [x for c in clients for x in c.latency_s]
    baseline = samples[0]["rss_mib"] if baseline is None else baseline
    by_kind = collections.Counter()
    for (kind, _, _, _), n in tally.items():
        by_kind[kind] += n
    free = engine.allocator.num_free
    res = dict(
        load_seconds=round(load_s, 1), requests=sum(by_kind.values()), by_kind=dict(by_kind),
        responses=[{"kind": k, "case": c, "status": s, "code": code, "count": n}
                   for (k, c, s, code), n in sorted(tally.items(), key=lambda kv: tuple(map(str, kv[0])))],
        unexpected=unexpected[:50], unexpected_count=len(unexpected),
        rss_mib={"start": round(rss_start, 1), "baseline": round(baseline, 1), "end": round(rss_end, 1),
                 "peak": max(s["rss_mib"] for s in samples), "growth_since_baseline": round(rss_end - baseline, 1),
                 "growth_second_half": round(samples[-1]["rss_mib"] - samples[len(samples) // 2]["rss_mib"], 1)},
        pages={"total": engine.num_pages - 1, "free_after_drain": free,
               "in_use_after_drain": engine.num_pages - 1 - free, "peak_in_use": max(s["pages_used"] for s in samples)},
        drained=drained, invariants=invariants, health=health, engine_outputs_kept=len(engine.outputs),
        good_latency_s=_spread(latency), samples=samples,
        prefix_hit_pages=engine.scheduler.hit_pages,
    )
    res["checks"] = {
        "every response as expected": res["unexpected_count"] == 0,
        f"RSS growth < {spec.rss_growth_limit_mib} MiB": res["rss_mib"]["growth_since_baseline"]
        < spec.rss_growth_limit_mib,
        "all pages free": res["pages"]["in_use_after_drain"] == 0,
        "invariants hold": invariants == "ok",
        "nothing in flight": drained,
        "/health 200": health == 200,
        "finished outputs bounded": len(engine.outputs) <= spec.keep_finished + spec.max_in_flight + spec.concurrency,
    }
    log({k: v for k, v in res.items() if k not in ("samples", "responses")})
    return res


def _drain(app: Any, engine: Engine, timeout_s: float) -> bool:
    """Wait until no request is open at the server or running in the engine (True) or ``timeout_s`` passes."""
    loop = app.state.loops[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not loop._active and not engine.has_work and not loop._inbox.qsize():
            return True
        time.sleep(0.1)
    return False


def _spread(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4)}


def prewarm(engine: Engine, spec: ReliabilitySpec) -> float:
    """Compile what the load will run before it starts (prefill and decode batch buckets 1..max_batch, prompt
    buckets 16-64 tokens, the decode page-table widths 4-16 pages), so the soak measures a warm server; the seconds
    it took."""
    t0 = time.perf_counter()
    engine.warm_handoff()
    rng = random.Random(0)
    b = 1
    while b <= engine.max_batch:
        longest = max(spec.max_tokens[1], spec.cancel_max_tokens)
        for plen, max_tokens in [(12, 16), (30, 16), (60, 16)] + [(30, m) for m in (60, 90, 150, 200) if m <= longest]:
            engine.generate([Request(id=f"prewarm-{b}-{plen}-{max_tokens}-{i}",  # distinct: no prefix hits
                                     prompt=[256] + [rng.randrange(32, 127) for _ in range(plen - 1)],
                                     max_tokens=max_tokens, ignore_eos=True) for i in range(b)])
        b *= 2
    reset_engine(engine, engine.max_batch)
    return time.perf_counter() - t0


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    spec: ReliabilitySpec = experiment_spec(cfg, ReliabilitySpec)
    engine = Engine.from_hydra(cfg)
    log(f"prewarm: {prewarm(engine, spec):.1f} s")
    res = soak(engine, tokenizer_of(cfg), spec, log)
    env = environment() | {"kernels": rp.kernel_rows(engine)}
    results = {"experiment": "reliability", "spec": dataclasses.asdict(spec), "environment": env,
               "model": engine.cfg.architecture, "serve": {"mode": engine.serve.mode, "pages": engine.num_pages - 1,
                                                           "max_batch": engine.max_batch,
                                                           "weights": engine.serve.quant.decode_weights,
                                                           "kv_dtype": engine.serve.quant.kv_dtype},
               **res}
    out = Path(out_dir)
    rp.write_outputs(out, cfg, results, render(results))
    plot(results, out)
    return results


def plot(results: dict, out_dir: Path) -> Path:
    """``rss.png``: the process's RSS over the run (the baseline after warm-up dashed) above the KV pages in use and
    the running requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["samples"]
    ts = [x["t"] for x in s]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.2), dpi=110, sharex=True)
    top.plot(ts, [x["rss_mib"] for x in s], label="RSS (MiB)")
    top.axhline(results["rss_mib"]["baseline"], linestyle="--", color="gray", linewidth=1,
                label=f"baseline after {results['spec']['warmup_seconds']:.0f} s of load")
    top.set_ylabel("MiB")
    bottom.plot(ts, [x["pages_used"] for x in s], label="KV pages in use", linewidth=0.8)
    bottom.plot(ts, [x["running"] for x in s], label="running requests", linewidth=0.8)
    bottom.set_ylabel("count")
    bottom.set_xlabel("seconds since the load started")
    top.set_title(f"Reliability soak: {results['requests']:,} mixed requests; server RSS and KV pages", fontsize=9)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / PLOT
    fig.savefig(path)
    plt.close(fig)
    return path


def render(results: dict) -> str:
    s, r, p = results["spec"], results["rss_mib"], results["pages"]
    checks = rp.markdown_table(["check", "result"],
                               [[k, "pass" if v else "FAIL"] for k, v in results["checks"].items()])
    kinds = rp.markdown_table(["kind", "requests"], [[k, v] for k, v in results["by_kind"].items()])
    responses = rp.markdown_table(["kind", "case", "status", "error code (or the typed error named)", "count"],
                                  [[x["kind"], x["case"], x["status"], x["code"] or "", x["count"]]
                                   for x in results["responses"]])
    lat = results["good_latency_s"]
    lat_line = (f"{lat['n']} good requests, end-to-end median {lat['median']:.3f} s (range {lat['min']:.3f}-"
                f"{lat['max']:.3f} s)") if lat["n"] else "no good request finished"
    unexpected = "\n".join(f"- `{u}`" for u in results["unexpected"]) or "none"
    sv = results["serve"]
    return f"""# Reliability soak: the HTTP server under sustained mixed load

`python experiments/reliability.py hydra.run.dir=benchmarks/reliability` (settings in
`configs/experiment/reliability.yaml`; the 30-second version runs in `tests/e2e/test_soak.py`). Every number below
was counted in this run (`results.json`).

- model `{results['model']}`, {sv['weights']} weights, {sv['kv_dtype']} KV, {sv['mode']}, {sv['pages']} pages,
  at most {sv['max_batch']} running; API keys on (two tenants), `max_body_bytes` {s['max_body_bytes']},
  `max_in_flight` {s['max_in_flight']}, `keep_finished` {s['keep_finished']}
- {s['concurrency']} client threads in this process for {s['warmup_seconds']:.0f} s of warm-up +
  {s['seconds']:.0f} s, each drawing its next request from the mix {s['mix']}
  ({results['load_seconds']} s of load in all)

## Checks after the load

{checks}

## Requests

{results['requests']} requests:

{kinds}

{lat_line}.

Responses by kind, case, status and error code (a 400 without a code: the typed error its message names, when it
names one). Status `engine`: the two submissions of one request id at the engine loop, one served (`length`), the
other refused (`DuplicateRequestError`); every other row is an HTTP response. A cancelled stream is counted when
its client has read its events and closes the connection.

{responses}

Unexpected responses: {results['unexpected_count']}

{unexpected}

## Memory and pages

| RSS at start | baseline (after {s['warmup_seconds']:.0f} s of load) | peak | end (drained) | growth since baseline | \
growth over the second half of the load |
|---|---|---|---|---|---|
| {r['start']} MiB | {r['baseline']} MiB | {r['peak']} MiB | {r['end']} MiB | {r['growth_since_baseline']} MiB | \
{r['growth_second_half']} MiB |

KV pages: {p['total']} in the pool, peak {p['peak_in_use']} in use, {p['in_use_after_drain']} in use after the
drain; engine outputs kept at the end: {results['engine_outputs_kept']} (`keep_finished` {s['keep_finished']}, plus
those in flight when the last request arrived); prefix-cache
hit pages: {results['prefix_hit_pages']}. RSS is the whole process's: server, engine and the client threads.

![{PLOT}]({PLOT})

{rp.environment_section(results['environment'])}
"""
