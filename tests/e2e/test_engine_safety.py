"""Serving safety of the in-process engine and its server loop (issue #42, items 7-9).

- the same request id submitted from several threads at once is accepted once (the others get a
  DuplicateRequestError) and the engine finishes every request and frees every page;
- a duplicate id at the engine loop does not orphan the first request's handle;
- ``generate()`` interrupted by an exception (KeyboardInterrupt included) aborts its requests and frees their pages;
- ``Engine.outputs`` and the run metrics (``Engine.metrics``) stay bounded while the engine is never idle;
- ``validate`` compares the prompt's length with the context before it looks at the tokens one by one.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import time

import pytest

import phaseserve as ps
from phaseserve.engine import Request
from phaseserve.engine import engine as engine_module
from phaseserve.engine.request import DuplicateRequestError, Limits, PromptTooLongError, Sequence, validate
from phaseserve.server.loop import EngineBackend, EngineLoop
from tests.e2e.engine_utils import make_checkpoint, serve_config


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    _, cfg, params = make_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=5)
    return ps.Engine(cfg, params, serve_config(mode="colocated", max_batch=4))


def _drained(eng) -> bool:
    eng.check_invariants()
    return not eng.has_work and eng.allocator.num_free == eng.num_pages - 1


def _run(eng, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if not eng.has_work:
            return
        eng.step()
    raise AssertionError(f"the engine still has work after {max_steps} steps")


def test_the_same_id_from_many_threads_is_accepted_once(eng, monkeypatch):
    def slow_sequence(**kw):  # widen the window between the id check and the insert (a thread switch there)
        time.sleep(0.002)
        return Sequence(**kw)

    monkeypatch.setattr(engine_module, "Sequence", slow_sequence)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for round_ in range(3):
            rid, n = f"same{round_}", 8
            barrier = threading.Barrier(n)
            outs = []

            def submit(rid=rid, barrier=barrier, outs=outs):
                barrier.wait()
                outs.append(eng.add_request(Request(id=rid, prompt=list(range(1, 40)), max_tokens=3,
                                                    ignore_eos=True)))

            threads = [threading.Thread(target=submit) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            accepted = [o for o in outs if o.finish_reason is None]
            refused = [o for o in outs if o.finish_reason is not None]
            assert len(accepted) == 1, f"round {round_}: {len(accepted)} submissions of one id were accepted"
            assert all(isinstance(o.error, DuplicateRequestError) for o in refused)
            _run(eng)
            assert accepted[0].finish_reason == "length" and len(accepted[0].tokens) == 3
            assert _drained(eng)
    finally:
        sys.setswitchinterval(old)


def test_a_duplicate_id_at_the_engine_loop_does_not_orphan_the_first_handle(eng):
    loop = EngineLoop(EngineBackend(eng))

    async def both():
        first = loop.submit(Request(id="dup", prompt=[1, 2, 3], max_tokens=6, ignore_eos=True))
        second = loop.submit(Request(id="dup", prompt=[4, 5], max_tokens=6, ignore_eos=True))

        async def final(h):
            while not (up := await h.get()).final:
                pass
            return up.done

        return await asyncio.wait_for(asyncio.gather(final(first), final(second)), timeout=20)

    try:
        a, b = asyncio.run(both())
    finally:
        loop.close()
    assert a.finish_reason == "length" and len(a.tokens) == 6
    assert b.finish_reason == "error" and isinstance(b.error, DuplicateRequestError)
    assert _drained(eng)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_aborts_its_requests_and_frees_their_pages(eng, monkeypatch, exc):
    real_step, calls = eng.step, []

    def step(*a, **kw):  # one real step (the requests hold pages, some are running), then the caller is interrupted
        calls.append(1)
        if len(calls) > 1:
            raise exc("the caller was interrupted")
        return real_step(*a, **kw)

    monkeypatch.setattr(eng, "step", step)
    reqs = [Request(id=f"int{i}", prompt=[1 + i, 2, 3], max_tokens=8, ignore_eos=True) for i in range(3)]
    with pytest.raises(exc):
        eng.generate(reqs)
    monkeypatch.undo()
    assert all(eng.outputs[r.id].finish_reason == "aborted" for r in reqs)
    assert _drained(eng), "an interrupted generate() left its requests running"
    assert [len(o.tokens) for o in eng.generate(reqs)] == [8, 8, 8]  # the engine serves on (and is not busy)


def test_outputs_stay_bounded_while_the_engine_is_never_idle(eng, monkeypatch):
    monkeypatch.setattr(eng, "keep_finished", 4)
    for i in range(24):  # always one request in flight: the engine is never idle
        eng.add_request(Request(id=f"busy{i}", prompt=[1, 2, 3, 4, 5], max_tokens=3, ignore_eos=True))
        eng.step()
        eng.step()
        assert len(eng.outputs) <= 4 + len(eng.scheduler.running) + len(eng.scheduler.waiting) + 1
    _run(eng)
    assert _drained(eng)


def test_run_metrics_stay_bounded_while_the_engine_is_never_idle(eng):
    """Item 9: ``RunMetrics`` kept one sample per engine step (``running_samples``), reset only when a served engine
    went idle: a server that is never idle grew it forever."""
    eng.reset_metrics()
    sizes = []
    for i in range(160):  # always requests in flight: the engine is never idle
        if len(eng.scheduler.running) + len(eng.scheduler.waiting) < 2:
            eng.add_request(Request(id=f"steady{i}", prompt=[1, 2, 3, 4, 5], max_tokens=6, ignore_eos=True))
        eng.step()
        sizes.append(len(pickle.dumps(eng.metrics)))
    assert eng.metrics.decode_steps > 100 and eng.summary()["mean_concurrency"] > 1.0
    assert sizes[-1] - sizes[20] < 16, f"the run metrics grew from {sizes[20]} to {sizes[-1]} bytes in 140 steps"
    _run(eng)
    assert _drained(eng)


def test_validate_compares_the_prompt_length_with_the_context_first():
    limits = Limits(vocab_size=96, max_context=64, page_size=4, max_pages=16)
    huge = [10**9] * 2_000_000  # every token is out of the vocabulary too: the length is what is reported
    with pytest.raises(PromptTooLongError):
        validate(Request(id="huge", prompt=huge), limits)
