"""The README runs as written: its Python blocks marked ``runs`` execute in order as one session on a one-device CPU
with the shipped model; every Python block says whether it runs; the files its commands name exist; the example
script does what its docstring says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\S*)[ \t]*(.*?)\n(.*?)^```[ \t]*$", re.S | re.M)
MARKS = ("runs", "illustrative")
PATH = r"(?<![\w./])((?:experiments|examples|benchmarks|configs|phaseserve|pallas_kernels|lab|tests|docs)/[\w./-]*\w)"
MODULE = r"python -m ((?:phaseserve|pallas_kernels|lab)(?:\.\w+)*)"


def blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, mark, code)`` of every fenced block."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]


def runnable(text: str) -> str:
    return "\n".join(code for lang, mark, code in blocks(text) if lang == "python" and mark == "runs")


def one_device_env() -> dict:
    """A user's fresh process on a CPU: one device (no simulated ones), quiet jax."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return env | {"JAX_PLATFORMS": "cpu"}


def test_block_parser_sees_marks():
    text = "x\n```python runs\na = 1\n```\n```bash\nls\n```\n```python illustrative\nb = 2\n```\n"
    assert blocks(text) == [("python", "runs", "a = 1\n"), ("bash", "", "ls\n"), ("python", "illustrative", "b = 2\n")]
    assert runnable(text) == "a = 1\n"


def test_every_python_block_says_whether_it_runs():
    found = [(mark, code.splitlines()[0]) for lang, mark, code in blocks(README.read_text()) if lang == "python"]
    assert found, "the README has no Python blocks"
    unmarked = [first for mark, first in found if mark not in MARKS]
    assert not unmarked, f"Python blocks without a `runs` / `illustrative` mark, first lines: {unmarked}"


def test_runnable_blocks_run_on_a_one_device_cpu():
    code = runnable(README.read_text())
    assert code.count("ps.Engine(") >= 1 and code.count("ps.load_checkpoint(") >= 1  # the snippets that matter
    probe = "\nimport jax as _j\nprint('DEVICES', len(_j.devices()))\n"
    out = subprocess.run([sys.executable, "-c", code + probe], cwd=ROOT, env=one_device_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DEVICES 1" in out.stdout
    assert re.search(r"^length None '", out.stdout, re.M), out.stdout  # generate() printed its result
    assert re.search(r"^\d+ tok/s over 6 requests$", out.stdout, re.M), out.stdout  # summary of both calls


def test_files_the_readme_and_docs_name_exist():
    """Repository paths and ``python -m`` modules named in README.md and docs/*.md exist, and every relative
    markdown link resolves."""
    docs = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        text = doc.read_text()
        paths = set(re.findall(PATH, text))
        missing += [f"{doc.name}: {p}" for p in sorted(paths) if "<" not in p and not (ROOT / p).exists()]
        missing += [f"{doc.name}: python -m {m}" for m in sorted(set(re.findall(MODULE, text)))
                    if not (ROOT / f"{m.replace('.', '/')}.py").exists()
                    and not (ROOT / m.replace(".", "/") / "__main__.py").exists()]
        links = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
        missing += [f"{doc.name}: link {p}" for p in links
                    if not p.startswith(("http:", "https:", "mailto:")) and not (doc.parent / p).exists()]
    assert not missing, missing
    assert "experiments/serve.py" in README.read_text()


def test_engine_quickstart_example_aborts_only_the_corrupted_request():
    out = subprocess.run([sys.executable, "examples/engine_quickstart.py"], cwd=ROOT, env=one_device_env() | {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {ln.split(":")[0].strip(): ln for ln in out.stdout.splitlines() if re.match(r"^\s*\w+: ", ln)}
    assert "aborted" in lines["r3"] and "KVIntegrityError" in lines["r3"]
    assert "error" in lines["bad"] and "EmptyPromptError" in lines["bad"]
    assert all("length" in lines[f"r{i}"] for i in (0, 1, 2, 4, 5))
    assert "all free again: True" in out.stdout
    assert re.search(r"launched ahead of the previous step's tokens: used [1-9]", out.stdout), out.stdout
    assert "again: 16 prompt tokens from the prefix cache, 0 prefilled" in out.stdout, out.stdout


@pytest.mark.slow  # ~50 s; tests/e2e/test_server_replicas.py checks the same path in the default run
def test_server_replicas_example_streams_the_in_process_tokens_from_both_replicas():
    out = subprocess.run([sys.executable, "examples/server_replicas.py"], cwd=ROOT, env=one_device_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "streamed text equals the in-process tokens: True" in out.stdout, out.stdout
    served = json.loads(re.search(r"^requests per replica: (\[.*\])$", out.stdout, re.M).group(1))
    assert sum(served) == 8 and min(served) >= 2, served  # both replicas served (balanced by tokens in flight)
    assert re.search(r"^phaseserve:generation_tokens_total\{[^}]*\} 128\.0$", out.stdout, re.M), out.stdout
    assert "packed (replica_fill=8): same text: True requests per replica: [8, 0]" in out.stdout, out.stdout


def test_replicas_example_matches_one_engine():
    out = subprocess.run([sys.executable, "examples/replicas.py"], cwd=ROOT, env=one_device_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("same tokens as one engine: True") == 2, out.stdout
    assert "requests per replica: [8, 8]" in out.stdout
