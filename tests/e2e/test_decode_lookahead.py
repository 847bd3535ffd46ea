"""The decode step launched ahead (``ServeConfig.decode_lookahead``): the decode worker launches the next step
before reading this one's tokens, the sampled tokens fed on the device, and uses it only when the host's next step
has exactly its inputs. Outputs equal those of the engine without it, under staggered arrivals, sampling, logprobs
and on-demand page growth; a fault injected between two steps still ends only the victim; the pages a step ahead
may have written NaN into are scrubbed with the rest. A prefix hit's one-token suffix, or a whole cached prompt's last
token, runs as a decode row (``ServeConfig.decode_hit_suffix``) with the tokens its prefill gives."""

from __future__ import annotations

import types

import numpy as np
import pytest

import phaseserve as ps
from lab.faults import FaultInjector
from phaseserve.cache.allocator import PageAllocator, PageTables
from phaseserve.cache.integrity import KVIntegrityError
from phaseserve.engine.request import NonFiniteLogitsError
from phaseserve.engine.sampling import NONFINITE_ATTENTION, NONFINITE_TOKEN
from phaseserve.engine.workers import pages_to_scrub
from tests.e2e.engine_utils import make_checkpoint, random_requests, serve_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, cfg, params = make_checkpoint("deepseek_v3_grouped", tmp_path_factory.mktemp("mla"), seed=3)
    return cfg, params


def _requests(vocab: int) -> list[ps.Request]:
    reqs = random_requests(vocab, 8, seed=5, min_len=3, max_len=14, max_tokens=(4, 16))
    reqs[1] = ps.Request(id="sampled", prompt=reqs[1].prompt, max_tokens=12, temperature=0.9, top_p=0.9, seed=11,
                         ignore_eos=True)
    reqs[2] = ps.Request(id="logprobs", prompt=reqs[2].prompt, max_tokens=9, logprobs=2, ignore_eos=True)
    return reqs


def _serve(engine: ps.Engine, reqs: list[ps.Request]) -> dict[str, tuple]:
    """Half the requests at once, the rest one per engine step from the third step on (staggered arrivals)."""
    first, later = reqs[:4], list(reqs[4:])
    for r in first:
        engine.add_request(r)
    steps = 0
    while engine.has_work or later:
        if later and steps >= 2:
            engine.add_request(later.pop(0))
        engine.step()
        steps += 1
    return {r.id: (engine.outputs[r.id].tokens, engine.outputs[r.id].finish_reason,
                   engine.outputs[r.id].logprobs) for r in reqs}


@pytest.mark.parametrize("admission", ["reserve", "on_demand"])
def test_same_outputs_with_and_without_the_step_ahead(model, admission):
    cfg, params = model
    reqs = _requests(cfg.vocab_size)
    outs, stats = {}, {}
    for ahead in (True, False):
        eng = ps.Engine(cfg, params, serve_config(max_batch=4, admission=admission, num_pages=64,
                                                  decode_lookahead=ahead))
        outs[ahead] = _serve(eng, reqs)
        stats[ahead] = eng.decode.lookahead_stats
        assert eng.allocator.num_free == eng.num_pages - 1
        eng.check_invariants()
    assert outs[True] == outs[False]
    assert all(reason == "length" for _, reason, _ in outs[True].values())
    # on demand, a row's next position is often past its pages (they grow a step at a time): fewer launched
    assert stats[True]["used"] > (10 if admission == "reserve" else 0) and stats[False]["used"] == 0
    assert stats[True]["used"] > stats[True]["dropped"]
    if admission == "reserve":  # every row ends by length and each arrival joins the step after a pending one
        assert stats[True]["dropped"] == 0


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_prefix_hits_one_token_suffix_is_a_decode_row(model, lookahead):
    """``decode_hit_suffix``: a fresh prompt whose hit leaves one token, or a prompt of whole pages cached to its last
    page (that page copied into the request's own), runs its last token in the decode step, not in a prefill launch:
    the same tokens (greedy and seeded sampling) and logprobs as its prefill; a longer suffix, a whole-page prompt
    whose last page is not cached, and a request asking for prompt logprobs still prefill. Rows joining while a step
    ahead is pending wait for the next step instead of dropping it (no launch ahead is dropped in a run that ends
    every row by length)."""
    cfg, params = model
    rng = np.random.default_rng(21)
    prefix = rng.integers(0, cfg.vocab_size, 8).tolist()  # 2 full pages of 4
    req = lambda rid, tail, **kw: ps.Request(id=rid, prompt=prefix + tail, ignore_eos=True,  # noqa: E731
                                             **{"max_tokens": 10, **kw})
    reqs = [req("one", [3]), req("two", [4, 5]), req("sampled", [6], temperature=0.8, seed=4),
            req("whole", [1, 2, 3, 4], logprobs=2), req("prompt_lp", [8], prompt_logprobs=1), req("again", [3]),
            req("whole_sampled", [1, 2, 3, 4], temperature=0.7, seed=2), req("uncached_page", [5, 6, 7, 8]),
            req("late", [9], max_tokens=6), req("later", [2], logprobs=1)]
    saved = {"one": 1, "sampled": 1, "whole": 4, "again": 1, "whole_sampled": 4, "late": 1, "later": 1}
    outs, prefilled, stats = {}, {}, {}
    for suffix in (True, False):
        eng = ps.Engine(cfg, params, serve_config(max_batch=8, num_pages=96, retain_prefixes=True,
                                                  decode_lookahead=lookahead, decode_hit_suffix=suffix))
        eng.generate([req("seed", [1, 2, 3, 4], max_tokens=2)])  # three whole pages, retained
        before = eng.metrics.prefill_tokens
        outs[suffix] = _serve(eng, reqs)
        prefilled[suffix] = eng.metrics.prefill_tokens - before
        stats[suffix] = dict(eng.decode.lookahead_stats)
        assert {r.id: eng.outputs[r.id].metrics.prefix_hit_tokens for r in reqs} == {
            r.id: 0 if r.prompt_logprobs is not None else 8 for r in reqs}  # prompt logprobs skip prefix hits
        assert eng.allocator.num_free == eng.num_pages - 1
        eng.check_invariants()
    for rid, (tokens, reason, lps) in outs[False].items():
        assert outs[True][rid][:2] == (tokens, reason), rid
        if lps is not None:
            np.testing.assert_allclose([lp.logprob for lp in outs[True][rid][2]], [lp.logprob for lp in lps],
                                       rtol=1e-4, atol=1e-5)
    assert prefilled[False] - prefilled[True] == sum(saved.values())
    if lookahead:
        assert stats[True]["used"] > 0 and stats[True]["dropped"] == 0


def test_warm_up_compiles_the_page_copy_of_every_join_count(model):
    """A whole cached prompt's last page is copied on the decode mesh when its request joins; the warm-up compiles
    that copy for 1, 2, .. bucket(max_batch) pages, so a step's joins never compile it while requests wait."""
    cfg, params = model
    eng = ps.Engine(cfg, params, serve_config(max_batch=4, num_pages=32))
    before = (eng.decode._gather._cache_size(), eng.decode._put._cache_size())
    eng.warm_handoff()
    warmed = (eng.decode._gather._cache_size(), eng.decode._put._cache_size())
    assert warmed == (before[0] + 3, before[1] + 3)  # 1, 2 and 4 pages
    eng.decode.copy_pages([1, 2, 3], [4, 5, 6])
    assert (eng.decode._gather._cache_size(), eng.decode._put._cache_size()) == warmed


@pytest.fixture(scope="module")
def fault_run(model):
    """Four requests and their fault-free tokens."""
    cfg, params = model
    reqs = random_requests(cfg.vocab_size, 4, seed=9, min_len=5, max_len=9, max_tokens=(10, 13))
    return reqs, {o.id: o.tokens for o in ps.Engine(cfg, params, serve_config(max_batch=4)).generate(reqs)}


@pytest.mark.parametrize("kind", ["point_at_free_page", "free_behind", "double_allocate", "poison_data"])
def test_fault_between_two_steps_ends_only_the_victim(model, fault_run, kind):
    """A fault injected while a step ahead is pending: that step is dropped (it ran on the inputs before the
    fault) and the step the host launches instead catches it; every other request is unaffected."""
    cfg, params = model
    reqs, ref = fault_run
    eng = ps.Engine(cfg, params, serve_config(max_batch=4))
    seen = {"n": 0}

    def fault(engine, rows):
        seen["n"] += 1
        if seen["n"] != 4:
            return
        seen["ahead"] = engine.decode._ahead is not None
        seen["tokens"] = len(engine.outputs["r1"].tokens)
        seen["dropped"] = engine.decode.lookahead_stats["dropped"]
        inj = FaultInjector(engine.tables)
        if kind == "point_at_free_page":
            inj.point_at_free_page("r1", 0)
        elif kind == "free_behind":
            inj.free_behind("r1", 0)
        elif kind == "double_allocate":
            inj.double_allocate("r1", 0, "r3")
        else:
            engine.pool = inj.poison(engine.pool, 1, engine.tables.owned("r1")[0], 1, target="data")

    eng.fault_hooks.append(fault)
    outs = {o.id: o for o in eng.generate(reqs)}
    assert seen["ahead"]  # a step was launched ahead when the fault came
    assert eng.decode.lookahead_stats["dropped"] > seen["dropped"]
    victim = outs["r1"]
    if kind == "poison_data":  # NaN read from a page: a non-finite attention output, not a page-tag failure
        assert victim.finish_reason == "error" and isinstance(victim.error, NonFiniteLogitsError)
    else:
        assert victim.finish_reason == "aborted" and isinstance(victim.error, KVIntegrityError)
    assert len(victim.tokens) == seen["tokens"]  # caught in the step the host launched after the fault
    assert victim.tokens == ref["r1"][: len(victim.tokens)]
    for rid in ("r0", "r2", "r3"):
        assert outs[rid].finish_reason == "length" and outs[rid].tokens == ref[rid], rid
    assert eng.allocator.num_free == eng.num_pages - 1
    eng.check_invariants()


def test_pages_a_step_ahead_may_have_written_are_scrubbed():
    """A row whose logits went non-finite wrote NaN into its token's page; a step launched ahead of reading that
    token wrote its next position too, which can be the next page."""
    tables = PageTables(PageAllocator(16), max_pages_per_seq=4)
    tables.add("a")
    owned = tables.allocate("a", 3)
    row = types.SimpleNamespace(id="a", next_position=7)  # page size 4: position 7 ends page 1, 8 starts page 2
    nxt = np.array([NONFINITE_TOKEN], np.int32)
    assert pages_to_scrub(tables, 4, [row], nxt) == [owned[1]]
    assert pages_to_scrub(tables, 4, [row], nxt, ahead=True) == [owned[1], owned[2]]
    row.next_position = 5  # both positions in page 1
    assert pages_to_scrub(tables, 4, [row], nxt, ahead=True) == [owned[1]]
    assert pages_to_scrub(tables, 4, [row], np.array([3], np.int32), ahead=True) == []
    # a row whose attention output was NaN/inf may have read it from any of its pages: all of them
    assert pages_to_scrub(tables, 4, [row], np.array([NONFINITE_ATTENTION], np.int32)) == owned


def test_decode_lookahead_must_be_a_bool():
    with pytest.raises(ps.ConfigError, match="decode_lookahead"):
        ps.ServeConfig(decode_lookahead="yes")
