"""Serving safety of the HTTP server (issue #42): authentication and per-tenant prefix caching, /metrics access,
/health over a dead backend, the request-body limit, refusals before the engine loop, client mistakes as 4xx.

One server (uvicorn in a thread) over a small float32 colocated engine of the shipped default model, with API keys
configured: ``key-alice`` and ``key-alice2`` are tenant ``alice``, ``key-bob`` is ``bob``, ``key-metrics`` may read
``/metrics`` only. /health is checked over stub backends (a dead engine-loop thread, a dead decode server).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from types import SimpleNamespace

import openai
import pytest

import phaseserve as ps
from lab.bench.http_cost import StubBackend
from lab.eval.demo import default_model_path
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.engine.request import Limits
from phaseserve.server import EngineBackend, create_app
from phaseserve.server.launch import start_in_thread

MODEL = "phaseserve-default"
TOK = ByteTokenizer()
KEYS = {"key-alice": "alice", "key-alice2": "alice", "key-bob": "bob"}
MAX_BODY = 64 * 1024
PROMPT = "def tenant_secret_prefix(value):\n    return value * 31 + 7  # sixty-four bytes long..\n"


class Tracebacks(logging.Handler):
    """Log records that carry an exception (a traceback in the server's log)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def server():
    cfg, params = ps.load_checkpoint(default_model_path(), "float32")
    serve = ps.ServeConfig(mode="colocated", quant=ps.QuantConfig("float32", "float32", "float32", "float32"),
                           cache=ps.CacheConfig(page_size=16, num_pages=160, max_pages_per_seq=16), max_batch=8)
    engine = ps.Engine(cfg, params, serve)
    backend = EngineBackend(engine)
    app = create_app(backend, TOK, MODEL, api_keys=KEYS, metrics_key="key-metrics", max_body_bytes=MAX_BODY)
    logs = Tracebacks()
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).addHandler(logs)
    srv, thread, base = start_in_thread(app)
    yield {"base": base, "port": int(base.rsplit(":", 1)[1]), "engine": engine, "backend": backend, "logs": logs}
    srv.should_exit = True
    thread.join(30)
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).removeHandler(logs)


def _http(port: int, method: str, path: str, body: bytes | dict | None = None, key: str | None = "key-alice",
          headers: dict | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    conn.request(method, path, body=data, headers=hdrs)
    r = conn.getresponse()
    out = r.status, r.read().decode()
    conn.close()
    return out


def _openai_error(text: str) -> dict:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


# ---- 1. authentication, tenants, /metrics ---------------------------------------------------------------------
def test_a_missing_or_wrong_api_key_gets_401_in_the_openai_shape(server):
    port = server["port"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for key, headers in ((None, None), ("wrong", None), ("key-metrics", None), (None, {"authorization": "key-bob"}),
                         (None, {"authorization": "Basic a2V5LWJvYg=="})):
        status, text = _http(port, "POST", "/v1/completions", body, key=key, headers=headers)
        assert status == 401, (key, headers, status, text)
        assert _openai_error(text)["code"] == "invalid_api_key"
    assert _http(port, "GET", "/v1/models", key=None)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        _client(server["base"], "nope").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    r = _client(server["base"], "key-bob").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert _http(port, "GET", "/health", key=None)[0] == 200  # liveness probes need no key


def test_the_prefix_cache_is_per_tenant_and_the_user_field_never_widens_it(server):
    sched = server["engine"].scheduler
    alice = _client(server["base"], "key-alice")
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0)
    stream = alice.completions.create(stream=True, max_tokens=160, extra_body={"ignore_eos": True}, **kw)
    try:
        next(iter(stream))  # alice's prompt is prefilled, its pages registered, and it is still running
        hits = sched.hit_pages
        for key, user in (("key-bob", None), ("key-bob", "alice"), ("key-bob", "")):
            extra = {} if user is None else {"user": user}
            _client(server["base"], key).completions.create(max_tokens=1, **kw, **extra)
            assert sched.hit_pages == hits, f"{key} (user={user!r}) hit alice's prefix"
        _client(server["base"], "key-alice2").completions.create(max_tokens=1, **kw)  # the same tenant shares
        assert sched.hit_pages > hits
    finally:
        stream.close()


def test_metrics_need_the_metrics_key(server):
    port = server["port"]
    for key in (None, "key-alice", "wrong"):
        status, text = _http(port, "GET", "/metrics", key=key)
        assert status == 401, (key, status, text)
        _openai_error(text)
    status, text = _http(port, "GET", "/metrics", key="key-metrics")
    assert status == 200 and "phaseserve:prefix_cache_hits_total" in text


# ---- 7. body limit, refusals before the engine loop -----------------------------------------------------------
def test_a_body_over_the_limit_is_413_in_the_openai_shape(server):
    port = server["port"]
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    status, text = _http(port, "POST", "/v1/completions", big)
    assert status == 413 and _openai_error(text)["type"] == "invalid_request_error"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # no content-length: counted as it arrives
    data = json.dumps(big).encode()
    conn.request("POST", "/v1/completions", body=iter([data[i:i + 8192] for i in range(0, len(data), 8192)]),
                 headers={"content-type": "application/json", "authorization": "Bearer key-alice"},
                 encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413 and _openai_error(r.read().decode())
    conn.close()
    assert _http(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})[0] == 200


def test_a_prompt_beyond_the_context_is_refused_before_the_engine_loop(server, monkeypatch):
    backend = server["backend"]
    submitted = []
    real = backend.submit
    monkeypatch.setattr(backend, "submit", lambda req: submitted.append(req.id) or real(req))
    n = server["engine"].limits.max_context
    for prompt in ("y" * (n + 5), [65] * (n + 5), [10**9] * (n + 5), [1, 2, 10**9]):
        status, text = _http(server["port"], "POST", "/v1/completions", {"model": MODEL, "prompt": prompt})
        assert status == 400, (str(prompt)[:30], status, text)
        _openai_error(text)
    assert submitted == [], "refused requests reached the engine loop"


# ---- 10. client mistakes --------------------------------------------------------------------------------------
def _chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


MISTAKES = [  # (what, method, path, raw body, expected status)
    ("lone surrogate in a prompt", "POST", "/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', 400),
    ("lone surrogate in a stop string", "POST", "/v1/completions",
     b'{"prompt": "ab", "stop": ["\\udc00"], "max_tokens": 2}', 400),
    ("lone surrogate in a chat message", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x\\udfffy"}]}', 400),
    ("lone surrogate in user", "POST", "/v1/completions", b'{"prompt": "ab", "user": "\\ud800", "max_tokens": 2}',
     400),
    ("tool-call arguments that are not JSON", "POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{not json"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode(), 400),
    ("malformed JSON", "POST", "/v1/completions", b'{"prompt": "ab", ', 400),
    ("a JSON array body", "POST", "/v1/completions", b"[1, 2]", 400),
    ("not UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("an unknown route", "GET", "/v1/nothing-here", None, 404),
    ("an unknown POST route", "POST", "/v2/completions", b"{}", 404),
    ("a wrong method", "GET", "/v1/completions", None, 405),
]


@pytest.mark.parametrize("what,method,path,body,status", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_client_mistakes_are_4xx_in_the_openai_shape_without_a_traceback(server, what, method, path, body, status):
    before = len(server["logs"].records)
    got, text = _http(server["port"], method, path, body)
    assert got == status, (what, got, text)
    _openai_error(text)
    assert len(server["logs"].records) == before, [r.getMessage() for r in server["logs"].records[before:]]


# ---- 6. /health over stub backends ----------------------------------------------------------------------------
LIMITS = Limits(vocab_size=264, max_context=64, page_size=16, max_pages=4)


class _HealthBackend(EngineBackend):
    """An idle backend whose engine reports ``down`` (None: it serves), as a Ray engine does while an actor is
    dead or restarting (``RayEngine.health``)."""

    def __init__(self, down: str | None):
        self.engine = SimpleNamespace(health=lambda: down, close=lambda: None)

    limits = LIMITS
    has_work = False

    def stats(self):
        return {"running": 0, "waiting": 0}

    def idle(self):
        pass


class _BrokenBackend(EngineBackend):
    """An engine backend whose loop thread dies at its first iteration (its stats raise)."""

    def __init__(self):
        self.engine = None

    limits = LIMITS
    has_work = False

    def stats(self):
        raise RuntimeError("the backend broke")

    def idle(self):
        pass


@pytest.mark.parametrize("case", ["decode actor down", "dead engine loop", "all alive"])
def test_health_reflects_the_backend(case):
    if case == "dead engine loop":
        backend = _BrokenBackend()
    else:
        backend = _HealthBackend(None if case == "all alive" else "the decode actor is down")
    app = create_app(backend, TOK, MODEL)
    srv, thread, base = start_in_thread(app)
    try:
        port = int(base.rsplit(":", 1)[1])
        loop = app.state.loops[0]
        if case == "dead engine loop":
            loop._thread.join(10)
        status, text = _http(port, "GET", "/health", key=None)
        assert status == (200 if case == "all alive" else 503), (case, status, text)
        if case == "decode actor down":
            assert "the decode actor is down" in text
    finally:
        srv.should_exit = True
        thread.join(30)


# ---- 9. bounded under sustained load: requests in flight ----------------------------------------------------------
def test_requests_in_flight_are_bounded_and_one_more_is_503():
    """Item 9: nothing bounded the requests an HTTP server accepted; under sustained overload the engine's waiting
    queue (each entry a prompt of up to max_body_bytes) grew without limit. Now ``max_in_flight`` requests are open
    at once and one more gets 503 ``server_overloaded`` in OpenAI's shape, queueing nothing; slots come back."""
    backend = StubBackend(step_s=0.005)
    app = create_app(backend, TOK, MODEL, max_in_flight=2)
    srv, thread, base = start_in_thread(app)
    port = int(base.rsplit(":", 1)[1])
    streams = []
    try:
        for _ in range(2):  # two endless streams hold both slots
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stream": True,
                                                                "max_tokens": 4000}),
                         {"content-type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and r.readline().startswith(b"data: ")
            streams.append(conn)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        status, text = _http(port, "POST", "/v1/completions", body, key=None)
        assert status == 503 and _openai_error(text)["code"] == "server_overloaded", (status, text)
        assert len(backend.running) == 2  # the refused request never reached the engine
        streams.pop().close()  # a client goes away: its request is cancelled and its slot freed
        deadline = time.monotonic() + 30
        while (status := _http(port, "POST", "/v1/completions", body, key=None)[0]) == 503:
            assert time.monotonic() < deadline, "the closed stream's slot never came back"
            time.sleep(0.05)
        assert status == 200
    finally:
        for c in streams:
            c.close()
        srv.should_exit = True
        thread.join(30)
    with pytest.raises(ValueError, match="max_in_flight"):
        create_app(backend, TOK, MODEL, max_in_flight=0)
