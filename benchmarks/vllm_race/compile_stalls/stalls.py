"""Does the race's phaseserve server compile during timed runs? Server with JAX_LOG_COMPILES, c8 warm + timed."""
import os, sys, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hydra import compose, initialize_config_dir
from lab.bench import vllm_race as vr
with initialize_config_dir(config_dir="/work/main/configs", version_base="1.3"):
    cfg = compose(config_name="experiment/vllm_race")
spec = vr.experiment_spec(cfg, vr.RaceSpec)
extra = sys.argv[1:]
ckpt = Path("/work/main/outputs/vllm_race/models/dsv3_tiny")
cmd = ["/work/main/.venv/bin/python", "-m", "phaseserve.server", f"model.checkpoint={ckpt}", "model.name=dsv3_tiny",
       "experiment.model_name=dsv3_tiny", "experiment.port=8321", "quant=f32", "engine.max_batch=32", *extra]
env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_COMPILATION_CACHE_DIR": "/work/main/outputs/.jax_cache",
       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_LOG_COMPILES": "1"}
log = Path("/tmp/prof/stalls_server.log")
t0 = time.perf_counter()
proc = vr.start_server(cmd, env, "http://127.0.0.1:8321", log, 1800)
print(f"ready in {time.perf_counter() - t0:.1f} s", flush=True)
def n(): return log.read_text().count("Finished XLA compilation") + log.read_text().count("Compiling ")
try:
    for c, prompts in ((8, 16), (8, 64), (32, 64), (32, 128)):
        before = n()
        p = Path(f"/tmp/prof/stall_c{c}_{prompts}.json")
        vr.bench_once(spec, "http://127.0.0.1:8321", "dsv3_tiny", ckpt, c, prompts, 7, p)
        r = json.loads(p.read_text())
        print(c, prompts, {k: round(r[k], 1) for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms") if k in r}, "compile log lines:", n() - before, flush=True)
finally:
    vr.stop_server(proc)
