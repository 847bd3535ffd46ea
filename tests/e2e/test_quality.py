"""The quality experiment end to end at tiny settings: every representation and serving combination is measured
and written; the float32 reference compares to itself exactly, every other representation does not."""

from __future__ import annotations

import json

from phaseserve.eval.demo import default_model_path
from phaseserve.eval.quality import COMBOS, WEIGHTS, run


def test_quality_table_is_measured_and_written(tmp_path):
    rows = run(default_model_path(), tmp_path, num_requests=2, max_tokens=12, num_windows=2, calib_sequences=2)
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved == json.loads(json.dumps(rows))
    assert set(rows["weights"]) == set(WEIGHTS) and len(rows["serving"]) == len(COMBOS)
    ref = rows["weights"]["float32"]
    assert ref["kl"] < 1e-9 and ref["top1"] == 1.0 and 1.0 < ref["ppl"] < 10.0
    for name in ("fp8", "int4-rtn", "int4-gptq"):
        assert rows["weights"][name]["kl"] > 1e-6, name  # a quantized model is really a different model
    for r in rows["serving"]:
        assert 0.0 <= r["validity"] <= 1.0 and 0.0 <= r["token_agreement_vs_f32"] <= 1.0
    table = (tmp_path / "README.md").read_text()
    assert "| int4-gptq |" in table and "Against the goals" in table
