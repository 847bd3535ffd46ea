"""Reliability of the in-process engine: no request can wedge it.

- bad requests (every field, every wrong type) end alone with a typed RequestError and the good requests of the same
  call get a fresh engine's tokens in that call (defects 1, 2), also as a Hypothesis property over arbitrary values;
- an exception while serving one request (prefill, decode, a lost page pool) ends only the affected requests with
  ``finish_reason="error"`` and the engine keeps serving;
- cancel/stream semantics: no token after cancel() returned True, a closed stream frees its pages at once,
  re-entrant generate() is refused, one set of finish reasons (defect 8);
- a ServeConfig with the default CacheConfig builds an engine (defect 7);
- FP8 KV with preemption="swap" gives the tokens of an unpreempted run (defect 9).
"""

from __future__ import annotations

import dataclasses
import math
import os

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import phaseserve as ps
from phaseserve.engine import CancelledError, Request, RequestError
from phaseserve.engine.engine import EngineBusyError
from phaseserve.engine.request import FINISH_REASONS, InvalidParameterError, InvalidRequestIdError
from tests.e2e.engine_utils import F32, make_checkpoint, random_requests, serve_config


def examples(ci: int) -> int:
    """Hypothesis examples per property: ``ci`` (bounded for CI), or ``PHASESERVE_HYPOTHESIS_EXAMPLES`` (the soak
    benchmark's longer run)."""
    return int(os.environ.get("PHASESERVE_HYPOTHESIS_EXAMPLES", ci))


FP8_KV = dataclasses.replace(F32, kv_dtype="float8_e4m3fn")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, cfg, params = make_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=3)
    return cfg, params


@pytest.fixture(scope="module")
def served(model):
    """One engine shared by the tests below (each leaves it drained), the good requests and a fresh engine's
    tokens for them."""
    cfg, params = model
    goods = random_requests(cfg.vocab_size, 4, seed=11, max_tokens=(3, 7))
    ref = {o.id: o.tokens for o in ps.Engine(cfg, params, serve_config(max_batch=4)).generate(goods)}
    return ps.Engine(cfg, params, serve_config(max_batch=4)), goods, ref


def _drained(eng):
    eng.check_invariants()
    return not eng.has_work and eng.allocator.num_free == eng.num_pages - 1


def test_bad_requests_end_alone_and_the_good_ones_run_in_the_same_call(served):
    eng, goods, ref = served
    bad = [Request(id="seed-neg", prompt=[1, 2], seed=-1), Request(id="seed-big", prompt=[1, 2], seed=2**32),
           Request(id="seed-str", prompt=[1, 2], seed="7"),
           Request(id="topk", prompt=[1, 2], top_k=2**31), Request(id="tenant-none", prompt=[1, 2], tenant=None),
           Request(id="tenant-int", prompt=[1, 2], tenant=5), Request(id="surrogate", prompt=[1], tenant="\udc00"),
           Request(id="temp-none", prompt=[1, 2], temperature=None), Request(id="stop-none", prompt=[1],
                                                                             stop_token_ids=None),
           Request(id="stop-int", prompt=[1], stop_token_ids=3), Request(id=["unhashable"], prompt=[1, 2]),
           Request(id="nan", prompt=[1, 2], temperature=math.nan), Request(id="bools", prompt=[True, False])]
    outs = eng.generate(goods[:2] + bad + goods[2:])
    for o in outs[2:-2]:
        assert o.finish_reason == "error" and isinstance(o.error, RequestError) and o.tokens == [], (o.id, o.error)
    assert isinstance(outs[2 + 10].error, InvalidRequestIdError) and isinstance(outs[2].error, InvalidParameterError)
    assert {o.id: o.tokens for o in outs[:2] + outs[-2:]} == ref  # in this call, not the next
    assert not eng.cancel(["unhashable"]) and not eng.cancel(None)
    assert _drained(eng)
    assert {o.id: o.tokens for o in eng.generate(goods)} == ref  # the engine still serves
    numpy_ids = [g.replace(prompt=np.asarray(g.prompt, np.int64)) for g in goods]
    assert {o.id: o.tokens for o in eng.generate(numpy_ids)} == ref


ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.text(max_size=3),
                st.lists(st.integers(-2, 100), max_size=3))
ARBITRARY = st.builds(
    Request, id=st.one_of(st.text(max_size=4).map(lambda t: "x" + t), ANY),
    prompt=st.one_of(ANY, st.lists(st.integers(0, 95), min_size=1, max_size=8),
                     st.lists(st.one_of(st.booleans(), st.floats(), st.integers(-1, 200)), min_size=1, max_size=4)),
    max_tokens=st.one_of(ANY, st.integers(1, 4)), temperature=st.one_of(ANY, st.floats(0, 2)),
    top_p=st.one_of(ANY, st.floats(0, 1)), top_k=ANY, seed=st.one_of(ANY, st.integers(0, 2**32 - 1)),
    stop_token_ids=ANY, ignore_eos=ANY, tenant=st.one_of(ANY, st.text(max_size=3)))


@settings(max_examples=examples(10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(ARBITRARY, min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_property_arbitrary_requests_mixed_with_good_ones(served, arbitrary, rnd):
    eng, goods, ref = served
    mixed = goods + arbitrary
    rnd.shuffle(mixed)
    outs = eng.generate(mixed)
    for r, o in zip(mixed, outs, strict=True):
        if r in goods:
            assert o.finish_reason == "length" and o.tokens == ref[r.id], (r.id, o.error)
        elif o.finish_reason == "error":
            assert isinstance(o.error, RequestError) and o.tokens == []
        else:  # an arbitrary request that happens to be valid runs normally
            assert o.finish_reason in ("length", "stop") and 1 <= len(o.tokens) <= r.max_tokens
    assert _drained(eng)


def test_an_exception_while_serving_ends_only_its_requests(served, monkeypatch):
    eng, goods, ref = served
    cfg = eng.cfg
    boom = Request(id="boom", prompt=[5, 6, 7], max_tokens=4, ignore_eos=True)
    bang = Request(id="bang", prompt=[8, 9], max_tokens=6, ignore_eos=True)
    launch = eng.prefill.launch

    def prefill_launch(group):
        if any(s.id == "boom" for s in group):
            raise RuntimeError("prefill exploded")
        return launch(group)

    def decode_fault(engine, rows):
        if any(s.id == "bang" for s in rows) and len(engine.outputs["bang"].tokens) >= 2:
            raise FloatingPointError("decode exploded")

    monkeypatch.setattr(eng.prefill, "launch", prefill_launch)
    eng.fault_hooks.append(decode_fault)
    try:
        outs = {o.id: o for o in eng.generate(goods[:2] + [boom, bang] + goods[2:])}
    finally:
        eng.fault_hooks.remove(decode_fault)
    assert outs["boom"].finish_reason == "error" and isinstance(outs["boom"].error, RuntimeError)
    assert outs["boom"].tokens == []
    assert outs["bang"].finish_reason == "error" and isinstance(outs["bang"].error, FloatingPointError)
    assert len(outs["bang"].tokens) == 2
    assert {g.id: outs[g.id].tokens for g in goods} == ref
    assert _drained(eng) and eng.summary()["requests"] >= 6
    del cfg


class _FailsOnFetch:
    """A launched step's output whose fetch raises (an error the device raised while the engine decoded)."""

    def __array__(self, *a, **kw):
        raise RuntimeError("prefill failed on the device")


def test_a_prefill_that_fails_when_collected_ends_only_its_request(served, monkeypatch):
    """The overlapped prefill's error surfaces only when its result is fetched, steps after the launch: the group is
    retried in halves then, and only the failing request ends."""
    from phaseserve.engine.workers import Launched

    eng, goods, ref = served
    boom = Request(id="boom2", prompt=[5, 6, 7], max_tokens=4, ignore_eos=True)
    launch = eng.prefill.launch
    launches = []

    def prefill_launch(group):
        launches.append(len(group))
        if any(c.id == "boom2" for c in group):
            return Launched(_FailsOnFetch(), None, None, rows=len(group))
        return launch(group)

    monkeypatch.setattr(eng.prefill, "launch", prefill_launch)
    outs = {o.id: o for o in eng.generate(goods[:2] + [boom] + goods[2:])}
    assert outs["boom2"].finish_reason == "error" and isinstance(outs["boom2"].error, RuntimeError)
    assert outs["boom2"].tokens == []
    assert {g.id: outs[g.id].tokens for g in goods} == ref
    assert max(launches) > 1 and 1 in launches  # a group with it was launched, then narrowed to it alone
    assert _drained(eng)


def test_a_request_cancelled_while_its_prefill_computes_is_dropped_when_collected(served):
    eng, goods, ref = served
    eng.add_request(goods[0])
    eng.step()  # goods[0] decoding
    eng.add_request(goods[1])
    eng.step()  # goods[1]'s prefill launched; goods[0] decoded meanwhile
    assert [c.id for f in eng._inflight for c in f.group] == [goods[1].id]
    assert eng.cancel(goods[1].id)
    eng.prefill.block()
    eng.step()  # collected: the cancelled request's row is dropped, nothing handed off or emitted
    assert not eng._inflight and eng.outputs[goods[1].id].tokens == []
    assert eng.outputs[goods[1].id].finish_reason == "aborted"
    while eng.has_work:
        eng.step()
    assert eng.outputs[goods[0].id].tokens == ref[goods[0].id]
    assert _drained(eng) and eng.prefill.allocator.num_free == eng.prefill.num_pages - 1


def test_a_lost_page_pool_ends_the_running_requests_and_is_rebuilt(served):
    eng, goods, ref = served
    fired = []

    def lose_pool(engine, rows):
        if not fired:
            fired.append(len(rows))
            for x in jax.tree.leaves(engine.pool):
                x.delete()
            raise RuntimeError("device call consumed the donated pool")

    eng.fault_hooks.append(lose_pool)
    try:
        outs = eng.generate(goods)
    finally:
        eng.fault_hooks.remove(lose_pool)
    assert fired == [len(goods)] and all(o.finish_reason == "error" for o in outs)
    assert eng.decode.pool_ok() and _drained(eng)
    assert {o.id: o.tokens for o in eng.generate(goods)} == ref


def test_no_token_after_cancel_and_a_closed_stream_frees_its_pages(served):
    eng, goods, ref = served
    got: dict[str, list[int]] = {g.id: [] for g in goods}
    cancelled = None
    for rid, tok in eng.stream(goods):
        if cancelled is None:  # the first token: cancel another request whose token is in the same step
            cancelled = next(g.id for g in goods if g.id != rid)
            assert eng.cancel(cancelled)
        else:
            assert rid != cancelled, "a token was yielded after cancel() returned True"
        got[rid].append(tok)
    out = eng.outputs[cancelled]
    assert out.finish_reason == "aborted" and isinstance(out.error, CancelledError) and out.tokens == got[cancelled]
    assert all(got[g.id] == ref[g.id] for g in goods if g.id != cancelled)
    stream = eng.stream(goods)
    next(stream)
    stream.close()
    assert _drained(eng), "a closed stream kept its pages"
    assert all(eng.outputs[g.id].finish_reason == "aborted" for g in goods)


def test_generate_inside_a_stream_is_refused(served):
    eng, goods, ref = served
    stream = eng.stream(goods[:2])
    first = next(stream)
    with pytest.raises(EngineBusyError):
        eng.generate(goods[2:])
    with pytest.raises(EngineBusyError):
        next(eng.stream(goods[2:]))
    got = {g.id: [] for g in goods[:2]}
    for rid, tok in [first, *stream]:
        got[rid].append(tok)
    assert got == {g.id: ref[g.id] for g in goods[:2]}
    assert all(o.finish_reason in FINISH_REASONS for o in eng.outputs.values())
    assert FINISH_REASONS == ("length", "stop", "aborted", "error")
    assert {o.id: o.tokens for o in eng.generate(goods)} == ref and _drained(eng)


def test_default_cache_config_builds_an_engine(model):
    cfg, params = model
    from phaseserve.cache.paged import pages_for_budget
    from phaseserve.config import DEFAULT_CPU_KV_BYTES

    eng = ps.Engine(cfg, params, ps.ServeConfig(quant=F32))
    assert eng.num_pages == pages_for_budget(cfg, "float32", 16, DEFAULT_CPU_KV_BYTES) > 2


def test_fp8_swap_preemption_gives_the_tokens_of_an_unpreempted_run(model):
    cfg, params = model
    reqs = random_requests(cfg.vocab_size, 6, seed=4, min_len=5, max_len=9, max_tokens=(10, 14))
    ref = ps.Engine(cfg, params, serve_config(quant=FP8_KV, max_batch=6)).generate(reqs)
    cache = ps.CacheConfig(page_size=4, num_pages=14, max_pages_per_seq=16, admission="on_demand",
                           preemption="swap")
    eng = ps.Engine(cfg, params, ps.ServeConfig(quant=FP8_KV, max_batch=6, cache=cache))
    outs = eng.generate(reqs)
    assert eng.metrics.preemptions > 0 and eng.swap_stats["swap_ins"] == eng.swap_stats["swap_outs"] > 0
    assert eng.swap_stats["bytes"] > 0
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert _drained(eng)
