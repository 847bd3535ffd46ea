"""The shipped default model (models/default): it loads as an HF checkpoint (phaseserve and transformers agree),
its held-out perplexity is far below the uniform-byte baseline, and greedy generation answers held-out tool
requests with schema-valid calls. Thresholds are the values measured on the shipped model (see
benchmarks/training/results.json) with a margin; the comments give the measurement."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import phaseserve as ps
from lab.data import eval_windows
from lab.eval import (
    cached_greedy_generate_fn,
    default_model_path,
    evaluate_tool_calls,
    greedy_generate_fn,
    heldout_perplexity,
    show_default_model,
)
from lab.eval.quality import tool_requests
from phaseserve.data import ByteTokenizer, examples

PATH = default_model_path()
TOK = ByteTokenizer()
N_TOOL = 48

# Measured on the shipped model (float32 compute of the bf16 weights; benchmarks/training/results.json):
PPL_MAX = 5.0  # held-out perplexity 3.10 on 16,384 bytes at the end of training; uniform over bytes is 256
VALIDITY_MIN = 0.9  # schema-valid calls on 200 held-out requests: 1.00
# Exact match (issue #18's bar, >= 0.9) is asserted on a small held-out sample below; on 200 requests: 0.91.


@pytest.fixture(scope="module")
def model():
    return ps.load_checkpoint(PATH, "float32")


@pytest.fixture(scope="module")
def generate(model):
    cfg, params = model
    return cached_greedy_generate_fn(params, cfg, batch_size=N_TOOL)


def test_checkpoint_is_small_complete_hf_directory(model):
    cfg, params = model
    files = {f.name: f.stat().st_size for f in PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) < 10 * 2**20
    hf = json.loads((PATH / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["model_type"] == "deepseek_v3"
    assert cfg.is_mla and cfg.is_moe and cfg.num_experts_per_tok == 2 and cfg.num_shared_experts == 1
    assert cfg.moe_layers[0] is False and all(cfg.moe_layers[1:]) and cfg.use_correction_bias
    assert ByteTokenizer.load(PATH) == TOK and cfg.vocab_size == TOK.vocab_size
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert 2e6 < n < 8e6


def test_heldout_perplexity_far_below_uniform(model):
    cfg, params = model
    res = heldout_perplexity(params, cfg, eval_windows("heldout", 256, num=16))
    print("held-out", res)
    assert res["ppl"] < PPL_MAX < 256 / 20


def test_greedy_tool_calls_on_heldout_requests(generate):
    rep = evaluate_tool_calls(generate, examples(N_TOOL, "heldout", seed=2))
    print(rep.as_dict(), rep.failures[:2])
    assert rep.has_call >= VALIDITY_MIN
    assert rep.validity >= VALIDITY_MIN
    assert rep.exact_match <= rep.validity


def test_shipped_model_copies_arguments_on_heldout_requests(model, generate):
    """Issue #18's bar on a small held-out sample of every kind (multi-turn ones where the context holds them):
    exact match >= 0.9 and a context of at least 1,024 positions."""
    cfg, _ = model
    reqs = tool_requests(cfg, 24, 160, "full", seed=5)
    rep = evaluate_tool_calls(generate, reqs, max_tokens=160)
    print(rep.as_dict(), rep.failures[:2])
    assert rep.exact_match >= 0.9 and rep.validity >= 0.9
    assert cfg.max_position_embeddings >= 1024 and rep.exact_by_kind.get("multi_turn", 0.0) >= 0.9


def test_cached_reference_matches_full_recompute(model, generate):
    """The two reference generators agree token for token on the trained model (float32)."""
    cfg, params = model
    prompts = [ex.prompt_ids(TOK) for ex in examples(4, "heldout", seed=3)]
    prompts.append(TOK.encode("import os\n\n\ndef ", bos=True))
    full = greedy_generate_fn(params, cfg, batch_size=5)(prompts, 40)
    assert generate(prompts, 40) == full


def test_transformers_reads_the_same_model(model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, params = model
    hf = transformers.AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    w = eval_windows("heldout", 96, num=2)[:, :-1]
    with torch.no_grad():
        ref = hf(torch.tensor(w, dtype=torch.long)).logits.numpy()
    ours = np.asarray(ps.forward(params, cfg, jnp.asarray(w)))
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=1e-3)


def test_demo_prints_text_and_a_tool_call(generate):
    lines: list[str] = []
    out = show_default_model(generate_fn=generate, show=lines.append, text_tokens=96)
    assert out["text"].startswith("class Queue") and len(out["text"]) > 80
    assert "=== tool call ===" in lines and any(line.startswith("generated: <tool_call>") for line in lines)
    assert out["valid"], out
