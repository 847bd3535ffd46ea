"""Every Pallas kernel exports for TPU (Mosaic) and CUDA (Triton) from this CPU-only machine, at serving shapes,
and the exported module really contains the kernel's custom call (no silent fallback to XLA)."""

from __future__ import annotations

import pytest

from lab.kernels import lowering

PAIRS = [(case, platform) for case in lowering.cases() for platform in case.platforms]


@pytest.mark.parametrize("case,platform", PAIRS, ids=[f"{c.name}-{p}".replace(" ", "_") for c, p in PAIRS])
def test_kernel_lowers(case, platform):
    result = lowering.check(case, platform)
    assert result.ok, result.detail
    assert result.detail.startswith(lowering.EXPECTED_CALL[platform])


def test_every_kernel_is_covered_on_both_platforms():
    names = {c.name.split()[0] for c, _ in PAIRS}
    assert names == {"paged_gqa", "paged_mla", "int4_matmul", "int4_grouped", "fp8_matmul", "fp8_grouped",
                     "flash_prefill", "sparse_mla"}
    for name in names:
        assert {p for c, p in PAIRS if c.name.startswith(name)} == {"tpu", "cuda"}


def test_command_reports_failures(monkeypatch, capsys):
    real = lowering.cases()[0]
    plain_xla = lowering.Case("plain_xla", lambda target: (lambda x: x + 1), (lowering._a((8,), "float32"),))
    monkeypatch.setattr(lowering, "cases", lambda: [real, plain_xla])
    assert lowering.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(real.name) and " ok " in line for line in lines) == 2
    assert sum(line.startswith("plain_xla") and "FAIL no " in line for line in lines) == 2
    assert lines[-1] == "2 export(s) failed"
