"""The one validation layer (no JAX): every Request field is type- and range-checked with a typed RequestError,
numpy integers are accepted and normalised, configs refuse bad fields with ConfigError; the scheduler's prefix
index survives tag wraparound across two tenants; per-sequence scheduler containment; errors cross the wire typed.

Each numbered defect of the reliability issue that lives here is named in its test's docstring."""

from __future__ import annotations

import math
import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import phaseserve as ps
from phaseserve.cache.allocator import TAG_MAX, PageAllocator, PageTables
from phaseserve.engine.request import (
    EmptyPromptError,
    InvalidParameterError,
    InvalidRequestIdError,
    InvalidTokenError,
    Limits,
    PromptTooLongError,
    Request,
    RequestError,
    RequestOutput,
    Sequence,
    open_request,
    validate,
)
from phaseserve.engine.scheduler import Scheduler


def examples(ci: int) -> int:
    """Hypothesis examples per property: ``ci`` (bounded for CI), or ``PHASESERVE_HYPOTHESIS_EXAMPLES`` (the soak
    benchmark's longer run)."""
    return int(os.environ.get("PHASESERVE_HYPOTHESIS_EXAMPLES", ci))


LIMITS = Limits(vocab_size=50, max_context=64, page_size=4, max_pages=16)


def good(**kw) -> Request:
    return Request(id="g", prompt=[1, 2, 3], max_tokens=4).replace(**kw)


@pytest.mark.parametrize("field, value, err", [
    # defect 1: fields that reached the step unchecked
    ("seed", -1, InvalidParameterError), ("seed", 2**32, InvalidParameterError), ("seed", "7", InvalidParameterError),
    ("top_k", 2**31, InvalidParameterError),
    ("tenant", None, InvalidParameterError), ("tenant", 3, InvalidParameterError),
    ("tenant", b"acme", InvalidParameterError), ("tenant", "\ud800", InvalidParameterError),
    # defect 2: errors that were TypeError, not RequestError
    ("temperature", None, InvalidParameterError), ("top_p", "0.9", InvalidParameterError),
    ("top_k", None, InvalidParameterError), ("max_tokens", None, InvalidParameterError),
    ("stop_token_ids", None, InvalidTokenError), ("stop_token_ids", 3, InvalidTokenError),
    ("id", ["x"], InvalidRequestIdError), ("id", 7, InvalidRequestIdError), ("id", None, InvalidRequestIdError),
    # defect 8: NaN temperature was greedy, bool token ids were tokens
    ("temperature", math.nan, InvalidParameterError), ("temperature", math.inf, InvalidParameterError),
    ("temperature", 1e300, InvalidParameterError), ("top_p", math.nan, InvalidParameterError),
    ("prompt", [True, 2], InvalidTokenError), ("stop_token_ids", (False,), InvalidTokenError),
    ("ignore_eos", "yes", InvalidParameterError), ("max_tokens", True, InvalidParameterError),
    ("prompt", None, InvalidTokenError), ("prompt", "abc", InvalidTokenError),
    ("prompt", [1.0, 2.0], InvalidTokenError),
    ("prompt", [], EmptyPromptError), ("prompt", [1] * 64, PromptTooLongError), ("prompt", [50], InvalidTokenError),
])
def test_every_field_is_checked_with_a_typed_error(field, value, err):
    with pytest.raises(err):
        validate(good(**{field: value}), LIMITS)


def test_a_missing_seed_is_drawn_fresh_and_reported():
    """Issue 42 defect 2: a missing seed became 0 (every unseeded request sampled alike)."""
    seeds = {validate(good(seed=None), LIMITS).seed for _ in range(16)}
    assert len(seeds) == 16 and all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds)
    assert validate(good(seed=7), LIMITS).seed == 7 and validate(good(seed=0), LIMITS).seed == 0
    req, out = open_request(good(), LIMITS, {})
    assert out.seed == req.seed is not None


def test_numpy_integers_are_accepted_and_normalised():
    """Defect 8: numpy integer ids were refused with a misleading message."""
    req = good(prompt=np.arange(1, 6, dtype=np.int64), max_tokens=np.int32(3), seed=np.uint32(2**32 - 1),
               stop_token_ids=[np.int16(4)], top_k=np.int64(5), temperature=np.float32(0.5), ignore_eos=np.bool_(True))
    out = validate(req, LIMITS)
    assert out.prompt == [1, 2, 3, 4, 5] and all(type(t) is int for t in out.prompt)
    assert out.max_tokens == 3 and type(out.seed) is int and out.stop_token_ids == (4,) and out.ignore_eos is True
    assert validate(good(prompt=[np.int64(1), 2]), LIMITS).prompt == [1, 2]


def test_pages_beyond_the_cache_are_refused():
    with pytest.raises(InvalidParameterError, match="pages"):
        validate(good(prompt=[1] * 10, max_tokens=20), Limits(50, 64, 4, max_pages=6))


ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                st.text(max_size=4), st.binary(max_size=3), st.lists(st.integers(-3, 60), max_size=4))


@settings(max_examples=examples(300), deadline=None)
@given(st.fixed_dictionaries({}, optional={f: ANY for f in ("id", "prompt", "max_tokens", "temperature", "top_p",
                                                             "top_k", "seed", "stop_token_ids", "ignore_eos",
                                                             "tenant")}))
def test_property_arbitrary_field_values_pass_normalised_or_raise_a_request_error(fields):
    req = good(**fields)
    try:
        out = validate(req, LIMITS)
    except RequestError:
        return
    assert isinstance(out.id, str) and out.prompt and all(type(t) is int and 0 <= t < 50 for t in out.prompt)
    assert 0 <= out.seed < 2**32 and 0 <= out.top_k < 2**31 and 0 < out.top_p <= 1
    assert math.isfinite(out.temperature) and out.temperature >= 0 and isinstance(out.ignore_eos, bool)
    assert isinstance(out.tenant, str) and len(out.prompt) + out.max_tokens <= 64


@pytest.mark.parametrize("make", [
    lambda: ps.ServeConfig(max_batch=0), lambda: ps.ServeConfig(max_batch=-3), lambda: ps.ServeConfig(max_batch=2.5),
    lambda: ps.ServeConfig(max_prefill_tokens=0), lambda: ps.ServeConfig(mode="both"),
    lambda: ps.ServeConfig(max_context=1), lambda: ps.CacheConfig(page_size=0), lambda: ps.CacheConfig(num_pages=1),
    lambda: ps.CacheConfig(kv_budget_bytes=-1), lambda: ps.CacheConfig(admission="lazy"),
    lambda: ps.CacheConfig(preemption="drop"), lambda: ps.CacheConfig(memory_fraction=1.5),
    lambda: ps.CacheConfig(integrity="yes"), lambda: ps.QuantConfig(kv_dtype="float7"),
    lambda: ps.QuantConfig(int4_group_size=0), lambda: ps.ServeConfig(cache={"page_size": 4}),
])
def test_bad_config_fields_raise_config_error(make):
    """Defect 7: max_batch <= 0 made generate() loop forever."""
    with pytest.raises(ps.ConfigError):
        make()


def _seq(rid, prompt, tenant, max_tokens=1):
    r = Request(id=rid, prompt=list(prompt), max_tokens=max_tokens, tenant=tenant)
    return Sequence(request=r, output=RequestOutput(id=rid), tokens=list(prompt), num_prompt=len(prompt))


def test_prefix_entries_never_match_a_page_reissued_after_tag_wraparound():
    """Defect 3: a stale (page, tag) prefix entry matched a page reissued, after wraparound, to another tenant."""
    tables = PageTables(PageAllocator(7), max_pages_per_seq=8)
    s = Scheduler(tables, 4, 4, "reserve")
    alloc = tables.allocator
    filler, a = _seq("f", range(20, 28), "f"), _seq("a", range(8), "tenant-a")
    for q in (filler, a):
        s.add(q)
        s.schedule()
    s.register_prefix(a)
    a_pages = tables.owned("a")
    s.finish(a)
    alloc.seed_tag_counter(TAG_MAX - 1)  # the next allocation crosses 2**32 - 1
    b = _seq("b", range(30, 38), "tenant-b")
    s.add(b)
    s.schedule()
    assert alloc.epoch == 1 and set(tables.owned("b")) == set(a_pages)  # b got a's old pages, in a new epoch
    s.finish(filler)
    a2 = _seq("a2", range(8), "tenant-a")  # tenant a's prompt again: its old entries name b's live pages
    s.add(a2)
    s.schedule()
    assert a2 in s.running and a2.shared_pages == 0
    assert not set(tables.owned("a2")) & set(tables.owned("b"))
    s.check_invariants()


def test_a_sequence_that_raises_in_admission_fails_alone():
    tables = PageTables(PageAllocator(17), max_pages_per_seq=8)
    s = Scheduler(tables, 4, 4, "reserve")
    ok1, bad, ok2 = _seq("a", [1, 2], ""), _seq("bad", [1, 2], ""), _seq("b", [3, 4], "")
    bad.request = bad.request.replace(tenant=None)  # bypasses validate(): the tenant hash raises in schedule()
    for q in (ok1, bad, ok2):
        s.add(q)
    res = s.schedule()
    assert [q.id for q in res.admitted] == ["a", "b"] and [(q.id, type(e)) for q, e in res.failed] == [
        ("bad", AttributeError)]
    assert "bad" not in tables and bad not in s.waiting
    s.check_invariants()


def test_request_errors_cross_process_boundaries_with_their_class():
    """Errors raised in a Ray actor reach the engine pickled: each typed error comes back as its own class, with
    its message and kind (a KVIntegrityError, whose constructor takes three arguments, included)."""
    import pickle

    from phaseserve.cache.integrity import KVIntegrityError
    from phaseserve.distributed.protocol import PeerDeadError, StaleDescriptorError, TransferError

    for err in (InvalidParameterError("x"), InvalidTokenError("y"), PromptTooLongError("z"), TransferError("w"),
                PeerDeadError("p"), StaleDescriptorError("s", "stale_tag"), KVIntegrityError("r", "d", "nonfinite")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert getattr(back, "kind", None) == getattr(err, "kind", None)
