"""Disaggregated serving on Ray (``experiment.backend=ray``): prefill and decode actors on two Ray nodes.

One module-wide deployment: a ``ray.cluster_utils.Cluster`` with two nodes on this machine (the head offers the
custom resource ``prefill``, the second node ``decode``), the server built the way ``python -m phaseserve.server
experiment.backend=ray`` builds it (``launch.build_backend``), and the in-process engine of the same config as the
reference. Checks: 32 concurrent streams through the official ``openai`` client give the in-process engine's greedy
text, each actor runs on its own node; killing the decode actor mid-stream ends the streams in flight (typed
``PeerDeadError``), /health is 503 until Ray has restarted it and 200 after, new requests get the reference text
again, no page is left held on either side; prefix reuse works on the Ray path; a forged or replayed transfer
descriptor is refused with a typed ``StaleDescriptorError`` (``ForgedDescriptorError`` when altered after signing).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time

import jax
import numpy as np
import openai
import pytest
import ray

import phaseserve as ps
from lab.bench.ray_cluster import ray_server_config, two_node_cluster
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.distributed.protocol import ForgedDescriptorError, StaleDescriptorError
from phaseserve.distributed.transfer import DescriptorAuth
from phaseserve.engine import Engine
from phaseserve.server import EngineBackend, create_app
from phaseserve.server.launch import build_backend, compose, start_in_thread

MODEL = "phaseserve-default"
TOK = ByteTokenizer()
OVERRIDES = ["engine.max_batch=32", "cache.num_pages=640"]
PROMPTS = [f"def f{i}(x):\n    return x * {i} + " for i in range(32)]


def _serve(backend):
    app = create_app(backend, TOK, MODEL)
    srv, thread, base = start_in_thread(app)
    return app, srv, thread, base


@pytest.fixture(scope="module")
def deployment():
    yield from serve_on_two_nodes()


def serve_on_two_nodes(extra: list[str] = ()):
    """The module deployment (a generator for a module fixture): the Ray-backed server on two nodes and the
    in-process reference server, with ``extra`` overrides for the Ray one; torn down after its yield."""
    cluster = two_node_cluster()
    cfg = ray_server_config(cluster, OVERRIDES + list(extra))
    backend = build_backend(cfg)
    engine = backend.engine
    engine.warm_handoff()
    app, srv, thread, base = _serve(backend)
    ref = Engine.from_hydra(compose(OVERRIDES))
    ref_app, ref_srv, ref_thread, ref_base = _serve(EngineBackend(ref))
    yield {"engine": engine, "cluster": cluster, "base": base, "ref_base": ref_base, "app": app, "ref_app": ref_app}
    for s, t in ((srv, thread), (ref_srv, ref_thread)):
        s.should_exit = True
        t.join(30)
    engine.close()
    ray.shutdown()
    cluster.shutdown()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def _stream(base: str, prompt: str, max_tokens: int = 16) -> str:
    stream = _client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in stream if c.choices)


def _texts(deployment: dict, side: str, prompts: list[str], max_tokens: int = 16) -> list[str]:
    """Concurrent greedy streams from ``side`` ("base": Ray, "ref_base": in process), admitted in one engine step.

    The CPU matmuls are not bit-identical across batch compositions, so a near-tie greedy token may differ between
    two engines that happened to batch the same requests differently. The engine loop is held (``run_exclusive``)
    until every request waits in its inbox, so both servers start the burst from the same batch."""
    loop = deployment["app" if side == "base" else "ref_app"].state.loops[0]
    gate = threading.Event()
    held = loop.run_exclusive(lambda backend: gate.wait(300))
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        try:
            _until(held.running, "the engine loop to be held")
            futs = [pool.submit(_stream, deployment[side], p, max_tokens) for p in prompts]
            _until(lambda: loop.queued >= len(prompts), "every request to wait in the inbox")
        finally:
            gate.set()
        assert held.result(timeout=60)
        return [f.result(timeout=300) for f in futs]


def _until(cond, what: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def _health(base: str) -> int:
    conn = http.client.HTTPConnection(base.split("//")[1].split(":")[0], int(base.rsplit(":", 1)[1]), timeout=30)
    conn.request("GET", "/health")
    status = conn.getresponse().status
    conn.close()
    return status


def _in_loop(app, fn):
    """``fn(engine)`` in the engine loop's thread, once nothing is in flight."""
    return app.state.loops[0].run_exclusive(lambda b: fn(b.engine)).result(timeout=300)


def _no_leaks(engine) -> None:
    engine.check_invariants()
    assert engine.allocator.num_used == 0 and engine.prefill.allocator.num_used == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    staged = engine.prefill.snapshot()  # staged KV is released once landed
    assert staged["staged"] == 0 and staged["staging_pages_in_use"] == 0, staged


def test_32_concurrent_streams_on_two_nodes_equal_the_in_process_engine(deployment):
    engine = deployment["engine"]
    nodes = {p: w.info["node_id"] for p, w in engine.phases.items()}
    assert nodes["prefill"] != nodes["decode"]  # each phase on its own Ray node (custom resources)
    assert nodes["prefill"] == deployment["cluster"].head_node.node_id
    got = _texts(deployment, "base", PROMPTS, max_tokens=10)
    want = _texts(deployment, "ref_base", PROMPTS, max_tokens=10)
    assert got == want
    assert all(len(TOK.encode(t)) >= 6 for t in got)
    assert engine.handoff.bytes_moved > 0
    _in_loop(deployment["app"], _no_leaks)


def test_prefix_reuse_on_the_ray_path(deployment):
    prefix = "# shared system prompt, long enough for whole pages of KV to be reused by later requests.\n" * 2
    reqs = lambda tag: [ps.Request(id=f"{tag}{i}", prompt=TOK.encode(prefix + f"x{i} =", bos=True),  # noqa: E731
                                   max_tokens=8) for i in range(4)]

    def run(engine):
        engine.generate(reqs("warm"))  # registers the prefix pages
        hits = engine.scheduler.hit_pages
        outs = engine.generate(reqs("p"))
        return [o.tokens for o in outs], engine.scheduler.hit_pages - hits

    tokens, hits = _in_loop(deployment["app"], run)
    ref_tokens, ref_hits = _in_loop(deployment["ref_app"], run)
    assert hits >= 4 * 2 and hits == ref_hits  # every request found the shared pages cached, as in process
    assert tokens == ref_tokens
    _in_loop(deployment["app"], _no_leaks)


def test_a_forged_or_replayed_descriptor_is_refused_typed(deployment):
    def forge(engine):
        staged = engine.prefill.export([0])  # the null page, staged for a pull
        desc = staged.descriptor
        out = {}
        auth = DescriptorAuth()  # the driver's copy of the deployment secret the actors were given
        for name, bad in (("stale_tag", desc.replace(tags=tuple(t + 1 for t in desc.tags))),
                          ("unknown", desc.replace(uuid=desc.uuid + 10**6)),
                          ("mismatch", desc.replace(length=desc.length + 1))):
            with pytest.raises(ForgedDescriptorError):  # altered after the prefill actor signed it
                engine.prefill.call("arm", bad, desc.request_id)
            with pytest.raises(StaleDescriptorError) as e:  # re-signed: the staged-field checks beneath
                engine.prefill.call("arm", auth.sign(bad), desc.request_id)
            assert not isinstance(e.value, ForgedDescriptorError)
            out[name] = e.value.kind
        engine.decode.land([0], staged)  # the genuine one lands (and is released)
        with pytest.raises(StaleDescriptorError) as e:
            engine.prefill.call("arm", desc, desc.request_id)  # a replay of a consumed descriptor
        out["replayed"] = e.value.kind
        assert engine.prefill.pool_ok() and engine.decode.pool_ok()  # refusals are typed errors, not deaths
        return out

    kinds = _in_loop(deployment["app"], forge)
    assert kinds == {"stale_tag": "stale_tag", "unknown": "unknown", "mismatch": "mismatch", "replayed": "unknown"}
    _in_loop(deployment["app"], _no_leaks)


def test_killing_the_decode_actor_mid_stream_ends_only_those_streams_and_the_service_heals(deployment):
    engine, base = deployment["engine"], deployment["base"]
    deaths = engine.decode.deaths
    started: set[str] = set()
    all_started = concurrent.futures.Future()

    def long_stream(prompt: str) -> int:
        stream = _client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        n = 0
        for c in stream:
            n += len(c.choices[0].text) if c.choices else 0
            if n and prompt not in started:
                started.add(prompt)
                if len(started) == 4:
                    all_started.set_result(True)
        return n

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futs = [pool.submit(long_stream, p) for p in PROMPTS[:4]]
        all_started.result(timeout=180)  # every stream has text: its request is decoding
        ray.kill(engine.actors["decode"], no_restart=False)
        errors = []
        for f in futs:
            with pytest.raises(openai.APIError) as e:
                f.result(timeout=120)
            errors.append(str(e.value))
        assert all("PeerDeadError" in m for m in errors), errors
        statuses = [_health(base)]
        late_prompt = "class Late:\n    value = "  # new to both servers: no prefix hit on either side
        late = pool.submit(_stream, base, late_prompt)  # sent while the actor is down: waits, then is served
        end = time.monotonic() + 240
        while time.monotonic() < end and not (statuses[-1] == 200 and 503 in statuses):
            time.sleep(0.2)
            statuses.append(_health(base))
        assert 503 in statuses and statuses[-1] == 200, statuses[-5:]
        assert late.result(timeout=240) == _stream(deployment["ref_base"], late_prompt)
    assert engine.decode.deaths == deaths + 1 and engine.prefill.deaths == 0
    # served by the restarted actor, the same greedy text. Prompts neither server has seen: the restarted actor's
    # prefix cache is empty, and a prompt that hits cached pages on one side only is computed in other chunks there
    fresh = [f"class C{i}:\n    value = {i} * " for i in range(4)]
    assert _texts(deployment, "base", fresh) == _texts(deployment, "ref_base", fresh)
    _in_loop(deployment["app"], _no_leaks)


def test_a_lost_pool_of_a_restarting_worker_requeues_what_emitted_nothing():
    """The engine's side of a worker death, without Ray: a decode pool lost by a worker that restarts
    (``requeue_lost``) ends the request that streamed tokens and requeues the one still prefilling, which then
    gives the tokens it gives alone; nothing leaks."""
    from tests.e2e.engine_utils import serve_config

    cfg, params = ps.load_checkpoint("models/default", dtype="float32")
    serve = serve_config("colocated", max_prefill_tokens=16, page_size=16, num_pages=64)
    a = ps.Request(id="a", prompt=TOK.encode("import os", bos=True), max_tokens=20, ignore_eos=True)
    b = ps.Request(id="b", prompt=TOK.encode("def long_prompt(x):\n    return x * 2 + 1  # chunked", bos=True),
                   max_tokens=6, ignore_eos=True)
    alone = Engine(cfg, params, serve).generate([b])[0].tokens
    engine = Engine(cfg, params, serve)
    engine.decode.requeue_lost = True  # as a remote worker's: its actor restarts with an empty pool
    out_a = engine.add_request(a)
    while not out_a.tokens:
        engine.step()
    out_b = engine.add_request(b)
    engine.step()  # b is admitted; its prompt needs several chunks of 16 tokens
    seq_b = engine._seqs["b"]
    assert seq_b.prefilling and not out_b.tokens

    def lose_pool(eng, rows):
        for x in jax.tree.leaves(eng.decode.pool):
            x.delete()
        raise RuntimeError("the decode worker died")

    engine.fault_hooks.append(lose_pool)
    engine.step()  # b's next chunk, then a's decode step loses the pool
    engine.fault_hooks.clear()
    assert out_a.finish_reason == "aborted" and "died" in str(out_a.error)
    assert seq_b in engine.scheduler.waiting and seq_b.computed == 0 and "b" not in engine.tables
    while engine.has_work:
        engine.step()
    assert out_b.finish_reason == "length" and out_b.tokens == alone
    engine.check_invariants()
    assert engine.allocator.num_used == 0 and engine.prefill.tables.allocator.num_used == 0


def _post(base: str, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection(base.split("//")[1].split(":")[0], int(base.rsplit(":", 1)[1]), timeout=300)
    conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    status, out = r.status, json.loads(r.read())
    conn.close()
    assert status == 200, out
    return out


def test_scoring_and_logprobs_over_ray_equal_the_in_process_engine(deployment):
    """lm-eval's loglikelihood request (token ids, echo, logprobs, max_tokens=0) and generated tokens' logprobs come
    back from the actors' jitted steps through Ray as the in-process engine computes them."""
    ids = TOK.encode("def add(a, b):\n    return a + b\n", bos=True)
    bodies = [{"model": MODEL, "prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0},
              {"model": MODEL, "prompt": "def mul(a, b):\n", "logprobs": 2, "max_tokens": 6, "temperature": 0,
               "ignore_eos": True}]
    for body in bodies:
        got, want = (_post(deployment[b], "/v1/completions", body)["choices"][0] for b in ("base", "ref_base"))
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        g, w = (np.array([np.nan if v is None else v for v in c["logprobs"]["token_logprobs"]]) for c in (got, want))
        assert len(g) == (len(ids) if body["max_tokens"] == 0 else 6) and np.isfinite(g[-1])
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert [sorted(d) for d in got["logprobs"]["top_logprobs"][1:]] == \
               [sorted(d) for d in want["logprobs"]["top_logprobs"][1:]]
    _in_loop(deployment["app"], _no_leaks)
