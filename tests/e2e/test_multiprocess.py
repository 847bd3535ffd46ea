"""Disaggregated serving across processes: a prefill server process and a decode server process (each with its
own CPU device, weights and cache), a router, and KV pulled over ``jax.experimental.transfer``.

- the two-process setup produces exactly the single-process engine's tokens (float32 weights, FP8 KV);
- faults end only the affected request: a cancel while its transfer is in flight (pages held until it lands),
  a replayed and a forged transfer descriptor (typed refusals), a killed decode process (typed errors, a fresh
  decode server serves on); no page is leaked on either side after draining, none is reissued early;
- the staging area's descriptor checks, one by one, in process;
- a two-process ``jax.distributed`` mesh on CPU runs a sharded computation.

Children are spawned (never forked) with ``JAX_PLATFORMS=cpu``; every wait has a timeout.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phaseserve as ps
from phaseserve.engine import CancelledError, Request
from phaseserve.serving import (
    ModelSpec,
    PeerDeadError,
    Router,
    ServerSpec,
    StaleDescriptorError,
)
from tests.e2e.engine_utils import F32, make_checkpoint, serve_config

FP8_KV = dataclasses.replace(F32, kv_dtype="float8_e4m3fn")
TTL = 30.0  # staging lease; the router frees staged KV itself when a request ends, so tests never wait on it


def _req(rid, length, max_tokens, seed):
    rng = np.random.default_rng(seed)
    return Request(id=rid, prompt=rng.integers(0, 96, length).tolist(), max_tokens=max_tokens, ignore_eos=True)


MIXED = [_req(f"m{i}", n, k, i) for i, (n, k) in enumerate([(1, 4), (9, 3), (5, 6), (12, 2), (3, 5), (7, 1)])]
VICTIM = _req("victim", 6, 8, 100)  # 4 pages of 4 tokens
BLOCKED = [_req(f"b{i}", 10, 10, 200 + i) for i in range(2)]  # 5 pages each: cannot fit beside the victim
LONG = [_req(f"k{i}", 4 + i, 24, 300 + i) for i in range(3)]
AFTER = [_req(f"a{i}", 3 + 2 * i, 5, 400 + i) for i in range(3)]
NORMAL = [_req(f"n{i}", 5 + i, 4, 500 + i) for i in range(2)]
TAMPERED = _req("t0", 6, 4, 600)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp_ckpt")
    _, cfg, params = make_checkpoint("deepseek_v3_grouped", path, seed=5)
    ref = ps.Engine(cfg, params, serve_config("disaggregated", quant=FP8_KV, max_batch=8)).generate(
        MIXED + [VICTIM] + BLOCKED + LONG + AFTER + NORMAL + [TAMPERED])
    assert all(o.finish_reason == "length" for o in ref)
    return str(path), {o.id: o.tokens for o in ref}


def _specs(path, num_pages, faults=None):
    serve = serve_config("disaggregated", quant=FP8_KV, num_pages=num_pages, max_batch=8)
    pre = ServerSpec(model=ModelSpec(checkpoint=path), serve=serve, staging_ttl_s=TTL, transfer_timeout_s=60.0,
                     faults=faults or {}, compilation_cache_dir=str(Path(path).parent / "jax_cache"))
    return pre, dataclasses.replace(pre, faults={})


def _drain(router, timeout_s=20.0):
    """Wait until both sides hold no pages (release messages may still be in the queues); return both stats."""
    end = time.monotonic() + timeout_s
    while True:
        pre, dec = router.stats("prefill"), router.stats("decode")
        if (pre["staging_pages_in_use"] == 0 and dec["pages_in_use"] == 0) or time.monotonic() > end:
            return pre, dec
        router.poll(0.2)


def _poll_until(router, cond, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        router.poll(0.01)


@pytest.fixture(scope="module")
def router(model):
    path, _ = model
    pre, dec = _specs(path, num_pages=9, faults={"arm_delay_s": {VICTIM.id: 3.0}})
    r = Router(pre, dec)
    yield r
    r.shutdown()


def test_two_processes_equal_the_single_process_engine(model, router):
    _, ref = model
    outs = router.generate(MIXED, timeout_s=120)
    assert {o.id: o.tokens for o in outs} == {r.id: ref[r.id] for r in MIXED}
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    pre, dec = _drain(router)
    assert pre["staging_pages_in_use"] == 0 and pre["staged"] == 0 and dec["pages_in_use"] == 0
    staged = [router.descriptors[r.id] for r in MIXED if r.max_tokens > 1]  # max_tokens=1 ends at prefill
    assert all(d.kv_dtype == "float8_e4m3fn" and d.leaves[0][1] == "float8_e4m3fn" for d in staged)
    assert dec["transfers"] >= len(staged) and dec["valid_kv_tokens"] >= sum(d.length for d in staged)
    assert "m5" not in router.descriptors


def test_cancel_during_transfer_holds_pages_until_it_lands(model, router):
    _, ref = model
    victim = router.submit(VICTIM)
    _poll_until(router, lambda: ("serve_reply", VICTIM.id) in router.seen)  # granted; the pull is now in flight
    blocked = [router.submit(r) for r in BLOCKED]  # need 5 of the 4 free pages: wait for the victim's pages
    router.poll(0.3)
    assert router.cancel(VICTIM.id)
    router.run(timeout_s=120)
    assert victim.finish_reason == "aborted" and isinstance(victim.error, CancelledError)
    assert {o.id: o.tokens for o in blocked} == {r.id: ref[r.id] for r in BLOCKED}
    _, dec = _drain(router)
    assert dec["pages_in_use"] == 0
    ev = [e for e in dec["events"] if e[2] in {VICTIM.id, *[r.id for r in BLOCKED]}]
    t = {(kind, rid): ts for ts, kind, rid, _ in ev}
    vpages = next(p for _, kind, rid, p in ev if kind == "alloc" and rid == VICTIM.id)
    assert t[("alloc", VICTIM.id)] < t[("cancel", VICTIM.id)] < t[("landed", VICTIM.id)], "cancel was not in flight"
    assert t[("landed", VICTIM.id)] <= t[("release", VICTIM.id)]
    reuse = [(ts, rid) for ts, kind, rid, p in ev if kind == "alloc" and rid != VICTIM.id and set(p) & set(vpages)]
    assert reuse, "no other request wanted the victim's pages: the test would not catch an early release"
    assert all(ts >= t[("release", VICTIM.id)] for ts, _ in reuse), "a page was reissued before its transfer landed"


def test_replayed_and_forged_descriptors_are_refused_alone(model, router):
    _, ref = model
    src = router.generate([_req("s0", 5, 2, 700)], timeout_s=120)[0]
    assert src.error is None
    replay = router.descriptors[src.id]  # consumed: landed and released
    router.tamper[TAMPERED.id] = lambda d: d.replace(tags=(d.tags[0] + 1,) + d.tags[1:])
    normal = [router.submit(r) for r in NORMAL]
    forged = router.submit(TAMPERED)
    replayed = router.inject(_req("s0", 5, 2, 700), 0, replay)  # the same request again: only the prefill side knows
    misnamed = router.inject(_req("replay", 5, 2, 700), 0, replay)  # another request's descriptor: the decode side
    router.run(timeout_s=120)
    assert isinstance(misnamed.error, StaleDescriptorError) and misnamed.error.kind == "mismatch"
    assert misnamed.finish_reason == "error"
    assert isinstance(replayed.error, StaleDescriptorError) and replayed.error.kind == "unknown"
    assert isinstance(forged.error, StaleDescriptorError) and forged.error.kind == "forged"  # its MAC fails
    assert replayed.finish_reason == forged.finish_reason == "aborted"
    assert {o.id: o.tokens for o in normal} == {r.id: ref[r.id] for r in NORMAL}
    pre, dec = _drain(router)  # the forged request's genuine staged KV is freed when the request ends
    assert pre["refused"].get("unknown", 0) >= 1 and pre["refused"].get("forged", 0) >= 1
    assert pre["staging_pages_in_use"] == 0 and pre["staged"] == 0 and dec["pages_in_use"] == 0


def test_killed_decode_ends_its_requests_and_serving_goes_on(model):
    path, ref = model
    pre, dec = _specs(path, num_pages=64)
    with Router(pre, dec) as router:
        outs = [router.submit(r) for r in LONG]
        _poll_until(router, lambda: any(len(o.tokens) >= 3 for o in outs))
        router.kill("decode")
        router.run(timeout_s=30)
        dead = [o for o in outs if isinstance(o.error, PeerDeadError)]
        assert dead and all(o.finish_reason == "aborted" for o in dead)
        assert all(o.tokens == ref[o.id][: len(o.tokens)] for o in outs)
        assert router.procs["prefill"].is_alive()
        router.restart("decode")
        after = router.generate(AFTER, timeout_s=120)
        assert {o.id: o.tokens for o in after} == {r.id: ref[r.id] for r in AFTER}
        pre_s, dec_s = _drain(router)
        assert pre_s["staging_pages_in_use"] == 0 and pre_s["staged"] == 0 and dec_s["pages_in_use"] == 0


def test_killed_prefill_mid_pull_ends_only_its_request_and_a_restart_serves(model):
    """Defects 5 and 6, and containment in the servers: the prefill server dies while the victim's pull is in flight;
    the victim ends with a typed transfer error, the bystander whose KV had landed finishes with its tokens, the
    decode server lives on; a restarted prefill server serves; a malformed prompt or message sent straight to a
    server ends nothing but itself; a prompt the staging area can never hold is refused at submission."""
    from phaseserve.engine.request import PromptTooLongError
    from phaseserve.serving.protocol import TransferError, TransferTimeoutError

    path, ref = model
    pre, dec = _specs(path, num_pages=64, faults={"arm_delay_s": {VICTIM.id: 60.0}})
    pre = dataclasses.replace(pre, staging_pages=6, transfer_timeout_s=8.0)
    dec = dataclasses.replace(dec, staging_pages=6, transfer_timeout_s=8.0)
    with Router(pre, dec) as router:
        too_long = router.submit(_req("huge", 30, 2, 1))  # 8 staging pages of 4 tokens: never fits in 6
        assert too_long.finish_reason == "error" and isinstance(too_long.error, PromptTooLongError)
        bystander = router.submit(LONG[0])
        _poll_until(router, lambda: len(bystander.tokens) >= 2)  # its KV has landed; it is decoding
        victim = router.submit(VICTIM)
        _poll_until(router, lambda: ("serve_reply", VICTIM.id) in router.seen)  # granted, never armed: in flight
        router.kill("prefill")
        router.run(timeout_s=60)
        assert victim.finish_reason == "aborted" and isinstance(victim.error, TransferError | TransferTimeoutError)
        assert bystander.finish_reason == "length" and bystander.tokens == ref[LONG[0].id]
        assert router.procs["decode"].is_alive() and "prefill" in router.dead
        router.restart("prefill")
        router.inboxes["prefill"].put(("prompt", Request(id="junk", prompt=[1, 2], seed=-1)))
        router.inboxes["prefill"].put(("no such message", 1, 2))
        router.inboxes["decode"].put(("kv_ready", "not a request", None, None))
        after = router.generate(AFTER, timeout_s=120)
        assert {o.id: o.tokens for o in after} == {r.id: ref[r.id] for r in AFTER}
        assert router.procs["prefill"].is_alive() and router.procs["decode"].is_alive()
        pre_s, dec_s = _drain(router)
        assert pre_s["bad_messages"] >= 2 and dec_s["bad_messages"] >= 1
        assert pre_s["staging_pages_in_use"] == 0 and dec_s["pages_in_use"] == 0


def test_staging_area_checks_each_descriptor_field():
    from phaseserve.serving.transfer import Puller, StagingArea, start_endpoint

    staging = StagingArea(start_endpoint(), num_pages=4, page_size=4, ttl_s=60.0)
    vals = jax.random.normal(jax.random.key(0), (8, 3)).astype(jnp.float8_e4m3fn)
    leaves = [vals, jnp.arange(8, dtype=jnp.float32)]
    d1 = staging.stage("a", leaves, 7, "float8_e4m3fn")
    d2 = staging.stage("b", leaves, 8, "float8_e4m3fn")
    assert staging.stage("c", leaves, 8, "float8_e4m3fn") is None and staging.pages_in_use == 4  # full
    kinds = {}
    for name, bad in [("wrong_server", d1.replace(server_id=d1.server_id + 1)),
                      ("unknown", d1.replace(uuid=d1.uuid + 100)), ("mismatch", d1.replace(request_id="b")),
                      ("stale_tag", d1.replace(tags=d2.tags))]:
        with pytest.raises(StaleDescriptorError) as e:
            staging.serve(bad)
        assert e.value.kind == "forged"  # altered after signing
        with pytest.raises(StaleDescriptorError) as e:
            staging.serve(staging.auth.sign(bad))  # re-signed by a key holder: each field still checked
        kinds[name] = e.value.kind
    assert kinds == {k: k for k in kinds}
    with pytest.raises(StaleDescriptorError) as e:  # a genuine descriptor asked for by another request
        staging.serve(d1, requester="b")
    assert e.value.kind == "mismatch"
    staging.serve(d1)
    with pytest.raises(StaleDescriptorError, match="already served"):
        staging.serve(d1)
    got = Puller(start_endpoint(), jax.devices()[0]).pull(d1)
    assert got[0].dtype == jnp.float8_e4m3fn and np.array_equal(np.asarray(got[0], np.float32),
                                                                 np.asarray(vals, np.float32))
    assert staging.release(d1.uuid) and not staging.release(d1.uuid)
    with pytest.raises(StaleDescriptorError) as e:
        staging.serve(d1)
    assert e.value.kind == "unknown"
    assert staging.expire(now=time.monotonic() + 61) == ["b"] and staging.pages_in_use == 0
    staging.allocator.check_invariants()


def test_two_process_jax_distributed_mesh_on_cpu():
    import multiprocessing as mp

    from phaseserve.serving.multihost import free_port, selfcheck_worker
    from phaseserve.serving.protocol import child_env

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    coord = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=selfcheck_worker, args=(i, 2, coord, q), daemon=True) for i in range(2)]
    with child_env(1):  # the child imports jax while unpickling its target: set its environment first
        for p in procs:
            p.start()
    try:
        results = [q.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(r[0] == "ok" for r in results), results
    expected = float(sum(x * x for x in [0, 1, 2, 3, 10, 11, 12, 13]))
    assert [r[1] for r in results] == [expected, expected]
    assert sorted(r[2]["process_index"] for r in results) == [0, 1]
    assert all(r[2]["global_devices"] == 2 and r[2]["local_devices"] == 1 and r[2]["spans"] == [0, 1]
               for r in results)
