"""``python -m phaseserve.server``'s conventional flags beside the Hydra overrides: ``--help`` prints usage (no
Hydra traceback), ``--host`` / ``--port`` / ``--model`` / ``--served-model-name`` become overrides of
``configs/server.yaml``, a bad override is one error line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from phaseserve.server.__main__ import overrides_of
from phaseserve.server.launch import compose

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phaseserve.server", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                       "JAX_PLATFORMS": "cpu"})


def test_help_prints_usage_without_a_traceback():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--host", "--port", "--model PATH", "--served-model-name", "Hydra overrides"):
        assert flag in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_flags_become_overrides_and_compose():
    ov = overrides_of(["--port", "8123", "--host", "0.0.0.0", "--model", "models/default", "engine.mode=colocated"])
    cfg = compose(ov)
    assert (cfg.experiment.port, cfg.experiment.host, cfg.engine.mode) == (8123, "0.0.0.0", "colocated")
    assert cfg.model.checkpoint == str((Path.cwd() / "models/default").resolve())
    assert cfg.experiment.model_name == "models/default"  # vLLM's default name: the path as given
    assert compose(overrides_of(["--served-model-name", "m1"])).experiment.model_name == "m1"
    assert compose(overrides_of([])).experiment.port == 8000


def test_a_bad_override_or_flag_is_one_error_line():
    r = _run("no_such_key=1")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr
    r = _run("--port", "eighty")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--port" in r.stderr
