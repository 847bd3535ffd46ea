"""Issue 42, defect 4: NaN logits were emitted as token 0 (``finish_reason="length"``, no error), and with the
integrity check on an overflow in the model was reported as a KV integrity abort.

A model whose activations overflow for one token id (its embedding row set to inf: the residual stream is inf and
every normalised row after it NaN) stands in for an overflow inside the model. The request that feeds that token
ends with ``finish_reason="error"`` and a :class:`NonFiniteLogitsError`, nothing emitted for the step that
overflowed; it is not counted as an integrity abort; the other requests of the batch get exactly the tokens they get
alone; and the pages the overflowing request wrote, in both phases' pools, are scrubbed before they are freed (a NaN
left in a masked key slot of a reused page reaches the next owner's attention output through ``0 * NaN``)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phaseserve as ps
from phaseserve.cache import paged
from phaseserve.config import ModelConfig
from phaseserve.engine.request import NonFiniteLogitsError, Request
from phaseserve.presets import preset
from tests.e2e.engine_utils import serve_config

POISON = 7  # the token id whose embedding overflows


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_hf_config(preset("tiny-mla-moe"))
    params = ps.init_params(cfg, jax.random.key(0), "float32")
    embed = np.asarray(params.embed).copy()
    embed[POISON] = np.inf
    return cfg, params.replace(embed=jax.numpy.asarray(embed))


def _prompts(cfg, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(POISON + 1, cfg.vocab_size, int(rng.integers(3, 12)))] for _ in range(n)]


def _alone(cfg, params, serve, reqs) -> dict[str, list[int]]:
    engine = ps.Engine(cfg, params, serve)
    return {r.id: engine.generate([r])[0].tokens for r in reqs}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("integrity", [True, False])
def test_overflow_in_the_prompt_ends_that_request_alone(model, mode, integrity):
    cfg, params = model
    serve = serve_config(mode, num_pages=64, integrity=integrity)
    good = [Request(id=f"g{i}", prompt=p, max_tokens=6, ignore_eos=True) for i, p in enumerate(_prompts(cfg, 3, 1))]
    head = [9, 10, 12, 13, 14, 15, 16, 17]  # two full pages before the overflowing token
    bad = Request(id="bad", prompt=head + [POISON, 11], max_tokens=6, ignore_eos=True)
    engine = ps.Engine(cfg, params, serve)
    outs = {o.id: o for o in engine.generate([good[0], bad, *good[1:]])}
    assert outs["bad"].finish_reason == "error" and isinstance(outs["bad"].error, NonFiniteLogitsError)
    assert outs["bad"].tokens == []  # token 0 used to go out here
    assert engine.metrics.aborts == 0  # not a KV integrity failure
    want = _alone(cfg, params, serve, good)
    for r in good:
        assert outs[r.id].error is None and outs[r.id].tokens == want[r.id], r.id
    # the overflowing request's pages are back in the free queue scrubbed: no page of either pool holds NaN/inf
    for pool in (engine.prefill.pool, engine.decode.pool):
        assert all(bool(jnp.all(jnp.isfinite(paged.as_values(a)))) for a in jax.tree.leaves(pool))
    engine.check_invariants()


@pytest.mark.parametrize("integrity", [True, False])
def test_overflow_in_decode_ends_the_request_with_the_tokens_before_it(model, integrity):
    """The overflow comes with the request's first generated token (its embedding is made to overflow): the first
    token goes out, the decode step that feeds it ends the request typed, not as a KV integrity abort."""
    cfg, params = model
    serve = serve_config("disaggregated", num_pages=64, integrity=integrity)
    prompt = _prompts(cfg, 1, 2)[0]
    first = ps.Engine(cfg, params, serve).generate([Request(id="p", prompt=prompt, max_tokens=1)])[0].tokens[0]
    assert first != POISON and first not in prompt
    embed = np.asarray(params.embed).copy()
    embed[first] = np.inf
    poisoned = params.replace(embed=jax.numpy.asarray(embed))
    engine = ps.Engine(cfg, poisoned, serve)
    other = Request(id="other", prompt=[POISON + 1, POISON + 2], max_tokens=4, ignore_eos=True)
    outs = {o.id: o for o in engine.generate([Request(id="r", prompt=prompt, max_tokens=5, ignore_eos=True), other])}
    assert outs["r"].tokens == [first]
    assert outs["r"].finish_reason == "error" and isinstance(outs["r"].error, NonFiniteLogitsError), outs["r"]
    assert engine.metrics.aborts == 0
    assert outs["other"].error is None and len(outs["other"].tokens) == 4
    assert all(bool(jnp.all(jnp.isfinite(paged.as_values(a)))) for a in jax.tree.leaves(engine.decode.pool))


# ---- issue 61: an overflow in the attention scores of a checkpoint that loads without complaint --------------------
def write_overflowing_checkpoint(dst) -> None:
    """The shipped default model with layer 0's ``kv_a_layernorm`` scaled by 1e30, saved as a checkpoint in ``dst``:
    it loads (every stored value is finite), its pages hold finite values, and its activations overflow (the
    attention scores and the next layer's mean square). Before the fix: with the integrity check off the request
    ended with token 0 emitted (transformers' RMSNorm turns the overflow into zeros, whose argmax is 0); with it on,
    as a ``KVIntegrityError`` counted as an integrity abort."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lab.eval.demo import default_model_path

    src = default_model_path()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_a_layernorm.weight"
    tensors[name] = (tensors[name].float() * 1e30).to(tensors[name].dtype)
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    dst = tmp_path_factory.mktemp("overflow")
    write_overflowing_checkpoint(dst)
    return ps.load_checkpoint(dst, dtype="float32")


def assert_overflow_outputs(outs: list, summary: dict) -> None:
    """Every request ended ``error`` with a ``NonFiniteLogitsError`` and emitted nothing; none counted as an
    integrity abort."""
    for o in outs:
        assert o.finish_reason == "error" and isinstance(o.error, NonFiniteLogitsError), (o.id, o.error)
        assert o.tokens == [], (o.id, o.tokens)  # token 0 used to go out here
    assert (summary["aborted"], summary["errors"], summary["nonfinite_errors"]) == (0, len(outs), len(outs))


def overflow_requests() -> list[Request]:
    rng = np.random.default_rng(5)
    return [Request(id=f"r{i}", prompt=[int(t) for t in rng.integers(0, 256, n)], max_tokens=5, ignore_eos=True)
            for i, n in enumerate((3, 13, 21))]  # 13 and 21 tokens: several chunks of 8 where chunked


MODES = {  # name -> (mode, integrity, attention implementation, decode lookahead, prefill tokens per step)
    "colocated-integrity-reference": ("colocated", True, "reference", True, 2048),
    "disaggregated-integrity-pallas": ("disaggregated", True, "pallas", True, 2048),
    "disaggregated-chunked-no-lookahead": ("disaggregated", False, "reference", False, 8),
    "colocated-chunked-pallas": ("colocated", False, "pallas", True, 8),
}


@pytest.mark.parametrize("name", list(MODES))
def test_an_attention_overflow_emits_nothing_and_is_no_integrity_abort(overflowing, name):
    cfg, params = overflowing
    mode, integrity, attn, lookahead, chunk = MODES[name]
    serve = serve_config(mode, num_pages=64, integrity=integrity, decode_lookahead=lookahead,
                         max_prefill_tokens=chunk)
    engine = ps.Engine(cfg, params, serve, attn_impl=attn)
    assert_overflow_outputs(engine.generate(overflow_requests()), engine.summary())
    assert engine.allocator.num_free == engine.num_pages - 1  # nothing leaked
    for pool in (engine.prefill.pool, engine.decode.pool):
        assert all(bool(jnp.all(jnp.isfinite(paged.as_values(a)))) for a in jax.tree.leaves(pool))
    engine.check_invariants()


def test_metrics_count_an_overflow_apart_from_integrity_aborts(overflowing):
    """``/metrics``: the overflow is ``phaseserve:nonfinite_errors_total``, and ``integrity_aborts_total`` stays 0
    (it used to count it)."""
    import http.client

    from phaseserve.data.tokenizer import ByteTokenizer
    from phaseserve.server import EngineBackend, create_app
    from phaseserve.server.launch import start_in_thread

    cfg, params = overflowing
    engine = ps.Engine(cfg, params, serve_config("colocated", num_pages=64, integrity=True))
    srv, thread, base = start_in_thread(create_app(EngineBackend(engine), ByteTokenizer(), "m"))
    try:
        host, port = base.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=b'{"model": "m", "prompt": "hello", "max_tokens": 4}',
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        body = r.read().decode()
        assert r.status == 500 and "NonFiniteLogitsError" in body, (r.status, body)
        end = time.monotonic() + 30
        while True:  # the counters are read from the engine after the loop iteration that ended the request
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("phaseserve:") and "_total" in line.split("{")[0]}
            if values.get("phaseserve:nonfinite_errors_total") or time.monotonic() > end:
                break
            time.sleep(0.05)
        conn.close()
    finally:
        srv.should_exit = True
        thread.join(30)
    assert values["phaseserve:nonfinite_errors_total"] == 1.0, values
    assert values["phaseserve:integrity_aborts_total"] == 0.0, values
