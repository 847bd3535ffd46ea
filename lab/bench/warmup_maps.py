"""How many of the kernel's memory maps each compiled shape holds on a CPU, and where a full warm-up stops.

Every XLA:CPU executable maps each of its compiled kernels into the process (code, read-only data, data: three maps
a kernel), and Linux caps the maps of one process (``vm.max_map_count``, 65,530 by default); the next compile past
it fails in LLVM and the process segfaults. This builds the server as ``python -m phaseserve.server`` does
(``launch.compose`` + ``build_backend``; default: the vLLM race's model shape with random weights, float32, 32
rows) and runs ``Engine.warm_up`` (``experiment.warmup=all``): decode shapes first, then each prefill (rows, chunk)
at its narrowest page table, then the wider tables, stopping at ``MAP_USE_STOP`` of the limit. After every shape it
records the process's maps (lines of ``/proc/self/maps``) and the compile's seconds; the report gives maps per
shape by phase (median [min, max]) and the counts compiled and left.

    python -m lab.bench.warmup_maps --out benchmarks/engine/warmup_maps/race
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jax

from lab.bench.measure import environment, stats
from lab.bench.profile_decode import write
from lab.bench.report import environment_section, markdown_table, spread
from phaseserve.engine.compiled import memory_maps

OVERRIDES = ["model=race_tiny", "quant=f32", "engine.max_batch=32"]


def maps() -> int:
    """Memory maps this process holds (Linux only: this benchmark measures nothing elsewhere)."""
    return memory_maps()[0]


def run(overrides: list[str]) -> dict[str, Any]:
    from lab.bench.schema import setup_jax
    from phaseserve.server.launch import build_backend, compose

    cfg = compose(overrides)
    setup_jax(cfg)
    cache_dir = jax.config.jax_compilation_cache_dir
    cached = sum(1 for _ in Path(cache_dir).iterdir()) if cache_dir and Path(cache_dir).is_dir() else 0
    engine = build_backend(cfg).engine
    limit = memory_maps()[1]
    rows: list[dict[str, Any]] = []
    last = {"maps": maps()}
    start = dict(last)

    def on_shape(phase: str, shape: tuple, seconds: float) -> None:
        now = maps()
        rows.append({"phase": phase.removesuffix("_shapes"), "shape": list(shape), "seconds": seconds,
                     "maps_after": now, "maps_added": now - last["maps"]})
        last["maps"] = now

    t0 = time.perf_counter()
    counts = engine.warm_up(on_shape)
    return {"overrides": overrides, "max_map_count": limit, "maps_at_start": start["maps"], "maps_at_end": maps(),
            "compilation_cache": {"dir": cache_dir, "entries_at_start": cached}, "counts": counts,
            "seconds": time.perf_counter() - t0, "shapes": rows, "environment": environment()}


def markdown(result: dict[str, Any]) -> str:
    table = []
    for phase in ("decode", "prefill"):
        rs = [r for r in result["shapes"] if r["phase"] == phase]
        if rs:
            table.append([phase, len(rs), spread(stats([r["maps_added"] for r in rs])),
                          spread(stats([r["seconds"] for r in rs])), f"{sum(r['seconds'] for r in rs):.0f}"])
    c = result["counts"]
    return "\n".join([
        "# Memory maps per compiled shape (XLA:CPU) and where the warm-up stops", "",
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        f"Server overrides: `{' '.join(result['overrides'])}`. `vm.max_map_count` {result['max_map_count']:,}; the "
        f"process held {result['maps_at_start']:,} maps before the warm-up and {result['maps_at_end']:,} after it. "
        f"Compiled {c['decode_shapes']} decode and {c['prefill_shapes']} prefill shapes in {result['seconds']:.0f} s; "
        f"{c['shapes_left']} shapes left to compile on first use. JAX's persistent compilation cache "
        f"(`{result['compilation_cache']['dir']}`) held {result['compilation_cache']['entries_at_start']} entries at "
        "start: a shape an earlier run compiled is loaded from it, so the seconds are not compile times; the maps "
        "are the same either way.", "",
        markdown_table(["phase", "shapes compiled", "maps added per shape", "seconds per shape", "seconds"], table), "",
        environment_section(result["environment"]), "",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("overrides", nargs="*", default=OVERRIDES, help="server config overrides (Hydra)")
    a = ap.parse_args(argv)
    result = run(a.overrides)
    write(a.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
