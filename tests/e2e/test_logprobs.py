"""Engine log-probabilities (vLLM's ``logprobs`` / ``prompt_logprobs``) against a plain reference: ``log_softmax`` of
one full causal forward (``transformer.forward``) over prompt + generated tokens, on random inputs.

Float32 weights and KV, so the engine's paged, chunked prefill and decode agree with the reference to float
rounding. Prompts longer than ``max_prefill_tokens`` are scored across several chunks; a scoring request
(``max_tokens=0``) generates nothing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import phaseserve as ps
from phaseserve.engine import InvalidParameterError, Request
from phaseserve.model.transformer import forward
from tests.e2e.engine_utils import make_checkpoint, serve_config

TOL = 2e-4  # float32 end to end: the chunked, paged computation vs one dense forward


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, cfg, params = make_checkpoint("llama", tmp_path_factory.mktemp("lp"), seed=3)
    return cfg, params


def _reference(params, cfg, tokens: list[int]) -> np.ndarray:
    """f32[T, V]: log_softmax of the logits at every position of one dense forward."""
    logits = forward(params, cfg, np.asarray([tokens], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(np.float32), axis=-1))


def _check(entry, ref_row: np.ndarray, token: int, n_top: int) -> None:
    assert entry.token == token
    assert abs(entry.logprob - ref_row[token]) < TOL
    ids = [t for t, _ in entry.top]
    assert len(ids) == n_top
    np.testing.assert_allclose([v for _, v in entry.top], np.sort(ref_row)[::-1][:n_top], atol=TOL)
    np.testing.assert_allclose([ref_row[t] for t in ids], [v for _, v in entry.top], atol=TOL)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_prompt_and_generated_logprobs_match_a_dense_forward(model, mode):
    cfg, params = model
    rng = np.random.default_rng(7)
    reqs = [Request(id=f"r{i}", prompt=rng.integers(0, cfg.vocab_size, n).tolist(), max_tokens=m,
                    temperature=t, seed=i, ignore_eos=True, logprobs=k, prompt_logprobs=pk)
            for i, (n, m, t, k, pk) in enumerate([(23, 5, 0.0, 3, 2), (9, 4, 1.0, 0, 5), (17, 3, 0.8, 20, None),
                                                  (6, 3, 0.0, None, 0)])]
    plain = Request(id="plain", prompt=reqs[0].prompt, max_tokens=5, ignore_eos=True)
    engine = ps.Engine(cfg, params, serve_config(mode, max_prefill_tokens=16))  # the 23- and 17-token prompts: 2 chunks
    outs = engine.generate([*reqs, plain])
    for req, out in zip(reqs, outs, strict=False):
        assert len(out.tokens) == req.max_tokens
        ref = _reference(params, cfg, req.prompt + out.tokens)
        n = len(req.prompt)
        if req.logprobs is None:
            assert out.logprobs is None
        else:
            assert len(out.logprobs) == len(out.tokens)
            for j, (tok, entry) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
                _check(entry, ref[n - 1 + j], tok, req.logprobs)
        if req.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
            for t in range(1, n):
                _check(out.prompt_logprobs[t], ref[t - 1], req.prompt[t], req.prompt_logprobs)
    assert outs[-1].tokens == outs[0].tokens and outs[-1].logprobs is None  # greedy: asking changes no token


def test_scoring_request_generates_nothing_and_skips_prefix_hits(model):
    cfg, params = model
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab_size, 13).tolist()
    engine = ps.Engine(cfg, params, serve_config("colocated"))
    engine.generate([Request(id="warm", prompt=prompt, max_tokens=2)])  # its full pages are now cached
    score = Request(id="score", prompt=prompt, max_tokens=0, prompt_logprobs=1)
    [out] = engine.generate([score])
    assert out.tokens == [] and out.finish_reason == "length"
    assert out.metrics.prefix_hit_tokens == 0
    ref = _reference(params, cfg, prompt)
    for t in range(1, len(prompt)):
        _check(out.prompt_logprobs[t], ref[t - 1], prompt[t], 1)
    assert engine.allocator.num_used == 0 and engine.prefill.allocator.num_used == 0
    [bad] = engine.generate([Request(id="bad", prompt=prompt, max_tokens=0)])  # max_tokens=0 without scoring
    assert isinstance(bad.error, InvalidParameterError)
    [bad] = engine.generate([Request(id="bad2", prompt=prompt, logprobs=21)])
    assert isinstance(bad.error, InvalidParameterError)



def test_min_tokens_keeps_an_early_stop_token_going(model):
    """The finish rule: a stop token before ``min_tokens`` tokens are out does not end the request."""
    cfg, params = model
    prompt = [1, 2, 3]
    engine = ps.Engine(cfg, params, serve_config("colocated"))
    [greedy] = engine.generate([Request(id="g", prompt=prompt, max_tokens=8, ignore_eos=True)])
    stop = greedy.tokens[1]
    a, b = engine.generate([Request(id="a", prompt=prompt, max_tokens=8, stop_token_ids=(stop,), ignore_eos=True),
                            Request(id="b", prompt=prompt, max_tokens=8, stop_token_ids=(stop,), ignore_eos=True,
                                    min_tokens=4)])
    assert a.tokens == greedy.tokens[:2] and a.finish_reason == "stop"
    assert b.tokens[:4] == greedy.tokens[:4] and len(b.tokens) >= 5
    assert stop not in b.tokens[4:] or b.finish_reason == "stop"
    [bad] = engine.generate([Request(id="bad", prompt=prompt, max_tokens=2, min_tokens=3)])
    assert isinstance(bad.error, InvalidParameterError)
