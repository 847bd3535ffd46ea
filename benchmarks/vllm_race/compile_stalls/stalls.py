"""Does the vLLM race's phaseserve server compile during timed runs? The server with ``JAX_LOG_COMPILES=1`` and the
CPU's default warm-up, then ``vllm bench serve`` at concurrency 8 and 32; prints each run's numbers and how many
compile log lines it added (the server's log: ``/tmp/prof/stalls_server.log``; the results beside this file).

    python benchmarks/vllm_race/compile_stalls/stalls.py [server overrides ...]
"""

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from lab.bench import vllm_race as vr  # noqa: E402

OUT = Path(__file__).resolve().parent
PORT = 8321


def main() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        spec = vr.experiment_spec(compose(config_name="experiment/vllm_race"), vr.RaceSpec)
    ckpt = ROOT / "outputs/vllm_race/models/dsv3_tiny"
    cmd = [sys.executable, "-m", "phaseserve.server", f"model.checkpoint={ckpt}", "model.name=dsv3_tiny",
           "experiment.model_name=dsv3_tiny", f"experiment.port={PORT}", "quant=f32", "engine.max_batch=32",
           *sys.argv[1:]]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_COMPILATION_CACHE_DIR": str(ROOT / "outputs/.jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS":
           "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_LOG_COMPILES": "1"}
    log = Path("/tmp/prof/stalls_server.log")
    url = f"http://127.0.0.1:{PORT}"
    t0 = time.perf_counter()
    proc = vr.start_server(cmd, env, url, log, 1800)
    print(f"ready in {time.perf_counter() - t0:.1f} s", flush=True)

    def compiles() -> int:
        text = log.read_text()
        return text.count("Finished XLA compilation") + text.count("Compiling ")

    try:
        for c, prompts in ((8, 16), (8, 64), (32, 64), (32, 128)):
            before = compiles()
            path = OUT / f"stall_c{c}_{prompts}.json"
            vr.bench_once(spec, url, "dsv3_tiny", ckpt, c, prompts, 7, path)
            r = json.loads(path.read_text())
            print(c, prompts, {k: round(r[k], 1) for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms")},
                  "compile log lines:", compiles() - before, flush=True)
    finally:
        vr.stop_server(proc)


if __name__ == "__main__":
    main()
