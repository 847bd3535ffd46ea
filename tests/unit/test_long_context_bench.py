"""The long-context benchmark's bookkeeping: FLOP counts, ratios, time boxes (the measurements themselves are the
committed run in benchmarks/long_context/)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from lab.bench import long_context as lc
from lab.bench.schema import experiment_spec
from phaseserve.model.params import init_params


def test_flops_count_weights_once_and_causal_pairs():
    cfg = lc.model_config("default", 512)
    params = init_params(cfg, jax.random.key(0), "float32")
    t = 7
    f = lc.prompt_flops(cfg, params, t)
    pairs = sum(1 for i in range(t) for j in range(t) if j <= i)  # causal (query, key) pairs
    dk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    assert f["attention"] == cfg.num_layers * cfg.num_heads * 2 * (dk + dv) * pairs
    # routed experts count top-k of E: doubling T doubles the weight FLOPs except the lm head (counted once)
    head = 2 * params.lm_head.size
    f2 = lc.prompt_flops(cfg, params, 2 * t)
    np.testing.assert_allclose(f2["weights"] - head, 2 * (f["weights"] - head), rtol=1e-12)
    experts = sum(2 * x.size for layer in params.layers if hasattr(layer.mlp, "router")
                  for x in (layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down))
    all_experts = lc.prompt_flops(cfg.replace(num_experts_per_tok=cfg.num_experts), params, t)
    np.testing.assert_allclose(all_experts["weights"] - f["weights"],
                               t * experts * (1 - cfg.num_experts_per_tok / cfg.num_experts), rtol=1e-12)


def test_variant_has_64_heads_and_2_layers():
    cfg = lc.model_config("heads64", 32768)
    assert (cfg.num_heads, cfg.num_layers, cfg.max_position_embeddings) == (64, 2, 32768)


def test_summary_ratios_and_missing_points():
    rows = [{"variant": "default", "T": 16384, "temp_bytes": 100, "peak_rss_bytes": 10, "flops_per_s": 5.0},
            {"variant": "default", "T": 65536, "temp_bytes": 420, "peak_rss_bytes": 30},
            {"variant": "default", "T": 1024, "flops_per_s": 4.0}]
    for r in rows:
        r["status"] = "ok"
    s = lc.summarize(rows)
    assert (s["temp_64k_over_16k"], s["rss_64k_over_16k"], s["flops_per_s_16k_over_1k"]) == (4.2, 3.0, 1.25)
    assert s["heads64_temp_32k_over_16k"] is None
    assert "| FLOP/s 16K / 1K (default) | 1.25 | >= 0.7 |" in lc.markdown(rows, s)


def test_a_point_past_its_time_box_is_reported_not_lost():
    row = lc.run_point("default", 1024, box_s=0.5)
    assert row["status"].startswith("timed out after 0 s") and row["T"] == 1024
    assert "seconds" not in row


def test_hydra_experiment_lists_the_points():
    with initialize_config_dir(config_dir=str(Path(lc.REPO, "configs")), version_base="1.3"):
        cfg = compose(config_name="experiment/long_context")
    spec = experiment_spec(cfg, lc.LongContextSpec)
    assert [lc.parse_point(p) for p in spec.points] == [(v, t, float(b)) for v, t, b in lc.POINTS]
    with pytest.raises(ValueError, match="unknown variant"):
        lc.parse_point("heads65:1024:10")


def test_engine_section_reports_each_part_and_what_is_missing(tmp_path):
    eng = {"status": "ok",
           "e2e": {"T": 32768, "new_tokens": 64, "chunk": 2048, "finish": "length", "generated": 64, "seconds": 900.0,
                   "ttft_s": 700.0, "prefill_steps": 16, "decode_steps": 63, "peak_rss_bytes": 3 * 2**30},
           "chunked_vs_unchunked": {"T": 4096, "new_tokens": 64, "chunk": 512, "float32_equal": True,
                                    "fp8_agreement": 0.75, "fp8_first_divergence": 48}}
    md = lc.engine_markdown(eng)
    assert "32,768-token prompt prefilled in 16 chunks of 2,048 tokens, then 64 decode tokens: peak RSS 3.00 GiB" in md
    assert "float32 tokens equal: True" in md and "agreement 0.75 (first divergence at token 48)" in md
    assert "Prefix reuse" not in md  # a part that did not run is not reported
    lc.write(tmp_path, [{"variant": "default", "T": 1024, "status": "ok"}], eng, log=lambda _: None)
    assert "## The engine end to end" in (tmp_path / "long_context.md").read_text()
    assert lc.json.loads((tmp_path / "long_context.json").read_text())["engine"] == eng
