"""Fault injection end to end over the engine's paged attention (toy decode step: given queries, no model): every
fault is caught in the step that would first read it, only the victim is flagged, every other row is bit-identical
to the fault-free run, nothing leaks; without the tracker the same faults go unnoticed and corrupt results. A long
randomized fault-free run (joins, leaves, shared prefixes, preemption, tag wraparound) flags nothing."""

from __future__ import annotations

import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.faults import FaultInjector, toy_decode_step
from phaseserve.cache import paged
from phaseserve.cache.allocator import TAG_MAX, PageAllocator, PageTables
from phaseserve.cache.integrity import IntegrityTracker, KVIntegrityError, NoopTracker
from phaseserve.config import ModelConfig
from phaseserve.engine.request import NonFiniteLogitsError, nonfinite_logits

S = 4
MLA = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=12, intermediate_size=48, attention="mla", kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
GQA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48)
_JIT: dict = {}


def jitted(kind: str):
    """One compiled step per tracker kind (the hooks are static methods, so the class stands in for an instance)."""
    if kind not in _JIT:
        cls = IntegrityTracker if kind == "enabled" else NoopTracker
        _JIT[kind] = jax.jit(partial(toy_decode_step, tracker=cls), donate_argnums=0)
        _JIT["prompt"] = jax.jit(paged.write_prompt, donate_argnums=0)
    return _JIT[kind]


def step_errors(tracker, rows: list[str | None], ok, finite, batch) -> dict[str, Exception]:
    """What the engine ends after a step: the tracker's page-tag failures (``KVIntegrityError``) and, for the rows
    whose attention output the guard found NaN/inf (the decode step's ``NONFINITE_ATTENTION`` token), a
    ``NonFiniteLogitsError`` -- never an integrity failure."""
    errors: dict[str, Exception] = dict(tracker.failures(rows, ok, batch))
    if finite is not None:
        for rid, f in zip(rows, np.asarray(finite), strict=True):
            if rid is not None and not f and rid not in errors:
                errors[rid] = nonfinite_logits(rid, 0, "attention")
    return errors


def scrubs(err: Exception) -> bool:
    """The row may have read NaN/inf from its pages: they are zeroed before release."""
    return isinstance(err, NonFiniteLogitsError)


class Harness:
    """A batch of decode rows over a real allocator, page tables, tracker and page pool."""

    def __init__(self, cfg, kv_dtype="float8_e4m3fn", kind="enabled", num_pages=24, batch=4, max_pages=5,
                 seed=0, first_tag=1):
        self.cfg, self.seed, self.i = cfg, seed, 0
        self.alloc = PageAllocator(num_pages, first_tag=first_tag)
        self.tables = PageTables(self.alloc, max_pages)
        self.tracker = (IntegrityTracker if kind == "enabled" else NoopTracker)(self.alloc)
        self.pool = paged.init_pool(cfg, num_pages, S, kv_dtype)
        self.rows: list[str | None] = [None] * batch
        self.length: dict[str, int] = {}
        self.step_fn = jitted(kind)
        self.inj = FaultInjector(self.tables)
        self.t_max = max_pages * S

    def _rand(self, rng, *shape):
        return jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.1, 10, shape[:-1])[..., None], jnp.float32)

    def admit(self, row: int, rid: str, prompt_len: int, share_from: str | None = None, share_pages: int = 0):
        t = self.tables
        t.add(rid)
        if share_from is not None:
            t.share(rid, t.owned(share_from)[:share_pages])
        if not t.grow(rid, prompt_len, S):
            t.release(rid)
            return False
        rng = np.random.default_rng(zlib.crc32(rid.encode()))
        w = self.cfg.kv_cache_width
        kv = [self._rand(rng, 1, self.t_max, w) if self.cfg.is_mla else
              tuple(self._rand(rng, 1, self.t_max, self.cfg.num_kv_heads, w) for _ in range(2))
              for _ in range(self.cfg.num_layers)]
        pt = t.batch([rid])[0]
        self.pool = _JIT["prompt"](self.pool, kv, jnp.asarray(pt), jnp.asarray([prompt_len]),
                                   jnp.asarray([share_pages * S]))
        self.rows[row], self.length[rid] = rid, prompt_len
        return True

    def live(self) -> list[str]:
        return [r for r in self.rows if r is not None]

    def step(self, grow=True):
        """Grow pages, check, run the toy step. Returns (out f32[B, L, H, hd or r], {rid: error} (step_errors))."""
        rng = np.random.default_rng([self.seed, self.i])
        b, cfg = len(self.rows), self.cfg
        hd = cfg.kv_cache_width
        q = [self._rand(rng, b, cfg.num_heads, hd) for _ in range(cfg.num_layers)]
        if cfg.is_mla:  # (q_latent, q_rope)
            q = [(x[..., : cfg.kv_lora_rank], x[..., cfg.kv_lora_rank:]) for x in q]
        new = [self._rand(rng, b, hd) if cfg.is_mla else
               tuple(self._rand(rng, b, cfg.num_kv_heads, hd) for _ in range(2)) for _ in range(cfg.num_layers)]
        if grow:
            for r in self.live():
                assert self.tables.grow(r, self.length[r] + 1, S)
        batch = self.tables.batch(self.rows)
        ok = self.tracker.check(*batch)
        lengths = jnp.asarray([self.length.get(r, 0) if r else 0 for r in self.rows], jnp.int32)
        mask = jnp.asarray([r is not None for r in self.rows])
        self.pool, out, finite = self.step_fn(self.pool, q, new, jnp.asarray(batch[0]), lengths, mask, ok)
        errors = step_errors(self.tracker, self.rows, ok, finite, batch)
        for r in self.live():
            self.length[r] += 1
        self.i += 1
        return np.asarray(out), errors

    def abort(self, rid: str, scrub: bool = False) -> list[int]:
        if scrub:
            self.pool = paged.clear_pages(self.pool, jnp.asarray(self.tables.owned(rid), jnp.int32))
        self.rows[self.rows.index(rid)] = None
        del self.length[rid]
        return self.tables.release(rid)

    def drain(self) -> None:
        """Release everything; assert nothing leaked (host and device)."""
        for r in self.live():
            assert self.abort(r) == []
        self.tables.check_invariants()
        a = self.alloc
        assert a.num_free == a.num_pages - 1 and (a.refcount == 0).all() and not self.tables.slot_of
        self.tracker.sync()
        if isinstance(self.tracker, IntegrityTracker):
            assert not np.asarray(self.tracker.tags).any()


PROMPTS = {"r0": 6, "r1": 10, "r2": 5, "r3": 7}  # r1 is the victim; r2 needs a new page exactly at step K
K, STEPS = 3, 7


def poison(h, entry, slot, target="data", value=float("nan")):
    page = h.tables.owned("r1")[entry]
    h.pool = FaultInjector.poison(h.pool, layer=1, page=page, slot=slot, target=target, value=value)


FAULTS = {  # name -> (inject, expected error kind or None if the fault is never read)
    "free_page": (lambda h: h.inj.point_at_free_page("r1", 0), "tag"),
    "use_after_free": (lambda h: h.inj.free_behind("r1", 1), "tag"),
    "other_request": (lambda h: h.inj.point_at_other("r1", 3, "r0", 0), "tag"),  # r1's write page -> r0's page
    "out_of_range": (lambda h: h.inj.point_out_of_range("r1", 0), "range"),
    "negative_page": (lambda h: h.inj.point_out_of_range("r1", 2, page=-3), "range"),
    "double_allocate": (lambda h: h.inj.double_allocate("r1", 0, "r2"), "tag"),  # r2 writes into r1's page 0
    "nan_data": (lambda h: poison(h, 0, 1), "nonfinite"),  # position 1: read every step
    "inf_scale": (lambda h: poison(h, 2, 3, "scale", float("inf")), "nonfinite"),  # position 11
    "nan_scale": (lambda h: poison(h, 1, 0, "scale"), "nonfinite"),  # "nonfinite": a NonFiniteLogitsError
    "nan_unread_slot": (lambda h: poison(h, 3, 2), None),  # position 14: written at step 4 before it is read
}


def run(cfg, kind, fault=None, kv_dtype="float8_e4m3fn"):
    h = Harness(cfg, kv_dtype, kind)
    for row, (rid, n) in enumerate(PROMPTS.items()):
        assert h.admit(row, rid, n)
    outs, flagged, skipped = [], [], None
    for step in range(STEPS):
        if step == K and fault is not None:
            fault(h)
        out, errors = h.step()
        outs.append(out)
        flagged.append(errors)
        for rid, err in errors.items():
            skipped = h.abort(rid, scrub=scrubs(err))
    return h, np.stack(outs), flagged, skipped


@pytest.fixture(scope="module")
def clean():
    return {cfg.attention: run(cfg, "enabled") for cfg in (MLA, GQA)}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_caught_in_the_step_it_is_first_read_and_only_the_victim(name, clean):
    inject, kind = FAULTS[name]
    h0, ref, flagged0, _ = clean["mla"]
    assert all(not f for f in flagged0)
    h, out, flagged, skipped = run(MLA, "enabled", inject)
    if kind is None:  # never read: never flagged, and every row (the victim too) is unaffected
        assert all(not f for f in flagged)
        np.testing.assert_array_equal(out, ref)
    else:
        assert [sorted(f) for f in flagged] == [[]] * K + [["r1"]] + [[]] * (STEPS - K - 1)
        err = flagged[K]["r1"]
        if kind == "nonfinite":
            assert isinstance(err, NonFiniteLogitsError) and err.where == "attention" and "'r1'" in str(err)
        else:
            assert isinstance(err, KVIntegrityError) and err.kind == kind and err.request_id == "r1"
        others = [0, 2, 3]  # rows of r0, r2, r3: bit-identical at every step, before and after the fault
        np.testing.assert_array_equal(out[:, others], ref[:, others])
        np.testing.assert_array_equal(out[:K, 1], ref[:K, 1])
        assert not out[K + 1:, 1].any()  # the aborted row is padding afterwards
        if name in ("use_after_free", "double_allocate"):
            assert len(skipped) == 1  # that page was no longer r1's to free
        else:
            assert skipped == []
    h.drain()
    h0.drain()


@pytest.mark.parametrize("name", ["other_request", "double_allocate", "out_of_range", "free_page", "nan_data"])
def test_without_the_tracker_the_same_faults_go_unnoticed(name, clean):
    """The tests above can fail: with the NoopTracker nothing is flagged and results are corrupted."""
    _, ref, _, _ = clean["mla"]
    h, out, flagged, _ = run(MLA, "noop", FAULTS[name][0])
    assert all(not f for f in flagged)
    bad_rows = {int(r) for r in np.nonzero((out[K:] != ref[K:]).reshape(STEPS - K, 4, -1).any(-1))[1]}
    assert 1 in bad_rows or 0 in bad_rows
    if name == "other_request":
        assert 0 in bad_rows  # the victim wrote into another request's page: an innocent row changed


@pytest.mark.parametrize("name", ["other_request", "double_allocate", "nan_scale"])
def test_faults_on_gqa_pages(name, clean):
    h0, ref, _, _ = clean["gqa"]
    h, out, flagged, _ = run(GQA, "enabled", FAULTS[name][0])
    assert [sorted(f) for f in flagged] == [[]] * K + [["r1"]] + [[]] * (STEPS - K - 1)
    np.testing.assert_array_equal(out[:, [0, 2, 3]], ref[:, [0, 2, 3]])
    h.drain()


def long_run(steps: int, seed: int, first_tag: int = 1, fault_at: int | None = None):
    """Random joins (some sharing a live request's full prefix pages), leaves, growth and preemption."""
    rng = np.random.default_rng(seed)
    h = Harness(MLA, "float8_e4m3fn", "enabled", num_pages=20, batch=8, max_pages=6, seed=seed, first_tag=first_tag)
    budget: dict[str, int] = {}
    n, flagged, preempted, shared = 0, 0, 0, 0
    for step in range(steps):
        for row in range(len(h.rows)):
            if h.rows[row] is None and rng.random() < 0.5:
                n += 1
                rid, plen = f"q{n}", int(rng.integers(1, 13))
                src = [r for r in h.live() if h.length[r] >= S]
                k = 0
                if src and rng.random() < 0.4:
                    s = src[rng.integers(len(src))]
                    k = int(rng.integers(1, min(h.length[s], plen) // S + 1)) if plen >= S else 0
                    shared += k > 0
                if h.admit(row, rid, plen, s if k else None, k):
                    budget[rid] = int(rng.integers(1, 12))
        for r in h.live():  # finish
            if budget[r] == 0 or h.length[r] + 1 >= h.t_max:
                assert h.abort(r) == []
        for r in h.live():  # grow on demand, preempting (by recompute) when short
            while r in h.length and not h.tables.grow(r, h.length[r] + 1, S):
                victim = [x for x in h.live() if x != r]
                assert h.abort(victim[rng.integers(len(victim))] if victim else r) == []
                preempted += 1
        if fault_at == step:
            live = h.live()
            pairs = [(a, b) for a in live for b in live if h.tables.owned(a)[0] != h.tables.owned(b)[0]]
            victim, other = pairs[0]
            h.inj.point_at_other(victim, 0, other, 0)
        out, errors = h.step(grow=False)
        if fault_at == step:
            assert sorted(errors) == [victim] and errors[victim].kind == "tag"
            assert h.abort(victim) == []
            fault_at = None
            continue
        flagged += len(errors)
        assert not errors, errors
        assert np.isfinite(out).all()
        for r in h.live():
            budget[r] -= 1
        h.tables.check_invariants()
    stats = h.tracker.stats
    h.drain()
    return stats, flagged, preempted, shared, h.alloc.epoch


def test_long_randomized_fault_free_run_flags_nothing():
    stats, flagged, preempted, shared, _ = long_run(steps=300, seed=11)
    print(f"\nfault-free run: {stats.checks} checks, {stats.rows_checked} row checks, {stats.entries_checked} "
          f"page-table entries checked, {flagged} flagged, {preempted} preemptions, {shared} shared-prefix joins")
    assert flagged == 0 and stats.checks == 300 and stats.rows_checked > 1000 and preempted > 10 and shared > 10


def test_tag_counter_next_to_wraparound():
    stats, flagged, _, _, epoch = long_run(steps=80, seed=12, first_tag=TAG_MAX - 40, fault_at=70)
    assert epoch == 1 and flagged == 0 and stats.checks == 80
