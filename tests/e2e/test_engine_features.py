"""Engine behaviour beyond HF parity: modes agree, FP8 KV agreement and capacity, preemption, prefix reuse with
tenant salts, streaming, cancellation, sampling, bad input, and the no-op tracker's zero cost."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import phaseserve as ps
from phaseserve.cache.integrity import NoopTracker
from phaseserve.engine import (
    CancelledError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidParameterError,
    InvalidTokenError,
    PromptTooLongError,
    Request,
)
from phaseserve.engine.decode_step import decode_step
from tests.e2e.engine_utils import F32, make_checkpoint, random_requests, serve_config

FP8_KV = dataclasses.replace(F32, kv_dtype="float8_e4m3fn")


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    _, cfg, params = make_checkpoint("deepseek_v3_grouped", tmp_path_factory.mktemp("mla"), seed=5)
    return cfg, params


def _tokens(outs):
    return [o.tokens for o in outs]


def test_disaggregated_equals_colocated_with_fp8_kv(mla):
    cfg, params = mla
    reqs = random_requests(cfg.vocab_size, 6, seed=1)
    a = ps.Engine(cfg, params, serve_config("disaggregated", quant=FP8_KV)).generate(reqs)
    b = ps.Engine(cfg, params, serve_config("colocated", quant=FP8_KV)).generate(reqs)
    assert _tokens(a) == _tokens(b)
    assert all(o.finish_reason == "length" for o in a)


def test_fp8_pages_admit_twice_the_requests_under_one_budget(mla):
    """Kimi K2's latent width (512 + 64 = 576 values per token per layer) on a tiny model: the FP8 scale costs
    4 bytes per 576, so one byte budget holds ~2x the pages and the scheduler admits ~2x the requests."""
    cfg, _ = mla
    cfg = cfg.replace(kv_lora_rank=512, qk_rope_head_dim=64, head_dim=cfg.qk_nope_head_dim + 64)
    params = ps.init_params(cfg, jax.random.key(0))
    from phaseserve.cache.paged import kv_bytes_per_page

    page_size = 4
    budget = 24 * kv_bytes_per_page(cfg, "bfloat16", page_size)  # 24 BF16 pages
    reqs = [Request(id=f"c{i}", prompt=[(7 * i + j) % cfg.vocab_size for j in range(6)], max_tokens=3,
                    ignore_eos=True) for i in range(40)]
    peaks, pages = {}, {}
    for kv in ("bfloat16", "float8_e4m3fn"):
        serve = ps.ServeConfig(quant=dataclasses.replace(F32, kv_dtype=kv), max_batch=64,
                               cache=ps.CacheConfig(page_size=page_size, kv_budget_bytes=budget,
                                                    max_pages_per_seq=8))
        eng = ps.Engine(cfg, params, serve)
        outs = eng.generate(reqs)
        assert all(o.finish_reason == "length" for o in outs)
        peaks[kv], pages[kv] = eng.summary()["peak_concurrency"], eng.num_pages
    print("pages and peak admitted concurrency under one KV budget:", pages, peaks)
    assert peaks["bfloat16"] >= 10 and peaks["float8_e4m3fn"] >= 2 * peaks["bfloat16"]


def test_on_demand_preemption_keeps_tokens_and_leaks_nothing(mla):
    cfg, params = mla
    reqs = random_requests(cfg.vocab_size, 6, seed=4, min_len=5, max_len=9, max_tokens=(10, 14))
    ref = ps.Engine(cfg, params, serve_config(max_batch=6)).generate(reqs)
    eng = ps.Engine(cfg, params, serve_config(max_batch=6, admission="on_demand", num_pages=14))
    outs = eng.generate(reqs)
    assert eng.metrics.preemptions > 0
    assert _tokens(outs) == _tokens(ref)
    assert eng.allocator.num_free == eng.num_pages - 1
    eng.check_invariants()


def test_prefix_pages_are_shared_within_a_tenant_only(mla):
    cfg, params = mla
    rng = np.random.default_rng(9)
    prefix = rng.integers(0, cfg.vocab_size, 12).tolist()  # 3 full pages of 4
    first = [Request(id="p0", prompt=prefix + [5], max_tokens=12, ignore_eos=True)]
    later = [Request(id=f"p{i}", prompt=prefix + rng.integers(0, cfg.vocab_size, i).tolist(), max_tokens=4,
                     ignore_eos=True, tenant="t1" if i == 3 else "") for i in (1, 2, 3)]
    eng = ps.Engine(cfg, params, serve_config(max_batch=4))
    eng.add_request(first[0])
    eng.step()  # p0 prefilled and registered; the others arrive while it runs
    outs = eng.generate(later)
    hits = {o.id: o.metrics.prefix_hit_tokens for o in outs}
    assert hits == {"p1": 12, "p2": 12, "p3": 0}, hits  # p3 is another tenant: never a hit
    assert eng.summary()["prefix_hit_rate"] > 0
    ref = ps.Engine(cfg, params, dataclasses.replace(serve_config(max_batch=4))).generate(later)
    assert _tokens(outs) == _tokens(ref)
    assert eng.allocator.num_free == eng.num_pages - 1
    eng.check_invariants()


def test_a_finished_requests_prompt_pages_serve_later_hits(mla):
    """With ``retain_prefixes``, prefix pages outlive their request (retained in the free queue): the same prompt later
    hits them and gives the tokens it gave the first time, and a prompt sharing the prefix hits too."""
    cfg, params = mla
    rng = np.random.default_rng(12)
    prefix = rng.integers(0, cfg.vocab_size, 12).tolist()  # 3 full pages of 4
    req = lambda rid, tail, n=6: Request(id=rid, prompt=prefix + tail, max_tokens=n, ignore_eos=True)  # noqa: E731
    eng = ps.Engine(cfg, params, serve_config(max_batch=4, num_pages=24, retain_prefixes=True))
    first = eng.generate([req("a", [5])])[0]
    assert eng.allocator.num_free == eng.num_pages - 1  # retained pages count as free
    again = eng.generate([req("b", [5]), req("c", [7, 8])])
    assert {o.id: o.metrics.prefix_hit_tokens for o in again} == {"b": 12, "c": 12}
    assert again[0].tokens == first.tokens
    assert eng.allocator.num_free == eng.num_pages - 1  # (reissue and scrubbing: tests/unit/test_scheduler.py)
    eng.check_invariants()


def test_streaming_and_cancellation(mla):
    cfg, params = mla
    reqs = random_requests(cfg.vocab_size, 4, seed=6, max_tokens=(8, 9))
    ref = {o.id: o.tokens for o in ps.Engine(cfg, params, serve_config()).generate(reqs)}
    eng = ps.Engine(cfg, params, serve_config())
    got: dict[str, list[int]] = {r.id: [] for r in reqs}
    for rid, tok in eng.stream(reqs):
        got[rid].append(tok)
        if rid == "r1" and len(got[rid]) == 3:
            assert eng.cancel("r1")
    assert got["r1"] == ref["r1"][:3]
    assert eng.outputs["r1"].finish_reason == "aborted" and isinstance(eng.outputs["r1"].error, CancelledError)
    for r in ("r0", "r2", "r3"):
        assert got[r] == ref[r] == eng.outputs[r].tokens
    assert not eng.cancel("r1") and eng.allocator.num_free == eng.num_pages - 1


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_after_prefill_sees_first_tokens_before_the_steps_decode(mla, mode):
    """``step(after_prefill=...)`` runs once the round's prefill emitted the new requests' first tokens and before
    its decode step: the new request holds one token, the running ones not yet this round's; the tokens are those
    of a run without the hook. Here each step waits for its prefill (``overlap_prefill=False``). The new rows join
    the decode step after the one launched ahead for the running row (used, not dropped)."""
    cfg, params = mla
    reqs = random_requests(cfg.vocab_size, 3, seed=11, max_tokens=(6, 7))
    ref = {o.id: o.tokens for o in ps.Engine(cfg, params, serve_config(mode)).generate(reqs)}
    eng = ps.Engine(cfg, params, serve_config(mode, overlap_prefill=False))
    eng.add_request(reqs[0])
    eng.step()
    eng.step()  # r0 decoding
    eng.add_request(reqs[1])
    eng.add_request(reqs[2])
    seen = []

    def hook():
        seen.append({r.id: len(eng.outputs[r.id].tokens) for r in reqs})

    before = len(eng.outputs["r0"].tokens)
    eng.step(after_prefill=hook)
    assert seen == [{"r0": before, "r1": 1, "r2": 1}]
    assert {r.id: len(eng.outputs[r.id].tokens) for r in reqs} == {"r0": before + 1, "r1": 1, "r2": 1}
    assert eng.decode.lookahead_stats["dropped"] == 0
    eng.step(after_prefill=hook)  # a decode-only round: no call
    assert len(seen) == 1
    assert {r.id: len(eng.outputs[r.id].tokens) for r in reqs} == {"r0": before + 2, "r1": 2, "r2": 2}
    while eng.has_work:
        eng.step(after_prefill=hook)
    assert {r.id: eng.outputs[r.id].tokens for r in reqs} == ref


def test_overlapped_prefill_decodes_the_running_rows_while_it_computes(mla):
    """``overlap_prefill`` (the default): the step that launches new prompts' prefill decodes the running request
    without waiting for it; a later step collects it (``after_prefill`` then sees the first tokens, before that
    step's decode; the new rows join the step after the one launched ahead for the running row), and every request's
    tokens equal a run that waits for each prefill."""
    cfg, params = mla
    reqs = random_requests(cfg.vocab_size, 3, seed=11, max_tokens=(6, 7))
    ref = {o.id: o.tokens for o in ps.Engine(cfg, params, serve_config(overlap_prefill=False)).generate(reqs)}
    eng = ps.Engine(cfg, params, serve_config())
    eng.add_request(reqs[0])
    eng.step()  # nothing else to run: r0's prefill is waited for
    assert len(eng.outputs["r0"].tokens) == 2
    eng.add_request(reqs[1])
    eng.add_request(reqs[2])
    seen = []

    def hook():
        seen.append({r.id: len(eng.outputs[r.id].tokens) for r in reqs})

    eng.step(after_prefill=hook)  # launches r1's and r2's prefill and decodes r0 without waiting for it; only r0's
    # 1-row shape is compiled, so the 2-row group runs as two 1-row launches (PrefillWorker.groups)
    assert len(eng.outputs["r0"].tokens) == 3 and len(eng._inflight) == 2 and not seen
    assert (len(eng.outputs["r1"].tokens), len(eng.outputs["r2"].tokens)) == (0, 0)
    eng.prefill.block()  # the launched chunk step has finished: the next step collects it
    eng.step(after_prefill=hook)
    assert seen == [{"r0": 3, "r1": 1, "r2": 1}] and not eng._inflight
    assert {r.id: len(eng.outputs[r.id].tokens) for r in reqs} == {"r0": 4, "r1": 1, "r2": 1}
    eng.step()
    assert {r.id: len(eng.outputs[r.id].tokens) for r in reqs} == {"r0": 5, "r1": 2, "r2": 2}
    assert eng.decode.lookahead_stats["dropped"] == 0
    while eng.has_work:
        eng.step()
    assert {r.id: eng.outputs[r.id].tokens for r in reqs} == ref
    eng.check_invariants()


def test_prefill_launches_queue_on_the_prefill_mesh_while_requests_decode(mla, monkeypatch):
    """While requests decode, each launch holds ``decoding_prefill_tokens`` of whole prompts (a longer first prompt
    cut to it); up to ``prefill_in_flight`` launches are queued, a request with a chunk in flight is not planned
    again, and the launches are collected in order once done. Tokens equal a run that waits for every prefill."""
    from phaseserve.engine.workers import Launched

    cfg, params = mla
    reqs = [Request(id=f"q{i}", prompt=[(7 * i + j) % cfg.vocab_size for j in range(9)], max_tokens=6,
                    ignore_eos=True) for i in range(4)]
    ref = {o.id: o.tokens for o in ps.Engine(cfg, params, serve_config(overlap_prefill=False)).generate(reqs)}
    eng = ps.Engine(cfg, params, serve_config(decoding_prefill_tokens=4, prefill_in_flight=2))
    eng.add_request(reqs[0])
    eng.step()  # nothing decodes yet: the whole budget, waited for
    released = [False]

    class Held(Launched):
        def ready(self):
            return released[0] and super().ready()

    launch = eng.prefill.launch
    monkeypatch.setattr(eng.prefill, "launch", lambda group: Held(*launch(group)))
    for r in reqs[1:]:
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    assert [[(c.id, c.start, c.n) for c in f.group] for f in eng._inflight] == [
        [("q1", 0, 4)], [("q2", 0, 4)]]
    assert len(eng.outputs["q0"].tokens) == 5  # decoded every step meanwhile
    released[0] = True
    eng.step()  # both collected (q1, q2 have 4 of 9 tokens), the next launch planned
    assert (eng._seqs["q1"].computed, eng._seqs["q2"].computed) == (4, 4) and len(eng._inflight) == 1
    while eng.has_work:
        eng.step()
    assert {r.id: eng.outputs[r.id].tokens for r in reqs} == ref
    eng.check_invariants()


def test_sampling_is_seeded_and_independent_of_the_batch(mla):
    cfg, params = mla
    r = Request(id="s", prompt=[3, 1, 4, 1, 5], max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                ignore_eos=True)
    alone = ps.Engine(cfg, params, serve_config()).generate([r])[0].tokens
    crowd = random_requests(cfg.vocab_size, 3, seed=8)
    together = ps.Engine(cfg, params, serve_config()).generate(crowd + [r])[-1].tokens
    other_seed = ps.Engine(cfg, params, serve_config()).generate([r.replace(seed=8)])[0].tokens
    greedy = ps.Engine(cfg, params, serve_config()).generate([r.replace(temperature=0.0)])[0].tokens
    assert alone == together
    assert alone != other_seed or alone != greedy


def test_unseeded_sampling_is_random_and_reports_its_seed(mla):
    """Issue 42 defect 2: a missing seed was 0, so unseeded temperature-1 requests all drew the same tokens. Now each
    draws a fresh seed, reported in its output; given back as the seed, it reproduces the tokens."""
    cfg, params = mla
    eng = ps.Engine(cfg, params, serve_config())
    reqs = [Request(id=f"u{i}", prompt=[3, 1, 4, 1, 5], max_tokens=12, temperature=1.0, ignore_eos=True)
            for i in range(3)]
    outs = eng.generate(reqs)
    assert len({o.seed for o in outs}) == 3 and all(0 <= o.seed < 2**32 for o in outs)
    assert len({tuple(o.tokens) for o in outs}) > 1
    again = eng.generate([reqs[0].replace(id="again", seed=outs[0].seed)])[0]
    assert again.seed == outs[0].seed and again.tokens == outs[0].tokens


def test_bad_requests_fail_alone_and_allocate_nothing(mla):
    cfg, params = mla
    eng = ps.Engine(cfg, params, serve_config(max_batch=4))
    good = random_requests(cfg.vocab_size, 2, seed=10)
    bad = [
        Request(id="empty", prompt=[]),
        Request(id="oov", prompt=[1, cfg.vocab_size]),
        Request(id="neg", prompt=[-1, 2]),
        Request(id="zero", prompt=[1, 2], max_tokens=0),
        Request(id="long", prompt=[1] * eng.max_context),
        Request(id="beyond", prompt=[1, 2], max_tokens=eng.max_context),
        Request(id="r0", prompt=[1, 2]),  # duplicate of a good request's id
        Request(id="temp", prompt=[1, 2], temperature=-1.0),
    ]
    expect = [EmptyPromptError, InvalidTokenError, InvalidTokenError, InvalidParameterError, PromptTooLongError,
              InvalidParameterError, DuplicateRequestError, InvalidParameterError]
    free_before = eng.allocator.num_free
    outs = eng.generate(good[:1] + bad + good[1:])
    assert eng.allocator.num_free == free_before
    for o, e in zip(outs[1:-1], expect, strict=True):
        assert o.finish_reason == "error" and isinstance(o.error, e), (o.id, o.error)
        assert o.tokens == []
    assert outs[0].finish_reason == outs[-1].finish_reason == "length"
    assert eng.outputs["r0"] is outs[0]  # the duplicate did not replace the original


def test_noop_tracker_adds_nothing_to_the_decode_step(mla):
    cfg, params = mla
    eng = ps.Engine(cfg, params, serve_config(integrity=False))
    assert isinstance(eng.tracker, NoopTracker)
    b = 4
    from phaseserve.engine.decode_step import DecodeBatch

    batch = DecodeBatch(tokens=np.ones(b, np.int32), positions=np.arange(b, dtype=np.int32),
                        page_table=np.zeros((b, 16), np.int32), active=np.ones(b, bool),
                        temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32),
                        top_p=np.ones(b, np.float32), seeds=np.zeros(b, np.uint32), steps=np.zeros(b, np.int32),
                        want_logprobs=np.zeros(b, bool))
    ok = eng.tracker.check(*eng.tables.batch([None] * b))
    assert ok is None  # no launch at all

    def jaxpr(tracker, ok=ok):
        return str(jax.make_jaxpr(lambda p, pool, bt: decode_step(p, cfg, pool, bt, ok, tracker=tracker))(
            eng.decode_params, eng.pool, batch))

    with_noop, without = jaxpr(NoopTracker()), jaxpr(None)
    assert with_noop == without
    from phaseserve.cache.integrity import IntegrityTracker

    enabled = jaxpr(IntegrityTracker(eng.allocator), ok=np.ones(b, bool))
    assert enabled != without  # the enabled hooks do change the step: the comparison can fail


def test_ids_are_reusable_once_finished_and_runs_measure_separately(mla):
    cfg, params = mla
    eng = ps.Engine(cfg, params, serve_config())
    reqs = random_requests(cfg.vocab_size, 3, seed=12)
    first = eng.generate(reqs)
    eng.reset_metrics()
    assert eng.summary()["requests"] == 0 and eng.summary()["decode_steps"] == 0
    second = eng.generate(reqs)  # same ids: fine once the first ones finished
    assert _tokens(first) == _tokens(second) and all(o.finish_reason == "length" for o in second)
    assert eng.summary()["requests"] == 3


def test_engine_from_hydra_config():
    from hydra import compose, initialize_config_dir

    import lab.bench  # noqa: F401  (registers the structured configs the yaml files extend)

    configs = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs")
    with initialize_config_dir(config_dir=configs, version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny_mla", "quant.kv_dtype=fp8"])
    eng = ps.Engine.from_hydra(cfg)
    assert eng.kv_dtype == "float8_e4m3fn" and eng.serve.mode == cfg.engine.mode
    out = eng.generate([Request(id="h", prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)])[0]
    assert out.finish_reason == "length" and len(out.tokens) == 4
