"""The decode- and prefill-step profilers (``lab.bench.profile_decode`` / ``profile_prefill``): control-flow
ops are not counted on top of their bodies' ops (a loop's trace event spans its body's events), and a profile of a
small MoE model's decode step (and prefill chunk step) attributes time to attention and the MoE dispatch (and the
prefill side's page writes and sampling), with the largest ops listed."""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from lab.bench import profile_decode as P
from phaseserve.config import ModelConfig

MLA = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=12, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, scoring_func="sigmoid", norm_topk_prob=True, moe_layers=(False, True),
                  attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def _loop(x, w):  # x f32[8, 8]: a while loop (dynamic trip count) whose body is a dot
    n = 3 + (x[0, 0] > 0).astype(jnp.int32)
    return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)


def test_a_loop_is_a_container_and_its_trace_event_is_not_counted():
    x = jax.random.normal(jax.random.key(0), (8, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    f = jax.jit(_loop)
    hlo = f.lower(x, w).compile().as_text()
    loops = P.containers(hlo)
    assert any(n.startswith("while") for n in loops)
    assert not any("dot" in n or "fusion" in n for n in loops)
    f(x, w).block_until_ready()
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    f(x, w).block_until_ready()
    jax.profiler.stop_trace()
    events = P._op_times(d)
    assert loops & set(events), "the loop has a trace event of its own: counting it would count its body twice"
    body = set(events) - loops
    assert body and all(n in P.describe_hlo(hlo) for n in body)


def test_profile_point_splits_a_small_moe_step_by_component_without_containers():
    ms = P.profile_point(MLA, 4, steps=2, top=8, context=12, page_size=4)
    assert ms["attention"] > 0 and ms["MoE dispatch"] > 0 and ms["dense projections"] > 0
    assert abs(sum(ms[c] for c in P.COMPONENTS) - ms["op time"]) < 1e-9
    top = ms["top ops"]
    assert 0 < len(top) <= 8 and [t[2] for t in top] == sorted((t[2] for t in top), reverse=True)
    assert all(c in P.COMPONENTS and not desc.startswith("while") for c, desc, _ in top)
    assert np.isfinite(ms["wall"]) and ms["wall"] > 0


def test_prefill_profile_splits_a_small_moe_chunk_step_by_component(tmp_path):
    from lab.bench import profile_prefill

    ms = profile_prefill.profile_point(MLA, 2, 8, steps=2, top=6, page_size=4)
    # the prefill side's scopes: the flash prefill, the chunk's KV written into its pages, the first token sampled
    assert ms["attention"] > 0 and ms["MoE dispatch"] > 0 and ms["dense projections"] > 0
    assert ms["page writes"] > 0 and ms["sampling"] > 0 and ms["integrity"] == 0
    assert abs(sum(ms[c] for c in P.COMPONENTS) - ms["op time"]) < 1e-9 and ms["wall"] > 0
    top = ms.pop("top ops")
    md = profile_prefill.markdown({"label": "t", "environment": {"load_average_1m_5m_15m": [0, 0, 0]},
                                   "rows": [{"model": "mla", "batch": 2, "chunk": 8, "ms": ms, "top_ops": top}]})
    assert "| mla | 2 | 8 | 16 |" in md and "### Top ops: mla, 2 x 8 tokens" in md


def test_compare_pairs_prefill_rows_by_batch_and_chunk():
    def profile(label, wall):
        rows = [{"model": "m", "batch": 8, "chunk": c, "ms": {**dict.fromkeys(P.COMPONENTS, 1.0), "op time": 7.0,
                                                               "wall": wall * c}} for c in (64, 128)]
        return {"label": label, "environment": {"load_average_1m_5m_15m": [0, 0, 0], "cpu_cores": 2}, "rows": rows}

    md = P.compare(profile("before", 1.0), profile("after", 0.5))
    assert md.startswith("# Prefill chunk step profile: before -> after")
    assert "| model | batch | chunk |" in md
    assert "| m | 8 | 64 |" in md and md.count("| m | 8 |") == 2
    assert "128 -> 64 |" in md  # the 8 x 128 row's wall, paired with its own chunk, not the 8 x 64 one's
