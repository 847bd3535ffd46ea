"""Integrity tracker: the batched tag/range check, device tag mirroring with one transfer per step, typed errors,
the finite guard, and the NoopTracker adding nothing (identical jaxpr) while the enabled check is its own jit."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.faults import toy_decode_step
from phaseserve.cache import integrity, paged
from phaseserve.cache.allocator import PageAllocator, PageTables
from phaseserve.cache.integrity import IntegrityTracker, KVIntegrityError, NoopTracker, check_tags
from phaseserve.config import ModelConfig

S = 4
GQA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48)


def test_check_tags_exact():
    n = 8
    tags = jnp.asarray([0, 11, 12, 13, 0, 15, 16, 17], jnp.uint32)
    pt = np.array([[1, 2, 3], [1, 2, 3], [5, 4, 0], [n, 1, 0], [-1, 0, 0], [0, 1, 0], [6, 7, 99], [0, 0, 0],
                   [6, 7, 1]], np.int32)
    exp = np.array([[11, 12, 13], [11, 12, 14], [15, 14, 0], [0, 11, 0], [0, 0, 0], [0, 11, 0], [16, 17, 5],
                    [0, 0, 0], [16, 17, 11]], np.uint32)
    live = np.array([3, 3, 2, 2, 1, 2, 2, 0, 4], np.int32)
    ok = check_tags(tags, jnp.asarray(pt), jnp.asarray(exp), jnp.asarray(live))
    # good | stale tag | free page (tag 0) | out of range (N) | negative | null page live | garbage past num_live
    # ignored | padding row | num_live > P
    assert np.asarray(ok).tolist() == [True, False, False, False, False, False, True, True, False]


def test_tracker_mirrors_allocator_with_one_small_transfer_per_sync(monkeypatch):
    calls = []
    real = integrity._set_tags_donated
    monkeypatch.setattr(integrity, "_set_tags_donated", lambda t, u: calls.append(u.shape) or real(t, u))
    a = PageAllocator(40)
    tr = IntegrityTracker(a)
    assert calls == [] and not np.asarray(tr.tags).any()
    p = a.allocate(5)
    a.share(p[:2])
    a.free(p[2:4])
    q = a.allocate(3)
    a.free(q[:1])
    assert tr.sync() == 8 and calls == [(2, 8)]  # 8 distinct pages changed (last write wins) -> one transfer
    np.testing.assert_array_equal(np.asarray(tr.tags), a.tags)
    assert tr.sync() == 0 and len(calls) == 1  # nothing pending, nothing sent
    a.allocate(9)
    tr.check(*PageTables(a, 4).batch([None]))  # check() syncs first
    assert calls[-1] == (2, 16) and len(calls) == 2
    np.testing.assert_array_equal(np.asarray(tr.tags), a.tags)


def test_failures_are_typed_and_explained():
    a = PageAllocator(10)
    t = PageTables(a, 3)
    tr = IntegrityTracker(a)
    for r in "abc":
        t.add(r)
        t.allocate(r, 2)
    a.free(t.owned("b")[1:])  # use-after-free behind b's back
    t.page_table[t.slot_of["c"], 0] = 77
    batch = t.batch(["a", "b", None, "c"])
    ok = tr.check(*batch)
    errs = tr.failures(["a", "b", None, "c"], ok, batch)
    assert sorted(errs) == ["b", "c"] and all(isinstance(e, KVIntegrityError) for e in errs.values())  # a is fine
    assert errs["b"].kind == "tag" and f"page {t.owned('b')[1]} is free" in errs["b"].details
    assert errs["c"].kind == "range" and "page 77 out of range" in str(errs["c"])
    assert tr.failures(["a"], jnp.asarray([True])) == {}
    assert NoopTracker(a).failures(["a", "b"], None) == {}


def test_guard_finite_flags_and_zeroes_rows():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 5)), jnp.float32)
    x = x.at[1, 2, 4].set(jnp.nan).at[3, 0, 0].set(-jnp.inf)
    y, f = integrity.guard_finite(x, None)
    assert np.asarray(f).tolist() == [True, False, True, False]
    assert (np.asarray(y)[[1, 3]] == 0).all() and (np.asarray(y)[[0, 2]] == np.asarray(x)[[0, 2]]).all()
    _, f2 = integrity.guard_finite(x[:, :1], jnp.asarray([False, True, True, True]))
    assert np.asarray(f2).tolist() == [False, True, True, False]


def _step_inputs(b=3, p=3, seed=0):
    rng = np.random.default_rng(seed)
    a = PageAllocator(12)
    t = PageTables(a, p)
    rids = [f"r{i}" for i in range(b - 1)] + [None]
    for r in rids[:-1]:
        t.add(r)
        t.allocate(r, p)
    pool = paged.init_pool(GQA, 12, S, "float8_e4m3fn")
    q = [jnp.asarray(rng.standard_normal((b, 4, 8)), jnp.float32) for _ in range(2)]
    kv = [tuple(jnp.asarray(rng.standard_normal((b, 2, 8)), jnp.float32) for _ in range(2)) for _ in range(2)]
    lengths = jnp.asarray(rng.integers(0, p * S - 1, b), jnp.int32)
    pt, exp, live = t.batch(rids)
    return a, pool, q, kv, jnp.asarray(pt), lengths, jnp.asarray([r is not None for r in rids]), (pt, exp, live)


def test_noop_tracker_step_has_the_same_jaxpr_as_no_tracker():
    a, pool, q, kv, pt, lengths, mask, batch = _step_inputs()
    args = (pool, q, kv, pt, lengths, mask)
    plain = jax.make_jaxpr(partial(toy_decode_step, tracker=None))(*args, None)
    noop = NoopTracker(a)
    assert noop.check(*batch) is None and noop.stats.checks == 0  # no launch
    with_noop = jax.make_jaxpr(partial(toy_decode_step, tracker=noop))(*args, noop.check(*batch))
    assert str(plain) == str(with_noop)
    low = [jax.jit(partial(toy_decode_step, tracker=tr)).lower(*args, None).as_text() for tr in (None, noop)]
    assert low[0] == low[1]
    # the enabled tracker changes the step only by consuming ok: no tags, no u32 and no tag gather inside it
    tr = IntegrityTracker(a)
    ok = tr.check(*batch)
    enabled = str(jax.make_jaxpr(partial(toy_decode_step, tracker=tr))(*args, ok))
    assert enabled != str(plain) and "u32" not in enabled and "u32" not in str(plain)
    # ... the tag comparison is its own jitted computation
    check_jaxpr = str(jax.make_jaxpr(check_tags)(tr.tags, *map(jnp.asarray, batch)))
    assert "u32" in check_jaxpr and "eq" in check_jaxpr
    assert np.asarray(ok).tolist() == [True, True, True]


@pytest.mark.parametrize("kind", ["enabled", "noop", "none"])
def test_healthy_rows_are_bit_identical_with_or_without_tracker(kind):
    a, pool, q, kv, pt, lengths, mask, batch = _step_inputs(seed=1)
    ref_pool, ref_out, _ = jax.jit(partial(toy_decode_step, tracker=None))(pool, q, kv, pt, lengths, mask, None)
    tr = {"enabled": IntegrityTracker(a), "noop": NoopTracker(a), "none": None}[kind]
    ok = tr.check(*batch) if tr is not None else None
    new_pool, out, finite = jax.jit(partial(toy_decode_step, tracker=tr))(pool, q, kv, pt, lengths, mask, ok)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    for x, y in zip(jax.tree.leaves(ref_pool), jax.tree.leaves(new_pool), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert (finite is None) == (kind != "enabled")
    assert finite is None or np.asarray(finite).all()
    assert np.isfinite(np.asarray(out)).all() and np.abs(np.asarray(out)).max() > 0


def test_failing_rows_neither_read_nor_write():
    a, pool, q, kv, pt, lengths, mask, batch = _step_inputs(seed=2)
    ok = jnp.asarray([True, False, True])
    assert np.asarray(IntegrityTracker.mask_rows(mask, ok)).tolist() == [True, False, False]  # row 2: padding
    assert (np.asarray(IntegrityTracker.mask_table(pt, ok))[1] == 0).all()
    np.testing.assert_array_equal(np.asarray(IntegrityTracker.mask_table(pt, ok))[0], np.asarray(pt)[0])
    got_pool, out, finite = toy_decode_step(pool, q, kv, pt, lengths, mask, ok, tracker=IntegrityTracker)
    ref_pool, ref_out, _ = toy_decode_step(pool, q, kv, pt, lengths, mask & ok, None, tracker=None)
    for x, y in zip(jax.tree.leaves(ref_pool), jax.tree.leaves(got_pool), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))  # row 1 wrote nothing
    assert not np.asarray(out)[1].any()  # row 1 read only the (all-zero) null page
    np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(ref_out)[0])
    assert np.asarray(finite).all()
