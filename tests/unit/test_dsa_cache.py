"""GLM-5 DSA index keys in the paged cache: faults on index-key pages are caught like faults on latent pages (the
page-table faults by the tags the index keys share with the latent, a NaN index key or scale by the finite guard,
in the step that first reads it, only the victim flagged and every other row bit-identical); without the tracker
they go unnoticed. The planner's bytes per token for GLM-5 equal the cache's."""

from __future__ import annotations

import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from phaseserve import planner
from phaseserve.cache import paged
from phaseserve.cache.attend import PagedAttend
from phaseserve.cache.integrity import IntegrityTracker, KVIntegrityError, NoopTracker
from phaseserve.config import ModelConfig
from phaseserve.engine.request import NonFiniteLogitsError
from phaseserve.kernel_mesh import KernelDispatch
from phaseserve.model.indexer import DSAQuery
from phaseserve.presets import preset
from tests.unit import test_faults as tf

DSA = tf.MLA.replace(architecture="GlmMoeDsaForCausalLM", index_topk=4, index_n_heads=2, index_head_dim=8,
                     indexer_types=("full", "full"))


def toy_dsa_step(pool, q, new_kv, page_table, lengths, row_mask, ok, *, tracker):
    """``faults.toy_decode_step`` with DSA queries: PagedAttend per layer (reference kernels)."""
    attend = PagedAttend(page_table, lengths, row_mask, ok, tracker=tracker, sm_scale=0.25,
                         kd=KernelDispatch(attn_impl="reference"))
    layers, outs = zip(*(attend(layer, ql, kvl) for layer, ql, kvl in zip(pool.layers, q, new_kv, strict=True)),
                       strict=True)
    return pool.replace(layers=tuple(layers)), jnp.stack(outs, axis=1), attend.finite


class DSAHarness(tf.Harness):
    """The fault harness with latent + index key per token and DSA queries (top-4 of up to 16 cached tokens)."""

    def __init__(self, kind="enabled", **kw):
        super().__init__(DSA, "float8_e4m3fn", kind, **kw)
        self.step_fn = jax.jit(partial(toy_dsa_step, tracker=IntegrityTracker if kind == "enabled" else NoopTracker),
                               donate_argnums=0)

    def admit(self, row, rid, prompt_len, share_from=None, share_pages=0):
        self.tables.add(rid)
        assert self.tables.grow(rid, prompt_len, tf.S)
        rng = np.random.default_rng(zlib.crc32(rid.encode()))
        kv = [(self._rand(rng, 1, self.t_max, DSA.kv_cache_width), self._rand(rng, 1, self.t_max, 8))
              for _ in range(DSA.num_layers)]
        pt = self.tables.batch([rid])[0]
        self.pool = paged.write_prompt(self.pool, kv, jnp.asarray(pt), jnp.asarray([prompt_len]))
        self.rows[row], self.length[rid] = rid, prompt_len
        return True

    def step(self, grow=True):
        rng = np.random.default_rng([self.seed, self.i])
        b, r = len(self.rows), DSA.kv_lora_rank
        q, new = [], []
        for _ in range(DSA.num_layers):
            x = self._rand(rng, b, DSA.num_heads, DSA.kv_cache_width)
            q.append(DSAQuery(x[..., :r], x[..., r:], self._rand(rng, b, 2, 8), self._rand(rng, b, 2, 1)[..., 0], 4))
            new.append((self._rand(rng, b, DSA.kv_cache_width), self._rand(rng, b, 8)))
        for rid in self.live():
            assert self.tables.grow(rid, self.length[rid] + 1, tf.S)
        batch = self.tables.batch(self.rows)
        ok = self.tracker.check(*batch)
        lengths = jnp.asarray([self.length.get(x, 0) if x else 0 for x in self.rows], jnp.int32)
        mask = jnp.asarray([x is not None for x in self.rows])
        self.pool, out, finite = self.step_fn(self.pool, q, new, jnp.asarray(batch[0]), lengths, mask, ok)
        errors = tf.step_errors(self.tracker, self.rows, ok, finite, batch)
        for rid in self.live():
            self.length[rid] += 1
        self.i += 1
        return np.asarray(out), errors


def poison_index(h, entry, slot, target="index"):
    page = h.tables.owned("r1")[entry]
    h.pool = tf.FaultInjector.poison(h.pool, layer=1, page=page, slot=slot, target=target)


FAULTS = {
    "nan_index_key": (lambda h: poison_index(h, 0, 1), "nonfinite"),
    "nan_index_scale": (lambda h: poison_index(h, 1, 0, "index_scale"), "nonfinite"),
    "other_request": (lambda h: h.inj.point_at_other("r1", 3, "r0", 0), "tag"),
    "out_of_range": (lambda h: h.inj.point_out_of_range("r1", 0), "range"),
}


def run(kind, fault=None):
    h = DSAHarness(kind)
    for row, (rid, n) in enumerate(tf.PROMPTS.items()):
        h.admit(row, rid, n)
    outs, flagged = [], []
    for step in range(tf.STEPS):
        if step == tf.K and fault is not None:
            fault(h)
        out, errors = h.step()
        outs.append(out)
        flagged.append(errors)
        for rid, err in errors.items():
            h.abort(rid, scrub=tf.scrubs(err))
    return np.stack(outs), flagged


@pytest.fixture(scope="module")
def clean():
    out, flagged = run("enabled")
    assert all(not f for f in flagged) and np.isfinite(out).all()
    return out


@pytest.mark.parametrize("name", list(FAULTS))
def test_index_key_faults_are_caught_only_for_the_victim(name, clean):
    inject, kind = FAULTS[name]
    out, flagged = run("enabled", inject)
    k = tf.K
    assert [sorted(f) for f in flagged] == [[]] * k + [["r1"]] + [[]] * (tf.STEPS - k - 1)
    err = flagged[k]["r1"]
    if kind == "nonfinite":  # a NaN index key makes the row's attention output NaN: not a page-tag failure
        assert isinstance(err, NonFiniteLogitsError) and err.where == "attention"
    else:
        assert isinstance(err, KVIntegrityError) and err.kind == kind
    np.testing.assert_array_equal(out[:, [0, 2, 3]], clean[:, [0, 2, 3]])
    np.testing.assert_array_equal(out[:k, 1], clean[:k, 1])


def test_without_the_tracker_a_nan_index_key_goes_unnoticed(clean):
    out, flagged = run("noop", FAULTS["nan_index_key"][0])
    assert all(not f for f in flagged)
    assert not np.isfinite(out[tf.K:, 1]).all()


def test_planner_bytes_per_token_equal_the_cache_for_glm5():
    cfg = ModelConfig.from_hf_config(preset("glm-5"))
    for kv in ("fp8", "bf16"):
        plan = planner.plan("glm-5", kv=kv)
        dtype = {"fp8": "float8_e4m3fn", "bf16": "bfloat16"}[kv]
        assert plan["kv_bytes_per_token"] == paged.kv_bytes_per_token(cfg, dtype)
    assert paged.kv_bytes_per_token(cfg, "float8_e4m3fn") == 78 * (576 + 4) + 78 * (128 + 4)
    cut = cfg.replace(num_layers=2, moe_layers=cfg.moe_layers[:2], indexer_types=cfg.indexer_types[:2])
    pool = jax.eval_shape(lambda: paged.init_pool(cut, 3, 64, "float8_e4m3fn"))
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
    assert nbytes == 3 * 64 * paged.kv_bytes_per_token(cut, "float8_e4m3fn")
