"""TPU compile check: every Pallas kernel compiled by the real TPU compiler on deviceless TPU chips, from a CPU host.

``jax.export`` (:mod:`lab.kernels.lowering`) stops before the TPU compiler. With ``libtpu`` installed (the
``tpu`` extra: ``pip install "jax[tpu]"``), ``jax.experimental.topologies.get_topology_desc`` describes a TPU
slice without one attached, and ``jax.jit(f).lower(*abstract_args).compile()`` runs XLA:TPU and Mosaic on it:
Mosaic's tiling and layout passes, its VMEM limit, XLA's layout assignment and memory planning. This module
compiles each kernel case of :func:`lab.kernels.lowering.cases` (the serving tile shapes; the W8A8 FP8 cases
are GPU-only by design and left out) for one chip of each generation in :data:`GENERATIONS`, and reads back:

- whether the compiled module holds the Mosaic custom call (``tpu_custom_call``; no silent fallback to XLA);
- the VMEM each Mosaic kernel uses and the limit it asked for (``used_scoped_memory_configs`` /
  ``scoped_memory_configs`` of memory space 1 in the compiled HLO's backend config), beside the VMEM estimate of
  :mod:`pallas_kernels.tuning` where it has one;
- ``memory_analysis()`` (argument, output, temp and generated-code bytes) and ``cost_analysis()``;
- the block shape the kernel chose (from :mod:`pallas_kernels.tuning`, per the case's shapes).

``python -m lab.kernels.tpu_compile [--small] [--generations v5e,v6e,v5p] [--json PATH]`` prints one line per
kernel x generation and exits 1 if any compile fails. :func:`small_cases` are the same kernels at small shapes
(seconds each): ``tests/kernels/test_tpu_compile.py`` compiles them for every generation in the default test run.

Without ``libtpu`` the topology call fails with a RuntimeError; :func:`libtpu_version` returns None then. The check
runs in any JAX process, including ``JAX_PLATFORMS=cpu`` (the topology does not initialise a TPU backend). Two
processes loading libtpu at once (pytest-xdist workers) contend for ``/tmp/libtpu_lockfile`` unless
``ALLOW_MULTIPLE_LIBTPU_LOAD=1``, which importing this module sets (no TPU is attached, so nothing is shared). The
persistent compilation cache is switched off around each compile (:func:`no_persistent_cache`): a deviceless
executable cannot be loaded back from it (``PjRtCompiler must be constructed with a Client``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from lab.kernels import lowering
from pallas_kernels import sparse_mla, tuning
from pallas_kernels.common import cdiv, next_pow2

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# generation -> a topology to take one chip from (any slice of that generation compiles the same one-chip program)
GENERATIONS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
VMEM_SPACE = "1"  # the TPU memory space id of VMEM in the compiled HLO's scoped memory configs


def libtpu_version() -> str | None:
    """The installed ``libtpu`` wheel's version, or None (then no deviceless TPU compile is possible)."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def no_persistent_cache():
    """JAX's persistent compilation cache off for the block (restored after)."""
    prev = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", prev)


@functools.cache
def topology(name: str) -> tuple[jax.Device, ...]:
    """The devices of a deviceless TPU slice, e.g. ``"v5p:2x2x2"`` (cached: one description per name)."""
    return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)


def chip(generation: str) -> jax.Device:
    """One deviceless chip of ``generation`` (a key of :data:`GENERATIONS`)."""
    if generation not in GENERATIONS:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(GENERATIONS)}")
    return topology(GENERATIONS[generation])[0]


def kernel_vmem(hlo_text: str) -> list[tuple[int, int]]:
    """(VMEM used, VMEM limit) in bytes of every Mosaic custom call of a compiled module's HLO text.

    The call's scoped VMEM region starts at ``offset`` (XLA may keep whole arrays resident in VMEM below it, e.g.
    80 MiB on v5e) and is ``size`` long (the kernel's ``vmem_limit_bytes``); the compiler reports the high-water
    mark from 0, so the kernel's own use is that mark minus the region's offset."""
    out = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        offset, limit = _scoped(line, "scoped_memory_configs")
        used_offset, used = _scoped(line, "used_scoped_memory_configs")
        out.append((max(used_offset + used - offset, 0), limit))
    return out


def _scoped(line: str, key: str) -> tuple[int, int]:
    """(offset, size) of the VMEM entry of a backend-config scoped memory list."""
    m = re.search(rf'"{key}":\[(.*?)\]', line)
    hit = m and re.search(rf'"memory_space":"{VMEM_SPACE}","offset":"(\d+)","size":"(\d+)"', m.group(1))
    return (int(hit.group(1)), int(hit.group(2))) if hit else (0, 0)


def blocks(case: lowering.Case) -> tuple[str, int | None]:
    """The TPU block shape ``case``'s kernel tiles with (from :mod:`pallas_kernels.tuning`), and tuning's VMEM
    estimate in bytes where it has one (the INT4 and FP8 matmuls)."""
    kind = case.name.split()[0]
    a = case.args
    if kind == "paged_gqa":  # q [B, H, D], pages [P, S, KV, D], table [B, MP]
        blk = tuning.gqa_tpu(a[1].shape[1], a[3].shape[1])
        return f"{blk.pages_per_block} pages x {a[1].shape[1]} tokens / step", None
    if kind == "paged_mla":  # q_latent, q_rope, pages [P, S, W], table [B, MP]
        blk = tuning.mla_tpu(a[2].shape[1], a[3].shape[1])
        return f"{blk.pages_per_block} pages x {a[2].shape[1]} tokens / step", None
    if kind == "sparse_mla":  # ..., indices [B, K]
        k = a[4].shape[1]
        bk = sparse_mla.MAX_BLOCK_K if k > sparse_mla.MAX_BLOCK_K else max(32, next_pow2(k))
        return f"{bk} selected tokens / step", None
    if kind in ("int4_matmul", "int4_grouped"):  # x [M, K], packed [(E,) K/2, N], scale [(E,) K/G, N]
        m, k, n = a[0].shape[0], 2 * a[1].shape[-2], a[1].shape[-1]
        group = k // a[2].shape[-2]
        if kind == "int4_grouped":
            m = cdiv(m, a[1].shape[0])  # rows per expert set bm (int4_matmul._grouped_forward)
        blk = tuning.int4_blocks("tpu", m, k, n, group)
        if blk is None:
            return "none", None
        return f"bm{blk.bm} bn{blk.bn} bk{blk.bk}", tuning.int4_vmem_bytes(blk, k, group, a[0].dtype.itemsize)
    if kind in ("fp8_matmul", "fp8_grouped"):  # x [M, K], q [(E,) K, N], scale [(E,) K/bk, N/bn]
        m, k, n = a[0].shape[0], a[1].shape[-2], a[1].shape[-1]
        ks, ns = a[2].shape[-2:]
        block = (k, 1) if ns == n and ks == 1 else (k // ks, n // ns)
        if kind == "fp8_grouped":
            m = cdiv(m, a[1].shape[0])
        blk = tuning.fp8_blocks("tpu", m, k, n, block)
        if blk is None:
            return "none", None
        return f"bm{blk.bm} bn{blk.bn} bk{blk.bk}", tuning.fp8_vmem_bytes(blk, k, a[0].dtype.itemsize)
    if kind == "flash_prefill":  # q [B, T, H, dk], k [B, S, KV, dk]
        blk = tuning.prefill_blocks("tpu", a[0].shape[1], a[1].shape[1])
        return f"bq{blk.block_q} bk{blk.block_k}", None
    return "?", None


@dataclasses.dataclass(frozen=True)
class Result:
    kernel: str
    generation: str
    device_kind: str
    ok: bool
    seconds: float
    blocks: str
    mosaic_calls: int = 0
    vmem_used_bytes: int = 0  # the largest of the module's Mosaic kernels
    vmem_limit_bytes: int = 0
    vmem_estimate_bytes: int | None = None  # pallas_kernels.tuning's estimate (matmuls)
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    error: str = ""


def compile_case(case: lowering.Case, generation: str) -> Result:
    """Compile ``case`` (its Mosaic body, ``target="tpu"``) for one chip of ``generation``; ok iff the TPU compiler
    accepts it and the compiled module holds the Mosaic custom call."""
    dev = chip(generation)
    blk, estimate = blocks(case)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(dev)) for a in case.args]
    t0 = time.perf_counter()
    base = dict(kernel=case.name, generation=generation, device_kind=dev.device_kind, blocks=blk,
                vmem_estimate_bytes=estimate)
    try:
        with no_persistent_cache():
            compiled = jax.jit(case.build("tpu")).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - reported; the command and the tests fail on it
        msg = " ".join(str(e).split())
        return Result(ok=False, seconds=time.perf_counter() - t0, error=f"{type(e).__name__}: {msg[:400]}", **base)
    seconds = time.perf_counter() - t0
    vmem = kernel_vmem(compiled.as_text())
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    ok = bool(vmem)
    return Result(ok=ok, seconds=seconds, mosaic_calls=len(vmem),
                  vmem_used_bytes=max((u for u, _ in vmem), default=0),
                  vmem_limit_bytes=max((lim for _, lim in vmem), default=0),
                  argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                  temp_bytes=mem.temp_size_in_bytes, code_bytes=mem.generated_code_size_in_bytes,
                  flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                  error="" if ok else "no tpu_custom_call in the compiled module (fell back to XLA)", **base)


def tpu_cases() -> list[lowering.Case]:
    """The serving-shape cases of :func:`lab.kernels.lowering.cases` that have a TPU body."""
    return [c for c in lowering.cases() if "tpu" in c.platforms]


def small_cases() -> list[lowering.Case]:
    """Every kernel (BF16 and FP8 pages, dense and grouped matmuls) at small shapes: seconds per compile."""
    bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn
    small = dict(p=32, maxp=4)
    return [
        lowering._gqa(bf16, 16, b=2, hkv=2, g=4, **small), lowering._gqa(fp8, 16, b=2, hkv=2, g=4, **small),
        lowering._mla(bf16, 16, b=2, h=8, **small), lowering._mla(fp8, 16, b=2, h=8, **small),
        lowering._sparse_mla(fp8, 64, b=2, h=8, s=16, **small),
        lowering._int4(8, 1024, 256, 128, bf16), lowering._int4(32, 1024, 256, 128, bf16, experts=4),
        lowering._fp8(16, 512, 256, (128, 128), False), lowering._fp8(32, 512, 256, None, False, experts=4),
        lowering._prefill(bf16, 256, 4, 4, 128, 128, b=1),
    ]


def run(cases: list[lowering.Case], generations: list[str], echo: bool = True) -> list[Result]:
    """Compile every case for every generation (each generation's chip described once)."""
    out = []
    for gen in generations:
        for case in cases:
            res = compile_case(case, gen)
            out.append(res)
            if echo:
                print(line(res), flush=True)
    return out


def line(r: Result) -> str:
    status = "ok  " if r.ok else "FAIL"
    vmem = f"vmem {r.vmem_used_bytes / 2**20:6.2f}/{r.vmem_limit_bytes / 2**20:.0f} MiB" if r.ok else r.error
    return f"{r.generation:<4} {r.kernel:<58} {status} {r.blocks:<28} {vmem} ({r.seconds:.1f}s)"


def environment() -> dict[str, Any]:
    return {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"), "libtpu": libtpu_version(),
            "host_backend": jax.default_backend()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the small-shape cases (the test suite's)")
    ap.add_argument("--generations", default=",".join(GENERATIONS), help=f"comma-separated, of {list(GENERATIONS)}")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    env = environment()
    if env["libtpu"] is None:
        print("libtpu is not installed: pip install 'jax[tpu]' (the `tpu` extra)")
        return 1
    print(f"jax {env['jax']}, libtpu {env['libtpu']}; compiling on {env['host_backend']} for deviceless TPU chips")
    results = run(small_cases() if a.small else tpu_cases(), a.generations.split(","))
    failures = sum(not r.ok for r in results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": env, "kernels": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    print("every kernel compiled" if not failures else f"{failures} compile(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
