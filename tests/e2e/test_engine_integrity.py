"""End-to-end integrity: each fault of ``FaultInjector`` injected into a live decode batch ends only the victim, in
the very step it would first read the bad page: a bookkeeping fault (the page-tag or range check fails) as
``aborted`` with a ``KVIntegrityError``, NaN/inf poisoned into a page as ``error`` with a ``NonFiniteLogitsError``
(``where="attention"``: the guard zeroed its attention output; not counted as an integrity abort). Every other
request's tokens equal the fault-free run's, and after draining no page is leaked."""

from __future__ import annotations

import dataclasses

import pytest

import phaseserve as ps
from lab.faults import FaultInjector
from phaseserve.cache.integrity import KVIntegrityError
from phaseserve.engine.request import NonFiniteLogitsError
from tests.e2e.engine_utils import F32, make_checkpoint, random_requests, serve_config

FP8_KV = dataclasses.replace(F32, kv_dtype="float8_e4m3fn")
VICTIM, INJECT_AT = "r2", 3  # the decode step (1-based) before which the fault is injected


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    _, cfg, params = make_checkpoint("deepseek_v3_grouped", tmp_path_factory.mktemp("mla"), seed=7)
    reqs = random_requests(cfg.vocab_size, 5, seed=21, min_len=5, max_len=10, max_tokens=(9, 12))
    ref = ps.Engine(cfg, params, serve_config(quant=FP8_KV, max_batch=5)).generate(reqs)
    return cfg, params, reqs, {o.id: o.tokens for o in ref}


def _inject(kind: str):
    def fault(engine, rows):
        inj = FaultInjector(engine.tables)
        if kind == "point_at_free_page":
            inj.point_at_free_page(VICTIM, 0)
        elif kind == "free_behind":
            inj.free_behind(VICTIM, 1)
        elif kind == "point_at_other":
            inj.point_at_other(VICTIM, 0, "r0", 0)
        elif kind == "point_out_of_range":
            inj.point_out_of_range(VICTIM, 1)
        elif kind == "double_allocate":
            inj.double_allocate(VICTIM, 0, "r4")
        elif kind in ("poison_data", "poison_scale"):
            page = engine.tables.owned(VICTIM)[0]
            engine.pool = inj.poison(engine.pool, 1, page, 2, target=kind.split("_")[1])
        else:
            raise ValueError(kind)

    return fault


def _run(cfg, params, reqs, hook=None):
    eng = ps.Engine(cfg, params, serve_config(quant=FP8_KV, max_batch=5))
    steps = {"n": 0, "tokens_at_injection": None}

    def counting(engine, rows):
        steps["n"] += 1
        if hook is not None and steps["n"] == INJECT_AT:
            steps["tokens_at_injection"] = len(engine.outputs[VICTIM].tokens)
            hook(engine, rows)

    eng.fault_hooks.append(counting)
    outs = {o.id: o for o in eng.generate(reqs)}
    return eng, outs, steps


FAULTS = ["point_at_free_page", "free_behind", "point_at_other", "point_out_of_range", "double_allocate",
          "poison_data", "poison_scale"]


@pytest.mark.parametrize("kind", FAULTS)
def test_fault_aborts_only_the_victim(setup, kind):
    cfg, params, reqs, ref = setup
    eng, outs, steps = _run(cfg, params, reqs, _inject(kind))
    victim = outs[VICTIM]
    poison = kind.startswith("poison")
    assert victim.finish_reason == ("error" if poison else "aborted"), (kind, victim.finish_reason)
    if poison:
        assert isinstance(victim.error, NonFiniteLogitsError) and victim.error.where == "attention", victim.error
    else:
        assert isinstance(victim.error, KVIntegrityError)
    assert len(victim.tokens) == steps["tokens_at_injection"]  # caught in the step that would read it
    assert victim.tokens == ref[VICTIM][: len(victim.tokens)]
    for rid, o in outs.items():
        if rid != VICTIM:
            assert o.finish_reason == "length" and o.tokens == ref[rid], (kind, rid)
    summary = eng.summary()
    assert (summary["aborted"], summary["nonfinite_errors"]) == ((0, 1) if poison else (1, 0))
    assert eng.allocator.num_free == eng.num_pages - 1  # drained: nothing leaked
    eng.check_invariants()


def test_tag_wraparound_in_a_live_run_flags_nothing(setup):
    cfg, params, reqs, ref = setup
    eng = ps.Engine(cfg, params, serve_config(quant=FP8_KV, max_batch=5))
    FaultInjector(eng.tables).seed_tag_counter(2**32 - 4)
    outs = eng.generate(reqs)
    assert eng.allocator.epoch >= 1  # the counter really wrapped during the run
    assert {o.id: o.tokens for o in outs} == ref
    assert all(o.finish_reason == "length" for o in outs) and eng.metrics.integrity_checks > 0
    assert eng.allocator.num_free == eng.num_pages - 1
