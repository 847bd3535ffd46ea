"""Data-parallel replicas behind one HTTP endpoint: ``create_app`` over the engines of a ``ReplicatedEngine`` (one
engine-loop thread each), driven by the official ``openai`` client.

The reference tokens come from the same replicas in-process (``ReplicatedEngine.generate``) before the server takes
them over. Checked: concurrent streams complete with those tokens and both replicas serve some of them; ``/metrics``
sums the replicas (pages back to zero, every request counted once); a disconnect mid-stream frees the pages on the
replica that held them; the balancer's choice follows the tokens in flight (a hypothesis property).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import phaseserve as ps
from lab.eval.demo import default_model_path
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.server import EngineBackend, create_app
from phaseserve.server.launch import start_in_thread
from phaseserve.server.routing import Balancer
from tests.e2e.test_server import _idle, _metric

MODEL = "phaseserve-default"
TOK = ByteTokenizer()
N, TOKENS = 16, 10


class CountingBackend(EngineBackend):
    """An engine backend that counts the requests it was given."""

    def __init__(self, engine):
        super().__init__(engine)
        self.submitted = 0

    def submit(self, req):
        self.submitted += 1
        return super().submit(req)


@pytest.fixture(scope="module")
def replicated():
    cfg, params = ps.load_checkpoint(default_model_path(), "float32")
    serve = ps.ServeConfig(mode="colocated", quant=ps.QuantConfig("float32", "float32", "float32", "float32"),
                           cache=ps.CacheConfig(page_size=16, num_pages=400, max_pages_per_seq=16), max_batch=16)
    rep = ps.ReplicatedEngine(cfg, params, serve, replicas=2)
    rng = np.random.default_rng()  # fresh prompts every run
    prompts = [f"def f{int(rng.integers(1 << 20))}(x):\n    return x" + " +" * int(rng.integers(1, 9))
               for _ in range(N)]
    reqs = [ps.Request(id=f"ref{i}", prompt=TOK.encode(p, bos=True), max_tokens=TOKENS, ignore_eos=True)
            for i, p in enumerate(prompts)]
    reference = {p: TOK.decode(o.tokens, skip_special=True) for p, o in zip(prompts, rep.generate(reqs), strict=True)}
    for e in rep.engines:
        e.reset_metrics()
    backends = [CountingBackend(e) for e in rep.engines]
    app = create_app(backends, TOK, MODEL)
    srv, thread, base = start_in_thread(app)
    yield {"base": base, "port": int(base.rsplit(":", 1)[1]), "rep": rep, "backends": backends,
           "reference": reference, "loops": app.state.loops}
    srv.should_exit = True
    thread.join(30)
    rep.close()


async def _stream_all(base: str, prompts: list[str]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(p: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def test_concurrent_streams_over_two_replicas_equal_the_in_process_tokens(replicated):
    port, ref = replicated["port"], replicated["reference"]
    assert len(replicated["loops"]) == 2 and all(loop.alive for loop in replicated["loops"])
    name = f'phaseserve:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    before = [b.submitted for b in replicated["backends"]]
    texts = asyncio.run(_stream_all(replicated["base"], list(ref)))
    assert texts == list(ref.values())
    served = [b.submitted - n for b, n in zip(replicated["backends"], before, strict=True)]
    assert sum(served) == N and min(served) >= N // 4, served  # the balancer used both replicas
    assert _idle(port)  # the gauges sum both replicas: nothing running, no page held on either
    assert _metric(port, name) >= N  # every request counted once, from whichever replica ran it
    for e in replicated["rep"].engines:
        e.check_invariants()
        assert e.allocator.num_free == e.num_pages - 1


def test_a_disconnect_frees_the_pages_of_the_replica_that_held_them(replicated):
    port = replicated["port"]
    assert _idle(port)
    body = {"model": MODEL, "prompt": "def main():\n", "max_tokens": 150, "stream": True, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and any(r.readline().startswith(b"data: {") for _ in range(6))
    held = [e.num_pages - 1 - e.allocator.num_free for e in replicated["rep"].engines]
    assert sorted(held)[0] == 0 and sorted(held)[1] > 0, held  # one replica holds the request's pages
    # /metrics' gauges are set once per engine-loop iteration, after the step that sent the first token; that step's
    # decode may compile a new shape first (6 s alone, over 10 s on the shared 2-core machine: measured)
    end = time.monotonic() + 60
    while _metric(port, "phaseserve:kv_pages_used") != sum(held) and time.monotonic() < end:
        time.sleep(0.01)
    assert _metric(port, "phaseserve:kv_pages_used") == sum(held)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert _idle(port), "a disconnected stream kept its pages"
    for e in replicated["rep"].engines:
        e.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 50), st.integers(1, 50)), max_size=40), st.integers(1, 4))
def test_the_balancer_sends_each_request_to_the_fewest_tokens_in_flight(ops, n):
    bal = Balancer([object()] * n)
    inflight: list[tuple[int, ps.Request]] = []
    for k, (finish, plen, mt) in enumerate(ops):
        if finish and inflight:  # the oldest request in flight ends
            i, req = inflight.pop(0)
            bal.release(i, req)
        else:
            req = ps.Request(id=f"r{k}", prompt=[1] * plen, max_tokens=mt)
            expect = [sum(len(r.prompt) + r.max_tokens for j, r in inflight if j == i) for i in range(n)]
            i = bal.acquire(req)
            assert expect[i] == min(expect) and i == expect.index(min(expect))  # least loaded, ties to the lowest
            inflight.append((i, req))
        assert bal.load == [sum(len(r.prompt) + r.max_tokens for j, r in inflight if j == i) for i in range(n)]


def test_the_balancer_sends_a_cached_prefix_to_its_replica_within_the_slack():
    bal = Balancer([object()] * 2, page_size=4, affinity_slack=2.0)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]

    def req(k, prompt, mt=8, tenant=""):
        return ps.Request(id=f"a{k}", prompt=prompt, max_tokens=mt, tenant=tenant)

    first = req(0, shared + [1])
    assert bal.acquire(first) == 0
    assert bal.acquire(req(1, [5] * 9)) == 1  # no prefix held: the least loaded
    assert bal.acquire(req(2, shared + [2, 3])) == 0  # two pages held by replica 0, its load within 2x this one's
    assert bal.acquire(req(3, shared[:4] + [9] * 5)) == 0  # the first page alone matches
    assert bal.acquire(req(4, shared + [4], tenant="other")) == 1  # another tenant's chain: no match
    assert bal.affinity_hits == 2
    tight = Balancer([object()] * 2, page_size=4, affinity_slack=1.0)  # each request's load: 9 + 8 = 17
    assert [tight.acquire(req(k, shared + [k])) for k in range(3)] == [0, 0, 1]  # 17 - 0 <= 17; 34 - 0 > 17
    assert tight.load == [34, 17]
    assert tight.acquire(req(3, shared + [3])) == 1  # the chain now points at replica 1, the one that took it last
    full = Balancer([object()] * 2, page_size=4, capacity=1)
    assert [full.acquire(req(k, shared + [k])) for k in range(2)] == [0, 1]  # replica 0's batch is full
    assert full.affinity_hits == 0 and full.count == [1, 1]
    capped = Balancer([object()] * 2, page_size=4, entries=3)
    capped.acquire(req(21, shared * 3))
    assert len(capped.owner) == 3


def test_the_balancer_packs_the_first_replica_up_to_fill():
    """``fill``: requests go to the first replica below the mark (or to the running replica holding their prefix);
    once every replica runs ``fill`` requests, to the least loaded; a bad mark is refused."""
    def req(k, prompt=None, mt=8):
        return ps.Request(id=f"f{k}", prompt=prompt or [k % 5 + 1] * 9, max_tokens=mt)

    bal = Balancer([object()] * 2, fill=3)
    reqs = [req(k) for k in range(8)]
    assert [bal.acquire(r) for r in reqs[:6]] == [0, 0, 0, 1, 1, 1]
    assert bal.count == [3, 3]
    assert bal.acquire(req(6, mt=1)) == 0  # both at the mark: the least loaded (ties to the lowest)
    bal.release(1, reqs[3])
    assert bal.acquire(req(7)) == 1  # replica 1 fell below the mark
    bal.release(0, reqs[0])
    assert bal.acquire(req(8)) == 0
    spread = Balancer([object()] * 2)
    assert [spread.acquire(req(k)) for k in range(4)] == [0, 1, 0, 1]
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    aff = Balancer([object()] * 2, page_size=4, fill=4)
    a, b, c = req(10, shared + [1]), req(11, [2] * 9), req(12, [3] * 9)
    assert [aff.acquire(x) for x in (a, b, c)] == [0, 0, 0]
    aff.release(0, a)
    assert aff.acquire(req(13, shared + [2])) == 0  # its replica runs requests below the mark: there
    two = Balancer([object()] * 2, page_size=4, fill=2)
    first = req(20, [2] * 9)
    assert [two.acquire(x) for x in (first, req(21, [3] * 9), req(22, shared + [1]))] == [0, 0, 1]
    two.release(0, first)
    assert two.acquire(req(23, shared + [2])) == 1  # replica 0 is below the mark too, but replica 1 holds the prefix
    moved = Balancer([object()] * 2, page_size=4, fill=1)
    assert moved.acquire(req(14, shared + [1])) == 0 and moved.acquire(req(15, [4] * 9)) == 1
    moved.release(0, req(14, shared + [1]))
    assert moved.acquire(req(16, shared + [3])) == 0 and moved.affinity_hits == 1  # replica 0 idle, but the first
    idle = Balancer([object()] * 2, page_size=4, fill=1)
    held_by_1 = [idle.acquire(x) for x in (req(17, [2] * 9), req(18, shared + [1]))]
    idle.release(0, req(17, [2] * 9))
    idle.release(1, req(18, shared + [1]))
    assert held_by_1 == [0, 1] and idle.in_flight == 0
    assert idle.acquire(req(19, shared + [5])) == 1  # nothing runs anywhere: the replica holding the prefix
    with pytest.raises(ValueError, match="fill"):
        Balancer([object()] * 2, fill=0)


def test_the_server_config_builds_one_backend_per_replica():
    from phaseserve.server.launch import build_backend, compose

    base = ["model=tiny_mla", "mesh=single", "engine.mode=colocated", "quant=f32"]
    backends = build_backend(compose([*base, "mesh.replicas=2"]))
    assert isinstance(backends, list) and len(backends) == 2
    assert [{d.id for d in b.engine.decode_mesh.devices.flat} for b in backends] == [{0}, {1}]
    one = build_backend(compose(base))
    assert isinstance(one, EngineBackend) and one.engine.serve.mesh.replicas == 1
