"""Long context in the engine: chunked prefill gives the tokens of the unchunked prefill (float32; chunk sizes 1, 7,
64 and 512, mixed batches, MLA and GQA), prefix reuse computes a shared prefix once and gives the tokens of no
reuse, and the handoff ships whole pages only (bytes per prompt token = what the pages hold, FP8 and BF16)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import phaseserve as ps
from lab.bench.long_context import model_config
from phaseserve.cache.paged import kv_bytes_per_token
from phaseserve.engine import Request
from tests.e2e.engine_utils import F32, make_checkpoint

pytestmark = pytest.mark.slow  # minutes of CPU: run by `pytest -m slow` (README), not the default run

PAGE = 16


def serve(budget: int, quant=F32, num_pages: int = 160, max_batch: int = 4, max_context: int = 1024,
          **cache) -> ps.ServeConfig:
    return ps.ServeConfig(mode="disaggregated", quant=quant, max_batch=max_batch, max_prefill_tokens=budget,
                          max_context=max_context, cache=ps.CacheConfig(page_size=PAGE, num_pages=num_pages, **cache))


@pytest.fixture(scope="module")
def model():
    """The default architecture (MLA + MoE), random float32 weights, context raised to 2048."""
    cfg = model_config("default", 2048)
    return cfg, ps.init_params(cfg, jax.random.key(3), "float32")


def prompts(vocab: int, lengths, seed: int = 0, max_tokens: int = 6) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(id=f"r{i}", prompt=rng.integers(0, vocab, n).tolist(), max_tokens=max_tokens, ignore_eos=True)
            for i, n in enumerate(lengths)]


def test_chunked_prefill_gives_the_unchunked_tokens(model):
    cfg, params = model
    reqs = prompts(cfg.vocab_size, [560, 37, 5, 130])  # one long prompt beside short ones: mixed chunk batches
    whole = ps.Engine(cfg, params, serve(4096))
    ref = [o.tokens for o in whole.generate(reqs)]
    assert whole.metrics.prefill_batches == 1  # the reference really is one unchunked pass
    for budget in (512, 64, 7, 1):
        if budget == 1:  # one token per step: the short prompts (each decoding while the next is prefilled)
            reqs, ref = reqs[1:], ref[1:]
        eng = ps.Engine(cfg, params, serve(budget))
        outs = eng.generate(reqs)
        assert [o.tokens for o in outs] == ref, budget
        assert eng.metrics.prefill_tokens == sum(len(r.prompt) for r in reqs)
        assert eng.metrics.prefill_batches >= -(-sum(len(r.prompt) for r in reqs) // budget)  # chunks, not one pass
        assert eng.prefill.allocator.num_free == eng.prefill.num_pages - 1  # prefill pages all handed back
        assert eng.allocator.num_free == eng.num_pages - 1
        eng.check_invariants()


def test_chunked_prefill_on_gqa_matches_transformers(tmp_path):
    from tests.e2e.engine_utils import hf_greedy

    hf, cfg, params = make_checkpoint("llama", tmp_path, seed=2)
    reqs = prompts(cfg.vocab_size, [150, 9, 40], seed=1, max_tokens=5)
    eng = ps.Engine(cfg, params, ps.ServeConfig(quant=F32, max_prefill_tokens=7,
                                                cache=ps.CacheConfig(page_size=4, num_pages=96)))
    outs = eng.generate(reqs)
    assert eng.metrics.prefill_batches >= (150 + 9 + 40) // 7
    assert [o.tokens for o in outs] == [hf_greedy(hf, r) for r in reqs]


def test_preemption_by_recompute_runs_through_chunks(model):
    cfg, params = model
    reqs = prompts(cfg.vocab_size, [40, 35, 45], seed=2, max_tokens=32)  # 5 pages each at the end; 10 in the pool
    ref = [o.tokens for o in ps.Engine(cfg, params, serve(4096)).generate(reqs)]
    eng = ps.Engine(cfg, params, serve(16, num_pages=11, max_context=160, admission="on_demand"))
    outs = eng.generate(reqs)
    assert eng.metrics.preemptions > 0
    assert [o.tokens for o in outs] == ref
    assert eng.allocator.num_free == eng.num_pages - 1 and eng.prefill.allocator.num_free == eng.prefill.num_pages - 1


def test_a_shared_prefix_is_computed_once_and_gives_the_tokens_of_no_reuse(model):
    cfg, params = model
    rng = np.random.default_rng(7)
    n = 1024  # 64 full pages
    prefix = rng.integers(0, cfg.vocab_size, n).tolist()
    reqs = [Request(id=f"s{i}", prompt=prefix + rng.integers(0, cfg.vocab_size, 3 + i).tolist(), max_tokens=5,
                    ignore_eos=True) for i in range(8)]
    other = Request(id="t", prompt=prefix + [1, 2, 3], max_tokens=5, ignore_eos=True, tenant="other")
    eng = ps.Engine(cfg, params, serve(512, max_batch=9, max_context=2048, num_pages=640))
    outs = eng.generate(reqs + [other])  # submitted together
    suffixes = sum(len(r.prompt) - n for r in reqs[1:])
    # s0 computes the prefix; s1..s7 only their suffixes; the other tenant never hits and computes all of its own
    assert eng.metrics.prefill_tokens == len(reqs[0].prompt) + suffixes + len(other.prompt)
    assert [o.metrics.prefix_hit_tokens for o in outs] == [0] + [n] * 7 + [0]
    s = eng.summary()
    assert s["prefill_tokens_saved"] == 7 * n and s["prefix_deferrals"] >= 7
    assert s["prefix_hit_rate"] == pytest.approx(7 * 64 / (9 * 64))
    no_reuse = ps.Engine(cfg, params, serve(512, max_batch=9, max_context=2048, num_pages=640))
    no_reuse.scheduler.prefix_caching = False
    ref = no_reuse.generate(reqs + [other])
    assert no_reuse.metrics.prefill_tokens == sum(len(r.prompt) for r in reqs + [other])
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert eng.allocator.num_free == eng.num_pages - 1
    eng.check_invariants()


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "bfloat16"])
def test_handoff_ships_whole_pages_only(model, kv):
    cfg, params = model
    quant = dataclasses.replace(F32, kv_dtype=kv, prefill_kv_dtype="bfloat16")
    reqs = prompts(cfg.vocab_size, [1, 16, 17, 100], seed=3, max_tokens=2)
    eng = ps.Engine(cfg, params, serve(64, quant=quant))
    outs = eng.generate(reqs)
    assert all(o.finish_reason == "length" for o in outs)
    pages = sum(-(-len(r.prompt) // PAGE) for r in reqs)
    assert eng.handoff.bytes_moved == pages * PAGE * kv_bytes_per_token(cfg, kv)
    per_token = eng.handoff.bytes_moved / sum(len(r.prompt) for r in reqs)
    print(f"{kv}: handoff {per_token:.0f} bytes per prompt token; the pages hold "
          f"{kv_bytes_per_token(cfg, kv)} per token slot")
