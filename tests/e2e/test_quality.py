"""The quality experiment end to end at tiny settings, and the quality limits: every representation is compared
with the float32 model under thresholds (``eval.quality.LIMITS``) that a broken quantizer fails."""

from __future__ import annotations

import json

import numpy as np
import pytest

import phaseserve as ps
from pallas_kernels.int4_matmul import Int4Weight
from phaseserve.data.corpus import eval_windows
from phaseserve.eval import quality
from phaseserve.eval.demo import default_model_path
from phaseserve.eval.quality import COMBOS, WEIGHTS, run
from phaseserve.quant import quantize as quantize_mod


def test_quality_table_is_measured_and_written(tmp_path):
    rows = run(default_model_path(), tmp_path, num_requests=2, max_tokens=12, num_windows=2, calib_sequences=2)
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved == json.loads(json.dumps(rows))
    assert set(rows["weights"]) == set(WEIGHTS) and len(rows["serving"]) == len(COMBOS)
    ref = rows["weights"]["float32"]
    assert ref["kl"] < 1e-9 and ref["top1"] == 1.0 and 1.0 < ref["ppl"] < 10.0
    for name in WEIGHTS:  # every representation within its limits against float32
        assert quality.check(name, rows["weights"][name], ref) == [], name
        assert rows["limits_broken"][name] == []
    for name in ("fp8", "int4-rtn", "int4-gptq"):
        assert rows["weights"][name]["kl"] > 1e-6, name  # a quantized model is really a different model
    for r in rows["serving"]:
        assert 0.0 <= r["validity"] <= 1.0 and 0.0 <= r["token_agreement_vs_f32"] <= 1.0
    lines = quality.final_lines(rows, tmp_path)
    assert lines[0].endswith("-> every limit holds") and lines[-1] == f"run directory: {tmp_path}"
    table = (tmp_path / "README.md").read_text()
    assert "| int4-gptq |" in table and "every limit holds" in table


@pytest.fixture(scope="module")
def f32_model():
    cfg, f32 = ps.load_checkpoint(default_model_path(), "float32")
    return cfg, f32, eval_windows("heldout", seq_len=min(256, cfg.max_position_embeddings), num=2)


def test_a_broken_int4_quantizer_fails_the_limits(f32_model, monkeypatch):
    cfg, f32, windows = f32_model
    ref = quality.weight_metrics(f32, cfg, windows, "float32")
    good = quality.weight_metrics(f32, cfg, windows, "int4-rtn")
    assert quality.check("int4-rtn", good, ref) == []
    original = quantize_mod._rtn_int4

    def drop_low_bit(*args, **kwargs):  # the quantizer with the lowest bit of every 4-bit code cleared
        w = original(*args, **kwargs)
        return Int4Weight(w.packed & np.uint8(0xEE), w.scale, w.group_size)

    monkeypatch.setattr(quantize_mod, "_rtn_int4", drop_low_bit)
    broken = quality.weight_metrics(f32, cfg, windows, "int4-rtn")
    failures = quality.check("int4-rtn", broken, ref)
    assert failures and any("KL" in f for f in failures), (good, broken)
