"""Deviceless GPU compile: every Pallas (Triton) kernel compiled by XLA:GPU for a described GPU, from a CPU host.

The CUDA analogue of :mod:`lab.kernels.tpu_compile`. It needs JAX's CUDA plugin (``pip install
"jax-cuda12-plugin==<jax version>"``; not a dependency of this project, and best kept out of an environment that
runs the CPU test suite) and a GPU target description: XLA ships one per GPU as a ``GpuTargetConfigProto`` text file
(``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``, ``h200.txtpb``, ``b200.txtpb`` in the openxla/xla
repository). ``jax.experimental.topologies.get_topology_desc("name", "cuda", target_config=TEXT,
topology="1x1x8")`` then gives compile-only CUDA devices, and ``jax.jit(f).lower(*abstract).compile()`` runs XLA:GPU
and the Triton pipeline on them, shared-memory limits included::

    JAX_PLATFORMS=cpu python -m lab.kernels.gpu_compile --target-config h100_sxm.txtpb

prints one line per kernel case of :func:`lab.kernels.lowering.cases` and exits 1 if any compile fails. What it
found first (docs/tpu_compile.md): the f32 sparse-MLA case asked for 324 KiB of shared memory, over an H100's 227 KiB.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from lab.kernels import lowering


def gpu_devices(target_config: str, topology: str = "1x1x1") -> list:
    """Compile-only CUDA devices for the target description text (``num_slices x hosts x devices_per_host``)."""
    return list(topologies.get_topology_desc("gpu", "cuda", target_config=target_config, topology=topology).devices)


def compile_case(case: lowering.Case, device) -> tuple[bool, str, float]:
    """(ok, detail, seconds): the Triton body of ``case`` compiled for ``device``; ok iff it compiles and holds the
    Triton custom call."""
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device)) for a in case.args]
    t0 = time.perf_counter()
    try:
        compiled = jax.jit(case.build("gpu")).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - reported; the command fails on it
        return False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    if "triton" not in compiled.as_text().lower():
        return False, "no Triton kernel in the compiled module", seconds
    return True, f"temp {compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB", seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", required=True, help="a GpuTargetConfigProto text file (XLA's specs/*.txtpb)")
    a = ap.parse_args(argv)
    with open(a.target_config) as f:
        dev = gpu_devices(f.read())[0]
    print(f"jax {jax.__version__}; compiling on {jax.default_backend()} for a deviceless {dev.device_kind}")
    failures = 0
    for case in lowering.cases():
        if "cuda" not in case.platforms:
            continue
        ok, detail, seconds = compile_case(case, dev)
        failures += not ok
        print(f"{case.name:<58} {'ok  ' if ok else 'FAIL'} {detail} ({seconds:.1f}s)", flush=True)
    print("every kernel compiled" if not failures else f"{failures} compile(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
