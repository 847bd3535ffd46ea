"""Every shell command the README shows is executed by a test: the README's commands (bash blocks and the two-commands
table) must equal the commands this module knows, and each is run here as written (on this CPU machine) or by the
named check that runs it (CI's script, the GPU recipe's smoke test). A command added to the README without a check
fails :func:`test_every_readme_command_has_a_check`. The README also stays an introduction: at most 250 lines."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250


def readme_commands(text: str) -> list[str]:
    """Commands in ```bash blocks (comments stripped) and in the backticks of table rows that start with a venv or
    python invocation."""
    cmds = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    for row in re.findall(r"^\|.*\|$", text, re.M):
        cmds += [c for c in re.findall(r"`([^`]+)`", row) if c.startswith(("python3 -m venv", ".venv/bin/"))]
    return cmds


def test_command_parser_sees_blocks_and_table_rows():
    text = ("| a | `python3 -m venv .venv && x` | 1 |\n| b | `ps.Engine` | 2 |\n"
            "```bash\n.venv/bin/python -m y   # a comment\n# only a comment\n```\n")
    assert readme_commands(text) == [".venv/bin/python -m y", "python3 -m venv .venv && x"]


def test_readme_is_an_introduction_within_its_length():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}); move detail to docs/"


def _argv(cmd: str) -> list[str]:
    """A README command as this test runs it: the venv's Python is this interpreter."""
    return [sys.executable if a == ".venv/bin/python" else a for a in shlex.split(cmd)]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}


def run_main_job(cmd: str) -> None:
    main = cmd.split("&&")[-1].strip()
    out = subprocess.run(_argv(main), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "=== tool call ===" in out.stdout and re.search(r"^throughput: +[\d.]+ output tok/s", out.stdout, re.M)


def run_server(cmd: str) -> None:
    """Start the server as written, wait for /health, complete one request, stop it."""
    port = int(m.group(1)) if (m := re.search(r"experiment\.port=(\d+)", cmd)) else 8000
    proc = subprocess.Popen(_argv(cmd), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health in 300 s"
            time.sleep(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "def add(a, b):", "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["finish_reason"] in ("length", "stop") and out["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def pip_dry_run(cmd: str) -> None:
    """Resolve the extra against the registry without installing (PEP 658 metadata): the right JAX build appears."""
    spec = re.search(r'-e "(\.\[\w+\])"', cmd).group(1)
    report = ROOT / f".pytest_pip_report_{os.getpid()}.json"
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                              "--report", str(report), "-e", spec], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        installs = json.loads(report.read_text())["install"]
        names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    finally:
        report.unlink(missing_ok=True)
    want = {".[cuda]": "jax-cuda13-plugin", ".[tpu]": "libtpu"}[spec]
    assert want in names and names["jax"] == names["jaxlib"], names


def in_ci_script(cmd: str) -> None:
    """The test command is what `.ci/run` runs on a fresh checkout (install, then pytest with the same arguments)."""
    ci = (ROOT / ".ci/run").read_text()
    venv, install, tests = (c.strip() for c in cmd.split("&&"))
    assert venv in ci and 'pip install -q -e ".[test]"' in ci and install == '.venv/bin/pip install -e ".[test]"'
    assert tests in ci


def gpu_recipe_smoke(cmd: str) -> None:
    """Run on a GPU by hand; on CI its smoke mode runs (tests/kernels/test_gpu_recipe.py) and must exist."""
    src = (ROOT / "tests/kernels/test_gpu_recipe.py").read_text()
    assert cmd.split()[1] in src and "def test_recipe_smoke_runs_every_stage" in src


CHECKS = {
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python experiments/serve.py": run_main_job,
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q -n 2 --dist loadfile':
        in_ci_script,
    ".venv/bin/python -m phaseserve.server": run_server,
    ".venv/bin/python -m phaseserve.server experiment.port=8001 engine.mode=colocated mesh=single": run_server,
    '.venv/bin/pip install -e ".[cuda]"': pip_dry_run,
    '.venv/bin/pip install -e ".[tpu]"': pip_dry_run,
    ".venv/bin/python -m phaseserve.server mesh=single": run_server,
    "bash benchmarks/gpu/run_h200.sh": gpu_recipe_smoke,
}


def test_every_readme_command_has_a_check():
    cmds = readme_commands(README.read_text())
    assert sorted(set(cmds)) == sorted(CHECKS), "README commands and their checks differ: update CHECKS"


# the CUDA extra's resolution fetches the metadata of ~GB of NVIDIA wheels (~1 min): `pytest -m slow` runs it
SLOW = {'.venv/bin/pip install -e ".[cuda]"'}


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CHECKS])
def test_readme_command_runs(cmd):
    CHECKS[cmd](cmd)


def test_accelerator_mesh_configs_compose_into_disjoint_device_sets():
    """configs/mesh/gpu8 and tpu_v5p8 (named in the README beside single) give disjoint phase device sets whose
    sizes match their parallelism; single leaves the sets to the engine (one device: the phases share it)."""
    from phaseserve.server.launch import compose

    m = compose(["mesh=single"]).mesh
    assert m.host_devices == 1 and m.prefill_devices is None and m.decode_devices is None  # both share the one GPU
    for name, n in (("gpu8", 8), ("tpu_v5p8", 4)):
        m = compose([f"mesh={name}"]).mesh
        prefill, decode = list(m.prefill_devices), list(m.decode_devices)
        assert len(prefill) == m.prefill_tp and len(decode) == m.decode_tp * m.decode_ep, name
        assert max(prefill + decode) < n and m.host_devices == n, name
        assert not set(prefill) & set(decode), name
