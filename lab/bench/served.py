"""The HTTP server as its users start it, for the standard-tool experiments (lm-eval, guidellm): ``python -m
phaseserve.server`` in its own process with Hydra overrides per representation, on a free port of 127.0.0.1.

The server runs with ``JAX_LOG_COMPILES=1``: JAX logs one ``Compiling <fn> ...`` line per compilation to the
server's log, so :meth:`Served.compiles` read before and after a timed run says how many compilations happened
inside it (the check that no request of a timed run compiled). The tools themselves run as subprocesses
(:func:`run_tool`), their executables taken from config (``tools.lm_eval``, ``tools.guidellm``): nothing here
installs them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from phaseserve.server.launch import free_port

REPO = Path(__file__).resolve().parents[2]
COMPILE_MARK = "Compiling "  # the line JAX logs per compilation with jax_log_compiles


class ServerStartError(RuntimeError):
    """The server process exited or did not report healthy in time (the log's tail is in the message)."""


class ToolError(RuntimeError):
    """A standard tool (lm-eval, guidellm) exited non-zero (its command and output tail are in the message)."""


def count_compiles(log_text: str) -> int:
    """Compilations JAX logged (``jax_log_compiles``) in ``log_text``."""
    return sum(1 for line in log_text.splitlines() if line.startswith(COMPILE_MARK))


@dataclass
class Served:
    """One server process; use as a context manager. ``overrides``: Hydra overrides of ``configs/server.yaml``."""

    overrides: list[str]
    log_path: Path
    startup_timeout_s: float = 900.0
    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "phaseserve.server", f"experiment.host={self.host}",
                f"experiment.port={self.port}", *self.overrides]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Served:
        self.port = self.port or free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONPATH": str(REPO)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with {self.proc.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise ServerStartError(f"server not healthy after {self.startup_timeout_s:.0f} s: {self._tail()}")
            time.sleep(1.0)

    def __exit__(self, *_) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def compiles(self) -> int:
        """Compilations in the server's log so far."""
        return count_compiles(self.log_path.read_text(errors="replace"))

    def _tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else "(no log)"


def run_tool(argv: list[str], log_path: Path, timeout_s: float) -> float:
    """Run a tool from the repository root (task files use repo-relative paths), offline (no hub), its output into
    ``log_path``; returns its wall seconds; raises :class:`ToolError` when it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
        except FileNotFoundError:
            raise ToolError(f"{argv[0]!r} not found: install the tool in its own environment and pass its path "
                            "(tools.lm_eval=..., tools.guidellm=...)") from None
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise ToolError(f"{shlex.join(argv)} exited with {rc}:\n{tail}")
    return time.perf_counter() - t0
