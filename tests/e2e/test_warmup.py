"""``Engine.warm_up`` compiles every shape serving can run: afterwards, requests of every size the deployment admits
(single and batched, chunked prompts, prefix hits, logprobs, scoring) lower and compile nothing.

Counted with ``jax.monitoring``: each jit cache miss lowers a module (``jaxpr_to_mlir_module_duration``) and then
compiles it or reads it from the persistent cache. A small deployment (2 rows, a 64-token context, 32-token prefill
budget) keeps the shape count, and the test, small.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax._src import dispatch

import phaseserve as ps
from phaseserve.engine import Request
from tests.e2e.engine_utils import make_checkpoint, serve_config


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    _, cfg, params = make_checkpoint("llama", tmp_path_factory.mktemp("warm"), seed=2)
    serve = serve_config("disaggregated", page_size=16, num_pages=12, max_batch=2, max_context=64,
                         max_prefill_tokens=32)
    return ps.Engine(cfg, params, serve)


class Compiles:
    """Counts the modules lowered (jit cache misses) while it is on."""

    def __init__(self):
        self.on, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name: str, _secs: float, **_) -> None:
        if self.on and name == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
            self.count += 1


def test_no_request_compiles_after_warm_up(engine):
    counts = engine.warm_up()
    # prefill: (1|2 rows x 1 token) + (1|2 rows x 16) + (1 x 32), all 4 pages wide; decode: 1|2 rows x 4 pages
    assert counts["prefill_shapes"] == 5 and counts["decode_shapes"] == 2
    rng = np.random.default_rng(0)
    vocab = engine.cfg.vocab_size
    shared = rng.integers(0, vocab, 33).tolist()

    def req(i, n, m, **kw):
        return Request(id=f"r{i}", prompt=rng.integers(0, vocab, n).tolist(), max_tokens=m, ignore_eos=True, **kw)

    batches = [[req(0, 3, 4)], [req(1, 20, 6), req(2, 5, 30)], [req(3, 60, 3)],  # 60 tokens: 2 chunks
               [Request(id="p1", prompt=shared + [1], max_tokens=20, ignore_eos=True),
                Request(id="p2", prompt=shared + [2], max_tokens=20, ignore_eos=True)],  # a prefix hit
               [req(4, 9, 5, logprobs=3, prompt_logprobs=2), req(5, 40, 0, prompt_logprobs=0)],
               [req(6, 17, 4, temperature=1.0, top_p=0.9, top_k=5)]]
    probe = Compiles()
    probe.on = True
    try:
        for batch in batches:
            outs = engine.generate(batch)
            assert all(o.finish_reason == "length" for o in outs), [(o.id, o.error) for o in outs]
    finally:
        probe.on = False
    assert probe.count == 0, f"{probe.count} modules were compiled while serving after warm_up"
    assert engine.summary()["prefill_tokens_saved"] > 0  # the prefix hit happened


def test_the_probe_sees_a_compile():
    """The counter is live: a fresh shape compiles once."""
    probe = Compiles()
    probe.on = True
    jax.jit(lambda x: x * 3 + 1)(np.zeros(7, np.float32))
    probe.on = False
    assert probe.count >= 1


def test_the_cpu_default_warm_up_still_compiles_the_tag_updates(tmp_path):
    """``experiment.warmup=none`` (the CPU default) compiles the handoff's chunk sizes and the integrity tracker's
    tag-update sizes, both cheap; a guidellm sweep on an INT4 server otherwise compiled ``jit(_set_tags)`` inside
    its timed run. A pool of 13 pages gives tag arrays of a shape no other test compiles."""
    from phaseserve.cache.integrity import _set_tags_donated
    from phaseserve.server import EngineBackend
    from phaseserve.server.launch import warm_up

    _, cfg, params = make_checkpoint("llama", tmp_path, seed=3)
    eng = ps.Engine(cfg, params, serve_config("colocated", page_size=16, num_pages=13, max_batch=2, max_context=64))
    before = _set_tags_donated._cache_size()
    warm_up([EngineBackend(eng)], "none")
    assert _set_tags_donated._cache_size() - before == eng.decode.warm_tags() > 0


def test_warm_up_stops_short_of_the_memory_map_limit(monkeypatch, tmp_path):
    """Past the kernel's memory-map limit the next XLA CPU compile segfaults (measured: ~140 prefill shapes of the
    race's model reach the default 65,530 maps), so warm-up stops at ``MAP_USE_STOP`` of it, decode shapes first, and
    says how many it left; the engine then compiles those on first use and serves the same tokens."""
    from phaseserve.engine import compiled
    from phaseserve.engine import engine as engine_module

    use = compiled.memory_map_use()
    assert use is not None and 0 < use < 1  # this Linux process holds some maps, and is alive: under the limit
    _, cfg, params = make_checkpoint("llama", tmp_path, seed=3)
    serve = serve_config("disaggregated", page_size=16, num_pages=12, max_batch=2, max_context=64,
                         max_prefill_tokens=32)
    calls = []

    def fake_use():  # the limit is reached after three shapes
        calls.append(1)
        return 0.5 if len(calls) <= 3 else 0.85

    monkeypatch.setattr(engine_module, "memory_map_use", fake_use)
    eng = ps.Engine(cfg, params, serve)
    seen = []
    counts = eng.warm_up(lambda phase, shape, seconds: seen.append((phase, shape, seconds)))
    assert counts["decode_shapes"] == 2 and counts["prefill_shapes"] == 1 and counts["shapes_left"] == 4, counts
    assert [p for p, _, _ in seen] == ["decode_shapes"] * 2 + ["prefill_shapes"] and all(t > 0 for *_, t in seen)
    monkeypatch.undo()
    rng = np.random.default_rng(1)
    reqs = [Request(id=f"m{i}", prompt=rng.integers(0, cfg.vocab_size, n).tolist(), max_tokens=5, ignore_eos=True)
            for i, n in enumerate((3, 40))]
    got = [o.tokens for o in eng.generate(reqs)]
    want = [o.tokens for o in ps.Engine(cfg, params, serve).generate(reqs)]
    assert got == want and all(len(t) == 5 for t in got)
