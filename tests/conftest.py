"""Test setup (must happen before jax is imported): simulate 8 CPU devices for mesh tests, and share one JAX
persistent compilation cache, fresh for each pytest run, between the xdist workers and the subprocesses they start.

Many tests build engines of the same small models; with the cache each distinct program is compiled once per run
instead of once per engine (one e2e file: 149 s without, 111 s with, measured with two workers). The directory is
created by the first process that imports this file (the xdist controller, before it starts the workers, which
inherit the environment) and removed when that process's session ends. A ``JAX_COMPILATION_CACHE_DIR`` set by the
caller is used as given and kept.

After each test module the worker drops JAX's in-memory caches: on a CPU every loaded executable holds hundreds of
the process's memory maps, and one xdist worker of the whole suite reached 59,581 of Linux's 65,530
(``vm.max_map_count``) on 2026-12-06, past which the next compile segfaults (``phaseserve.engine.compiled``). The
next module reloads what it needs from the persistent cache.
"""

import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="phaseserve-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import jax

    jax.clear_caches()
    gc.collect()
