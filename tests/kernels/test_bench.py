"""The GPU benchmark script runs end to end at smoke sizes (CPU: Pallas interpret mode) and prints every row."""

from __future__ import annotations

import math

from lab.kernels import bench


def test_bench_smoke(tmp_path, capsys):
    out_file = tmp_path / "bench.md"
    assert bench.main(["--smoke", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert out_file.read_text() == printed
    rows = [line.split("|")[1:-1] for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header][:3] == ["op", "impl", "ms"]
    names = [r[0].strip() for r in body]
    for prefix in ("gqa decode bfloat16", "gqa decode float8", "mla decode bfloat16", "mla decode float8",
                   "w4a16 M1 ", "bf16 matmul M1 ", "w4a16 grouped", "fp8 grouped", "prefill fp8",
                   "prefill int4"):
        assert sum(n.startswith(prefix) for n in names) == 1, prefix
    for r in body:
        ms = float(r[2])
        assert math.isfinite(ms) and ms > 0
        assert r[3].strip() or r[5].strip()  # GB/s for memory-bound rows, TFLOP/s for prefill rows
    assert "SMOKE RUN" in printed and "goal >= 1.7" in printed and "FP8" in printed and "goal > 1" in printed
    lines = printed.splitlines()
    prov = lines[lines.index("kernel provenance:") + 1:]
    assert any(line.strip().startswith("fp8_grouped_matmul [") and " pallas x" in line for line in prov)
