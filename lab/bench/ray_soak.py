"""Hostile soak through the HTTP server on the Ray backend: good requests mixed with bad bodies and port garbage.

One deployment as a user runs it (``python -m phaseserve.server experiment.backend=ray``, built by
``launch.build_backend`` on a ``ray.cluster_utils.Cluster`` of two nodes: prefill on one, decode on the other), and
for ``seconds`` three bounded loops run at once, all on loopback:

- **good**: greedy completions of fresh prompts (a new prompt every time, streamed and not, ``ignore_eos``), one
  at a time, so each runs in a batch of its own and its tokens can be compared exactly with a replay;
- **bad bodies**: every kind of malformed request body (:func:`bad_bodies`: deep nesting in the body, in a tool
  call's ``arguments`` and in a ``response_format`` schema, numbers past int and float limits, lone surrogates,
  duplicate keys, truncated and non-JSON bytes, wrong types, out-of-range fields), each answered and its status
  kept: a client error must be a 4xx, never a 5xx;
- **port garbage**: bytes no peer sends at each actor's advertised KV-transfer address (:func:`port_garbage`:
  random bytes, a zero-length frame, an oversized and a truncated length header, a forged handshake, a flood of
  connections at once).

Then, once the server is idle: ``/health`` is 200, both actors are the incarnations that started (no death), no
page or staging entry is held on either side and every invariant holds, ``phaseserve:integrity_aborts_total`` is 0,
and the good requests replayed one by one on an in-process engine of the same config (its own HTTP server) give
the same text. ``run`` writes ``results.json`` and ``README.md``.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEEP = 100_000  # nesting depth of the deep bodies (Python's json recursion limit is ~1,000)


@dataclass
class SoakSpec:
    seconds: float = 180.0  # how long the three loops run (each also stops at its own count bound)
    max_good: int = 400  # good requests at most
    max_bad: int = 20_000  # bad bodies at most
    max_garbage: int = 20_000  # garbage connections at most (a flood counts each of its connections)
    flood: int = 32  # connections opened at once by one flood
    bad_interval_s: float = 0.01  # pause between two bad bodies (the loops share the server with the good one)
    garbage_interval_s: float = 1.0  # pause between two rounds of garbage (every kind, each address)
    max_tokens: tuple[int, int] = (4, 24)  # a good request's output length, uniform inclusive
    seed: int = 0
    overrides: list[str] = field(default_factory=lambda: ["engine.max_batch=8", "cache.num_pages=256"])


def bad_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body bytes): one of each kind of malformed body; every one is a client error."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    ok = {"model": "phaseserve-default", "prompt": "hi", "max_tokens": 4}
    msg = {"model": "phaseserve-default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    deep_arguments = "[" * DEEP + "]" * DEEP
    tool_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_arguments}}]}
    tool_reply = {"role": "tool", "content": "1", "tool_call_id": "c1"}
    n = 2_000  # a schema nested this deep, written out as text (json.dumps recurses too)
    deep_schema = '{"type": "object", "properties": {"x": ' * n + '{"type": "object"}' + "}}" * n

    def dump(d: Any) -> bytes:
        return json.dumps(d).encode()

    return [
        ("deep_body", c, b'{"model": "phaseserve-default", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
        ("deep_tool_arguments", chat, dump({**msg, "messages": [msg["messages"][0], tool_call, tool_reply]})),
        ("deep_response_format", chat, dump(msg)[:-1] + b', "response_format": {"type": "json_schema", '
         b'"json_schema": {"name": "s", "schema": ' + deep_schema.encode() + b"}}}"),
        ("huge_int", c, dump(ok)[:-1] + b', "seed": ' + b"9" * 5_000 + b"}"),
        ("huge_float", c, dump(ok)[:-1] + b', "temperature": 1e999}'),
        ("nan_literal", c, dump(ok)[:-1] + b', "top_p": NaN}'),
        ("lone_surrogate", c, b'{"model": "phaseserve-default", "prompt": "\\ud800", "max_tokens": 4}'),
        ("duplicate_keys", c, b'{"model": "phaseserve-default", "prompt": "a", "prompt": 7, "max_tokens": 4}'),
        ("truncated", c, dump(ok)[:17]),
        ("not_json", c, bytes(range(256))),
        ("not_utf8", c, b'{"model": "phaseserve-default", "prompt": "\xff\xfe", "max_tokens": 4}'),
        ("prompt_wrong_type", c, dump({**ok, "prompt": {"a": 1}})),
        ("messages_wrong_type", chat, dump({**msg, "messages": "hello"})),
        ("token_out_of_vocab", c, dump({**ok, "prompt": [1, 2, 10**9]})),
        ("empty_prompt", c, dump({**ok, "prompt": ""})),
        ("negative_max_tokens", c, dump({**ok, "max_tokens": -5})),
        ("too_many_logprobs", c, dump({**ok, "logprobs": 10_000})),
        ("n_zero", c, dump({**ok, "n": 0})),
        ("unknown_tool_choice", chat, dump({**msg, "tool_choice": {"type": "function", "function": {"name": "x"}}})),
        ("array_body", c, b"[1, 2, 3]"),
    ]


def _send(address: str, payload: bytes, read: bool = True, timeout_s: float = 2.0) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        if payload:
            s.sendall(payload)
        if read:
            try:
                s.recv(64)
            except OSError:
                pass


def port_garbage(address: str, rng: random.Random, flood: int) -> list[tuple[str, int]]:
    """Send each kind of garbage to ``address`` ("host:port", loopback); (kind, connections) sent. A refused or
    reset connection is the expected answer and is not an error here; what counts is that the actor lives."""
    kinds = [
        ("random_bytes", lambda: _send(address, rng.randbytes(64))),
        ("zero_length_frame", lambda: _send(address, b"\0\0\0\0")),
        ("oversized_length", lambda: _send(address, b"\xff\xff\xff\x7f" + rng.randbytes(16))),
        ("truncated_frame", lambda: _send(address, b"\x64\0\0\0" + rng.randbytes(10), read=False)),
        ("forged_handshake", lambda: _send(address, b"phaseserve-transfer-gate-v1\n" + rng.randbytes(64))),
    ]
    sent = []
    for kind, fn in kinds:
        try:
            fn()
        except OSError:
            pass
        sent.append((kind, 1))
    host, port = address.rsplit(":", 1)
    socks = []
    try:
        for _ in range(flood):
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=2.0))
            except OSError:
                break
    finally:
        for s in socks:
            s.close()
    sent.append(("flood", len(socks)))
    return sent


def _http(base: str, method: str, path: str, body: bytes | None = None, timeout_s: float = 120.0) -> tuple[int, str]:
    host, port = base.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json"} if body else {})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def complete(base: str, prompt: str, max_tokens: int, stream: bool) -> str:
    """A greedy completion's text (``ignore_eos``), streamed or not; raises on a non-200 answer."""
    body = json.dumps({"model": "phaseserve-default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    status, text = _http(base, "POST", "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {text[:300]}")
    if not stream:
        return json.loads(text)["choices"][0]["text"]
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            out += [c["text"] for c in chunk.get("choices", [])]
    return "".join(out)


def metric(base: str, name: str) -> float:
    status, text = _http(base, "GET", "/metrics")
    assert status == 200, status
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def _loops(spec: SoakSpec, base: str, addresses: list[str], stop: float) -> dict:
    """The three loops at once until ``stop`` (monotonic) or their bounds; what each did."""
    rng = random.Random(spec.seed)
    good: list[dict] = []
    bad: dict[str, dict[int, int]] = {}
    garbage: dict[str, int] = {}
    bodies = bad_bodies()
    errors: list[str] = []

    def good_loop() -> None:
        r = random.Random(spec.seed + 1)
        while time.monotonic() < stop and len(good) < spec.max_good:
            prompt = f"def f{len(good)}_{r.randrange(10**6)}(x):\n    return x * {r.randrange(100)} + "
            n, stream = r.randint(*spec.max_tokens), bool(len(good) % 2)
            try:
                good.append({"prompt": prompt, "max_tokens": n, "stream": stream,
                             "text": complete(base, prompt, n, stream)})
            except Exception as e:  # noqa: BLE001 -- a good request that fails is a result, reported
                errors.append(f"good request {len(good)}: {type(e).__name__}: {e}"[:400])
                good.append({"prompt": prompt, "max_tokens": n, "stream": stream, "text": None})

    def bad_loop() -> None:
        i = 0
        while time.monotonic() < stop and i < spec.max_bad:
            name, path, body = bodies[i % len(bodies)]
            try:
                status, _ = _http(base, "POST", path, body, timeout_s=60.0)
            except Exception as e:  # noqa: BLE001 -- a dropped connection counts as a failure of the server
                status = 599
                errors.append(f"bad body {name}: {type(e).__name__}: {e}"[:300])
            bad.setdefault(name, {})
            bad[name][status] = bad[name].get(status, 0) + 1
            i += 1
            time.sleep(spec.bad_interval_s)

    def garbage_loop() -> None:
        n = 0
        while time.monotonic() < stop and n < spec.max_garbage:
            for addr in addresses:
                for kind, count in port_garbage(addr, rng, spec.flood):
                    garbage[kind] = garbage.get(kind, 0) + count
                    n += count
            time.sleep(spec.garbage_interval_s)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(fn) for fn in (good_loop, bad_loop, garbage_loop)]:
            f.result()
    return {"good": good, "bad": bad, "garbage": garbage, "errors": errors}


def _idle_state(app: Any) -> dict:
    """Leak and liveness counts read in the engine loop's thread once nothing is in flight."""

    def read(backend: Any) -> dict:
        e = backend.engine
        e.check_invariants()
        staged = e.prefill.snapshot()
        return {"decode_pages_held": int(e.allocator.num_used), "prefill_pages_held": int(e.prefill.allocator.num_used),
                "staged_entries": int(staged["staged"]), "staging_pages": int(staged["staging_pages_in_use"]),
                "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                "deaths": {"prefill": e.prefill.deaths, "decode": e.decode.deaths},
                "prefill_actor": {k: v for k, v in staged.items() if k not in ("staged", "staging_pages_in_use")},
                "decode_actor": e.decode.snapshot(), "invariants": True}

    return app.state.loops[0].run_exclusive(read).result(timeout=300)


def verdict(res: dict) -> dict:
    """The soak's pass conditions, each with its measured value."""
    good = res["loops"]["good"]
    five = {k: sum(n for s, n in v.items() if int(s) >= 500) for k, v in res["loops"]["bad"].items()}
    idle = res["idle"]
    leaked = idle["decode_pages_held"] + idle["prefill_pages_held"] + idle["staged_entries"] + idle["staging_pages"]
    equal = sum(g["text"] is not None and g["text"] == r for g, r in zip(good, res["replay"], strict=True))
    checks = {
        "0 leaked pages or staging entries": leaked == 0,
        "0 5xx answers to client errors": sum(five.values()) == 0,
        "0 integrity false positives": res["integrity_aborts_total"] == 0,
        "no actor died": sum(idle["deaths"].values()) == 0,
        "health 200 after": res["health_after"] == 200,
        "good greedy text equals the in-process engine's": equal == len(good) and len(good) > 0,
    }
    return {"checks": checks, "passed": all(checks.values()), "leaked": leaked, "five_xx": five,
            "good_equal": equal, "good": len(good), "bad": sum(sum(v.values()) for v in res["loops"]["bad"].values()),
            "garbage_connections": sum(res["loops"]["garbage"].values())}


def soak(spec: SoakSpec) -> dict:
    """Deploy, run the loops, check; the raw results with :func:`verdict` under ``"verdict"``."""
    import ray

    from lab.bench.ray_cluster import ray_server_config, two_node_cluster
    from phaseserve.data.tokenizer import ByteTokenizer
    from phaseserve.engine import Engine
    from phaseserve.server import EngineBackend, create_app
    from phaseserve.server.launch import build_backend, compose, start_in_thread

    tok = ByteTokenizer()
    cluster = two_node_cluster()
    servers, engine = [], None
    try:
        cfg = ray_server_config(cluster, spec.overrides)
        backend = build_backend(cfg)
        engine = backend.engine
        engine.warm_handoff()
        app = create_app(backend, tok, "phaseserve-default")
        srv, thread, base = start_in_thread(app)
        servers.append((srv, thread))
        addresses = [engine.prefill.info["address"], engine.decode.info["address"]]
        complete(base, "def warm(x):\n    return ", spec.max_tokens[1], True)  # compiles before the clock starts
        t0 = time.monotonic()
        loops = _loops(spec, base, addresses, t0 + spec.seconds)
        wall = time.monotonic() - t0
        health_after = _http(base, "GET", "/health")[0]
        idle = _idle_state(app)
        aborts = metric(base, "phaseserve:integrity_aborts_total")
        ref_srv, ref_thread, ref_base = start_in_thread(create_app(EngineBackend(Engine.from_hydra(
            compose(spec.overrides))), tok, "phaseserve-default"))
        servers.append((ref_srv, ref_thread))
        replay = [complete(ref_base, g["prompt"], g["max_tokens"], g["stream"]) for g in loops["good"]]
    finally:
        for s, t in servers:
            s.should_exit = True
            t.join(30)
        if engine is not None:
            engine.close()
        ray.shutdown()
        cluster.shutdown()
    res = {"spec": asdict(spec), "wall_s": wall, "addresses": addresses, "loops": loops, "idle": idle,
           "health_after": health_after, "integrity_aborts_total": aborts, "replay": replay}
    res["verdict"] = verdict(res)
    return res


def report(res: dict) -> str:
    v = res["verdict"]
    lines = ["# Ray soak: good requests, bad bodies and transfer-port garbage through the HTTP server", "",
             f"{res['wall_s']:.0f} s; {v['good']} good requests ({v['good_equal']} equal to the in-process engine's "
             f"greedy text), {v['bad']} bad bodies, {v['garbage_connections']} garbage connections to the actors' "
             f"transfer addresses {', '.join(res['addresses'])}.", "", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'yes' if ok else 'NO'} |" for k, ok in v["checks"].items()]
    env = res.get("environment")
    if env:
        dirty = f" with {', '.join(env['git_modified'])} modified" if env.get("git_modified") else ""
        lines += ["", f"Measured {env['date']} on {env['machine']} ({env['cpu_cores']} cores), jax {env['jax']}, "
                  f"commit {env['git_commit']}{dirty}."]
    lines += ["", "Bad bodies, status codes by kind:", "", "| body | statuses |", "|---|---|"]
    lines += [f"| {k} | {', '.join(f'{s}: {n}' for s, n in sorted(c.items()))} |"
              for k, c in res["loops"]["bad"].items()]
    lines += ["", "Garbage sent (connections per kind): "
              + ", ".join(f"{k} {n}" for k, n in res["loops"]["garbage"].items()), "",
              f"After: /health {res['health_after']}, pages held {res['idle']['decode_pages_held']} (decode) / "
              f"{res['idle']['prefill_pages_held']} (prefill), staged entries {res['idle']['staged_entries']}, "
              f"deaths {res['idle']['deaths']}, integrity aborts {res['integrity_aborts_total']:.0f}.", "",
              "The actors' own counters after the run:", "", "```",
              json.dumps({"prefill": res["idle"]["prefill_actor"], "decode": res["idle"]["decode_actor"]},
                         indent=1, default=str), "```"]
    if res["loops"]["errors"]:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in res["loops"]["errors"][:20]]
    return "\n".join(lines) + "\n"


def run(cfg: Any, out_dir: str | Path) -> dict:
    """Hydra entry (``experiments/ray_soak.py``): the spec from ``experiment``, results into ``out_dir``."""
    from lab.bench.measure import environment

    e = cfg.experiment
    spec = SoakSpec(seconds=float(e.seconds), max_good=int(e.max_good), max_bad=int(e.max_bad),
                    max_garbage=int(e.max_garbage), flood=int(e.flood), bad_interval_s=float(e.bad_interval_s),
                    garbage_interval_s=float(e.garbage_interval_s), max_tokens=tuple(e.max_tokens),
                    seed=int(e.seed), overrides=list(e.overrides))
    res = soak(spec)
    res["environment"] = environment()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "README.md").write_text(report(res))
    print(report(res))
    return res
