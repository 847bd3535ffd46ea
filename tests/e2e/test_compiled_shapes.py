"""New padded shapes are compiled off the serving path (``phaseserve.engine.compiled.ShapeCache``): a prefill group
or decode batch whose shape is not compiled yet runs on a larger compiled shape while the exact one compiles in the
background, and its tokens are transformers' greedy tokens either way; warm-up compiles in place."""

from __future__ import annotations

import numpy as np
import pytest

import phaseserve as ps
from phaseserve.engine import Request
from phaseserve.engine.compiled import ShapeCache
from tests.e2e.engine_utils import hf_greedy, make_checkpoint, serve_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, cfg, params = make_checkpoint("deepseek_v3_grouped", tmp_path_factory.mktemp("shapes"), seed=3)
    return model, cfg, params


def _reqs(cfg, lengths, max_tokens, seed):
    rng = np.random.default_rng(seed)
    return [Request(id=f"s{seed}-{i}", prompt=rng.integers(0, cfg.vocab_size, n).tolist(), max_tokens=max_tokens,
                    ignore_eos=True) for i, n in enumerate(lengths)]


def test_a_new_shape_runs_on_a_compiled_cover_then_on_its_own(setup):
    model, cfg, params = setup
    engine = ps.Engine(cfg, params, serve_config("disaggregated", num_pages=96, page_size=4, max_batch=4))
    big = _reqs(cfg, [13, 11, 12, 9], 6, seed=0)  # prefill (4 rows, 16 tokens), decode 4 rows
    small = _reqs(cfg, [10], 6, seed=1)  # prefill (1, 16), decode 1 row: covered by the shapes above
    for reqs in (big, small):
        outs = engine.generate(reqs)
        for r, o in zip(reqs, outs, strict=True):
            assert o.tokens == hf_greedy(model, r), r.id
    pre, dec = engine.prefill.steps, engine.decode.steps
    assert pre.stats["cover"] >= 1 and dec.stats["cover"] >= 1, (pre.stats, dec.stats)
    pre.wait()
    dec.wait()
    assert pre.stats["background"] >= 1 and dec.stats["background"] >= 1 and not pre.errors and not dec.errors
    exact_before, covers = (pre.stats["exact"], dec.stats["exact"]), (pre.stats["cover"], dec.stats["cover"])
    again = _reqs(cfg, [10], 6, seed=2)  # the same shapes: now their own executables
    out = engine.generate(again)[0]
    assert out.tokens == hf_greedy(model, again[0])
    assert pre.stats["exact"] > exact_before[0] and dec.stats["exact"] > exact_before[1]
    assert (pre.stats["cover"], dec.stats["cover"]) == covers  # no cover needed any more


def test_a_group_with_no_compiled_cover_runs_in_halves_on_compiled_shapes(setup):
    """Four prompts arriving together make one (4 rows, 16 tokens, 4 pages) group; only (2, 16, 4) is compiled, so
    it runs as two covered halves (no compile in the serving loop), with transformers' greedy tokens, while its own
    shape compiles in the background."""
    model, cfg, params = setup
    engine = ps.Engine(cfg, params, serve_config("disaggregated", num_pages=96, page_size=4, max_batch=4))
    engine.prefill.warm(2, 16, 4)
    pre = engine.prefill.steps
    inline, batches = pre.stats["inline"], engine.metrics.prefill_batches
    reqs = _reqs(cfg, [13, 11, 12, 9], 4, seed=5)
    for r, o in zip(reqs, engine.generate(reqs), strict=True):
        assert o.tokens == hf_greedy(model, r), r.id
    assert pre.stats["inline"] == inline and pre.stats["cover"] == 0, pre.stats
    assert engine.metrics.prefill_batches - batches == 2
    pre.wait()  # the whole group's shape was queued for the background thread
    assert pre.ready((4, 16, 4)) and pre.stats["background"] >= 1 and not pre.errors


def test_without_a_cover_the_shape_compiles_in_place_and_warm_up_never_covers(setup):
    _, cfg, params = setup
    engine = ps.Engine(cfg, params, serve_config("colocated", num_pages=64, page_size=4, max_batch=2,
                                                 max_prefill_tokens=32))
    engine.generate(_reqs(cfg, [20], 2, seed=4))  # nothing compiled before: in place
    pre, dec = engine.prefill.steps, engine.decode.steps
    assert pre.stats["inline"] >= 1 and pre.stats["cover"] == 0
    assert not pre.ready((1, 16, 4)) and not dec.ready((1, 4))
    assert pre.cover((1, 16, 4)) is not None and dec.cover((1, 4)) is not None  # a request would run covered
    engine.prefill.warm(1, 16, 4)  # what Engine.warm_up calls: smaller than a compiled shape, yet compiled exactly
    engine.decode.warm(1, 4)
    assert pre.ready((1, 16, 4)) and dec.ready((1, 4))
    for steps in (pre, dec):
        assert steps.stats["cover"] == 0 and steps.stats["background"] == 0


def test_shape_cache_picks_the_smallest_ready_cover():
    class Step:
        def lower(self, *args):
            return self

        def compile(self):
            return "exe"

    cache = ShapeCache(Step(), "t", background=False)
    for key in [(8, 32, 16), (4, 64, 16), (4, 32, 32), (16, 16, 4)]:
        cache.executable(key, ())
    assert cache.cover((2, 32, 8)) == (8, 32, 16) or cache.cover((2, 32, 8)) == (4, 32, 32)
    assert cache.cover((2, 32, 8)) == min([(8, 32, 16), (4, 32, 32)], key=lambda k: (np.prod(k), k))
    assert cache.cover((32, 16, 4)) is None and cache.cover((1, 16, 4)) == (16, 16, 4)
    assert cache.choose((2, 32, 8), lambda k: ()) == (2, 32, 8)  # no background thread: compiled in place


def test_a_failed_background_compile_is_recorded_and_the_shape_then_compiles_in_the_caller():
    class Step:
        def __init__(self):
            self.args = None

        def lower(self, *args):
            self.args = args
            return self

        def compile(self):
            if self.args == ("abstract",):
                raise RuntimeError("no compile for you")
            return "exe"

    cache = ShapeCache(Step(), "t")
    cache.executable((8, 8), ("concrete",))
    assert cache.choose((4, 4), lambda k: ("abstract",)) == (8, 8)  # the cover; (4, 4) queued
    cache.wait()
    assert isinstance(cache.errors[(4, 4)], RuntimeError) and not cache.ready((4, 4))
    assert cache.choose((4, 4), lambda k: ("abstract",)) == (4, 4)  # not queued again: compiled in the caller
    assert cache.executable((4, 4), ("concrete",)) == "exe" and cache.stats["inline"] == 2
    cache.close()


class _CountingStep:
    def __init__(self):
        self.compiles = 0

    def lower(self, *args):
        return self

    def compile(self):
        self.compiles += 1
        return f"exe{self.compiles}"


def test_threads_meeting_one_new_shape_compile_it_once():
    import threading
    import time

    class SlowStep(_CountingStep):
        def compile(self):
            time.sleep(0.2)  # both threads arrive while the first compile runs
            return super().compile()

    step = SlowStep()
    cache = ShapeCache(step, "decode", background=False)  # as replicas sharing one cache compile in their callers
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.executable((8, 2), ("concrete",)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert step.compiles == 1 and got == ["exe1", "exe1"]
    assert cache.stats["inline"] == 1 and cache.stats["exact"] == 1
    cache.close()


def test_near_the_memory_map_limit_covers_stop_compiling_and_a_compile_is_refused(monkeypatch):
    """From MAP_USE_STOP of the kernel's memory-map limit a covered shape runs on its cover without queueing its own
    compile; from MAP_USE_REFUSE a shape with no cover raises CompileLimitError instead of compiling (which would
    crash the process); ready shapes keep running."""
    from phaseserve.engine import compiled

    step = _CountingStep()
    cache = ShapeCache(step, "t")
    cache.executable((8, 8), ())
    monkeypatch.setattr(compiled, "memory_map_use", lambda: 0.85)
    assert cache.choose((4, 4), lambda k: ()) == (8, 8)
    cache.wait()
    assert not cache.ready((4, 4)) and cache.stats["cover_at_limit"] == 1 and cache.stats["background"] == 0
    assert cache.executable((2, 2), ()) == "exe2"  # below the refusal: compiled in the caller
    monkeypatch.setattr(compiled, "memory_map_use", lambda: 0.97)
    with pytest.raises(compiled.CompileLimitError, match="memory-map limit"):
        cache.executable((16, 16), ())
    assert cache.executable((8, 8), ()) == "exe1" and step.compiles == 2
    monkeypatch.setattr(compiled, "memory_map_use", lambda: 0.5)
    assert cache.choose((4, 4), lambda k: ()) == (8, 8)  # met at the limit once: on its cover for good
    assert cache.choose((2, 4), lambda k: ()) == (8, 8)  # a new shape under the limit: queued
    cache.wait()
    assert cache.ready((2, 4)) and not cache.ready((4, 4)) and cache.stats["background"] == 1
    assert cache.stats["cover_at_limit"] == 2
    cache.close()


def test_a_shape_refused_at_the_map_limit_ends_only_its_request(setup, monkeypatch):
    """Serving near the limit: the request whose prefill shape has no compiled cover ends with the typed error,
    the one that fits a compiled shape gets transformers' greedy tokens."""
    from phaseserve.engine import compiled

    model, cfg, params = setup
    engine = ps.Engine(cfg, params, serve_config("disaggregated", num_pages=96, page_size=4, max_batch=4))
    engine.generate(_reqs(cfg, [13, 11], 3, seed=5))  # compiles prefill (2, 16, w) and decode (2, w)
    monkeypatch.setattr(compiled, "memory_map_use", lambda: 0.97)
    fits, too_long = _reqs(cfg, [10], 5, seed=6)[0], _reqs(cfg, [30], 5, seed=7)[0]
    out = {o.id: o for o in engine.generate([fits, too_long])}
    assert out[fits.id].tokens == hf_greedy(model, fits)
    assert out[too_long.id].finish_reason == "error"
    assert isinstance(out[too_long.id].error, compiled.CompileLimitError), out[too_long.id].error
