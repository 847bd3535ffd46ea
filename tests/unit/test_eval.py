"""Quality metrics against hand computations on fresh random inputs, tool-call scoring, and the two reference
generators (full recompute and cached MLA decode) against step-by-step ``ps.forward`` on a small random model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phaseserve as ps
from lab.eval import (
    evaluate_tool_calls,
    first_divergence,
    generation_agreement,
    greedy_generate_fn,
    heldout_perplexity,
    kl_divergence,
    mean_nll,
    perplexity,
    score_tool_calls,
    sequence_match_rate,
    token_match_rate,
    top1_agreement,
)
from lab.eval.cached_decode import as_pages, cached_greedy_generate_fn, decode_step
from phaseserve.config import ModelConfig, SequenceTooLongError
from phaseserve.data import ByteTokenizer, ToolExample, examples

TOK = ByteTokenizer()


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print("seed", seed)
    return np.random.default_rng(seed)


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---- logits metrics -----------------------------------------------------------------------------------
def test_nll_and_perplexity_match_hand_computation(rng):
    b, t, v = 3, 5, 11
    logits = rng.normal(0, 3, (b, t, v)).astype(np.float32)
    targets = rng.integers(0, v, (b, t))
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    mask[0, 0] = 1
    total = count = 0.0
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                p = np.exp(logits[i, j] - logits[i, j].max())
                total += -np.log(p[targets[i, j]] / p.sum())
                count += 1
    assert mean_nll(logits, targets, mask) == pytest.approx(total / count, rel=1e-5)
    assert perplexity(logits, targets, mask) == pytest.approx(np.exp(total / count), rel=1e-5)
    assert perplexity(np.zeros((2, 3, v)), rng.integers(0, v, (2, 3))) == pytest.approx(v, rel=1e-5)
    with pytest.raises(ValueError, match="no positions"):
        mean_nll(logits, targets, np.zeros_like(mask))


def test_kl_and_top1_match_hand_computation(rng):
    b, t, v = 2, 7, 13
    ref = rng.normal(0, 2, (b, t, v)).astype(np.float32)
    test = (ref + rng.normal(0, 0.7, (b, t, v))).astype(np.float32)
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    mask[1, 2] = 1
    lp, lq = _np_log_softmax(ref.astype(np.float64)), _np_log_softmax(test.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    assert kl_divergence(ref, test, mask) == pytest.approx((kl * mask).sum() / mask.sum(), rel=1e-4)
    assert kl_divergence(ref, test) == pytest.approx(kl.mean(), rel=1e-4)
    assert kl_divergence(ref, ref) == pytest.approx(0.0, abs=1e-6)
    assert kl_divergence(ref, ref + 5.0) == pytest.approx(0.0, abs=1e-5)  # shift invariant
    same = ref.argmax(-1) == test.argmax(-1)
    assert top1_agreement(ref, test, mask) == pytest.approx((same * mask).sum() / mask.sum())
    assert top1_agreement(ref, ref) == 1.0


def test_generation_match_rates():
    a = [[1, 2, 3, 4], [5, 6], [7]]
    b = [[1, 2, 9, 4], [5, 6, 8], [7]]
    assert token_match_rate(a, b) == pytest.approx((3 + 2 + 1) / (4 + 3 + 1))
    assert sequence_match_rate(a, b) == pytest.approx(1 / 3)
    assert first_divergence(a[0], b[0]) == 2 and first_divergence(a[1], b[1]) == 2 and first_divergence(a[2], b[2]) == 1
    rng = np.random.default_rng()
    x = [rng.integers(0, 5, rng.integers(1, 9)).tolist() for _ in range(20)]
    y = [[t if rng.random() < 0.8 else 99 for t in s] for s in x]
    expect = sum(sum(p == q for p, q in zip(s, u, strict=True)) for s, u in zip(x, y, strict=True)) / sum(map(len, x))
    assert token_match_rate(x, y) == pytest.approx(expect)
    assert token_match_rate(x, x) == 1.0 and sequence_match_rate(x, x) == 1.0
    with pytest.raises(ValueError):
        token_match_rate(x, y[:-1])


# ---- tool-call scoring ------------------------------------------------------------------------------
def test_score_tool_calls_counts_valid_and_exact():
    exs = examples(4, "heldout", seed=int(np.random.default_rng().integers(10**6)))
    right = exs[0].completion_ids(TOK)
    other = next(e for e in examples(50, "heldout", seed=7) if e.call["name"] == exs[1].call["name"]
                 and e.call != exs[1].call)
    valid_wrong = other.completion_ids(TOK)
    invalid = [TOK.tool_start_id, *TOK.encode('{"name": "set_timer", "arguments": {"minutes": -3}}'), TOK.tool_end_id]
    garbage = TOK.encode("def f(x): return x")
    rep = score_tool_calls([right, valid_wrong, invalid, garbage], exs)
    assert (rep.n, rep.validity, rep.exact_match, rep.has_call) == (4, 0.5, 0.25, 0.75)
    assert len(rep.failures) == 3 and rep.failures[1]["errors"]
    oracle = lambda prompts, n: [ex.completion_ids(TOK) for ex in exs]
    assert evaluate_tool_calls(oracle, exs).exact_match == 1.0
    with pytest.raises(ValueError):
        score_tool_calls([right], exs)


# ---- reference generators -----------------------------------------------------------------------------
def _tiny_mla() -> ModelConfig:
    return ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=264, hidden_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=4, head_dim=12, intermediate_size=64, attention="mla",
                       q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                       scoring_func="sigmoid", use_correction_bias=True, moe_layers=(False, True),
                       max_position_embeddings=64, eos_token_ids=(257,))


def _check_greedy(params, cfg, prompts, outs, max_tokens):
    """Every emitted token is an argmax of ps.forward on its prefix (within 1e-4), and a row stops exactly at
    max_tokens or right after a stop token. One jitted forward over all rows, right-padded (causal)."""
    width = cfg.max_position_embeddings
    buf = np.full((len(prompts), width), TOK.pad_id, np.int32)
    for r, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert 1 <= len(out) <= max_tokens
        assert len(out) == max_tokens or out[-1] == 257
        assert 257 not in out[:-1]
        buf[r, : len(p) + len(out)] = list(p) + out
    logits = np.asarray(_FORWARD(params, cfg, buf))
    for r, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        for i, t in enumerate(out):
            row = logits[r, len(p) + i - 1]
            assert row[t] >= row.max() - 1e-4


_FORWARD = jax.jit(ps.forward, static_argnums=1)


@pytest.fixture(scope="module")
def tiny():
    """A random tiny MLA model and both reference generators (module-scoped: each compiles once per shape)."""
    cfg = _tiny_mla()
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("model seed", seed)
    params = ps.init_params(cfg, jax.random.key(seed))
    gens = {"full": greedy_generate_fn(params, cfg, batch_size=4, bucket=32),
            "cached": cached_greedy_generate_fn(params, cfg, batch_size=4, bucket=32)}
    return cfg, params, gens


def test_reference_generators_are_greedy(tiny, rng):
    cfg, params, gens = tiny
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 20, 5)]
    for gen in gens.values():
        _check_greedy(params, cfg, prompts, gen(prompts, 12), 12)
    with pytest.raises(SequenceTooLongError):
        gens["full"](prompts, 60)
    with pytest.raises(ValueError, match="empty"):
        gens["cached"]([[]], 4)


def test_stop_token_ends_generation(tiny, rng):
    """With one of its own greedy tokens declared a stop token, each row ends right after its first occurrence."""
    cfg, params, gens = tiny
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 20, 3)]
    free = gens["cached"](prompts, 12)  # stops only at <eos> (257)
    stop = free[0][int(rng.integers(0, len(free[0])))]
    expect = [out[: out.index(stop) + 1] if stop in out else out for out in free]
    assert cached_greedy_generate_fn(params, cfg, stop_ids=[stop, 257], batch_size=4)(prompts, 12) == expect
    agree = generation_agreement(gens["full"], gens["cached"], prompts, 12)
    assert agree["token_match"] > 0.9  # random-model near-ties may flip a token between the two in f32


def _tiny_gqa() -> ModelConfig:
    return ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=264, hidden_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=12, intermediate_size=64, qk_norm=True,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(False, True),
                       max_position_embeddings=64, eos_token_ids=(257,))


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_cached_decode_step_matches_forward_logits(rng, attention):
    cfg = _tiny_mla() if attention == "mla" else _tiny_gqa()
    params = ps.init_params(cfg, jax.random.key(int(rng.integers(2**31))))
    b, t = 3, 24
    tokens = jnp.asarray(rng.integers(0, 264, (b, t)), jnp.int32)
    full = ps.forward(params, cfg, tokens)
    start = 9
    _, kvs = jax.jit(ps.prefill, static_argnums=1)(params, cfg, tokens.at[:, start:].set(258))  # junk beyond start
    caches = as_pages(kvs)
    step = jax.jit(decode_step, static_argnums=1)
    for pos in range(start, t):
        logits, caches = step(params, cfg, tokens[:, pos], jnp.full((b,), pos, jnp.int32), caches)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, pos]), atol=2e-4, rtol=2e-4)


def test_heldout_perplexity_uniform_and_padding():
    cfg = _tiny_mla()
    v = cfg.vocab_size
    windows = np.random.default_rng().integers(0, 256, (5, 17)).astype(np.int32)
    windows[0, 10:] = TOK.pad_id
    uniform = lambda p, t: jnp.zeros((*t.shape, v), jnp.float32)
    out = heldout_perplexity(None, cfg, windows, batch_size=2, logits_fn=uniform)
    assert out["ppl"] == pytest.approx(v, rel=1e-5)
    assert out["tokens"] == 5 * 16 - 7
    assert out["bits_per_byte"] == pytest.approx(np.log2(v), rel=1e-5)
    # A model that puts all mass on the true next byte has perplexity 1 (token-weighted across batches).
    table = {tuple(w[:-1]): w[1:] for w in windows}

    def oracle(p, t):
        tgt = np.stack([table[tuple(np.asarray(row))] for row in t])
        return jnp.asarray(np.where(np.arange(v) == tgt[..., None], 50.0, 0.0), jnp.float32)

    assert heldout_perplexity(None, cfg, windows, batch_size=2, logits_fn=oracle)["ppl"] == pytest.approx(1.0, abs=1e-6)


def test_tool_example_layout():
    ex = ToolExample("Set a timer for 3 minutes.", {"name": "set_timer", "arguments": {"minutes": 3}})
    assert TOK.decode(ex.ids(TOK)) == ('<bos>Set a timer for 3 minutes.\n<tool_call>{"name": "set_timer", '
                                       '"arguments": {"minutes": 3}}</tool_call><eos>')
