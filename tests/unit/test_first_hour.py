"""What a new user meets in the first hour: run metrics over several calls, device sets the machine lacks, the main
job's header and closing summary, a checkpoint path that is not one, policy names, an oversized KV pool, quiet
startup."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import phaseserve as ps
from lab.eval.demo import describe_engine, measured_lines
from phaseserve.engine.metrics import oversized_pool
from phaseserve.model.loader import NotACheckpointError
from phaseserve.quant.policy import PolicyError, phase_policy

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=32, intermediate_size=48,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny(mode: str = "colocated", prefill_weights: str = "float32", decode_weights: str = "float32",
         mesh: ps.MeshConfig | None = None) -> ps.Engine:
    cfg = ps.ModelConfig.from_hf_config(TINY)
    params = ps.init_params(cfg, jax.random.key(int(np.random.default_rng().integers(1 << 30))), "float32")
    quant = ps.QuantConfig(prefill_weights=prefill_weights, decode_weights=decode_weights, kv_dtype="float32",
                           prefill_kv_dtype="float32")
    serve = ps.ServeConfig(mode=mode, quant=quant, mesh=mesh or ps.MeshConfig(), max_batch=4,
                           cache=ps.CacheConfig(page_size=8, num_pages=40, max_pages_per_seq=8))
    return ps.Engine(cfg, params, serve)


def requests(tag: str, n: int, max_tokens: int) -> list[ps.Request]:
    rng = np.random.default_rng()
    return [ps.Request(id=f"{tag}{i}", prompt=rng.integers(0, TINY["vocab_size"], 7).tolist(), max_tokens=max_tokens,
                       ignore_eos=True) for i in range(n)]


def subprocess_env() -> dict:
    """A fresh process as a user starts one: no simulated devices, jax free to probe its backends."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def test_summary_counts_every_call_over_its_own_time():
    engine = tiny()
    t = time.perf_counter()
    engine.generate(requests("a", 2, 8))  # compiles: the longer call
    first = time.perf_counter() - t
    engine.fault_hooks.append(lambda *_: time.sleep(0.2))  # the second call lasts >= 0.6 s (3 decode steps)
    t = time.perf_counter()
    engine.generate(requests("b", 2, 4))
    second = time.perf_counter() - t
    engine.fault_hooks.clear()
    s = engine.summary()
    assert s["output_tokens"] == 2 * 8 + 2 * 4 and s["requests"] == 4
    # wall time is both calls' (tokens of both calls over one call's time inflated tok/s before): each call's
    # window lies inside the call, and only request submission (milliseconds) lies outside the windows
    assert second >= 0.6 and first + second - 0.1 <= s["wall_s"] <= first + second
    assert s["output_tok_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
    engine.reset_metrics()  # a new run: only what follows counts
    t = time.perf_counter()
    engine.generate(requests("c", 1, 5))
    third = time.perf_counter() - t
    assert engine.summary()["output_tokens"] == 5 and 0 < engine.summary()["wall_s"] <= third
    lines = measured_lines(engine)
    assert any(line.startswith("throughput:") and "5 tokens of 1 requests" in line for line in lines)
    assert any(line.startswith("TPOT:") and "p95" in line for line in lines)


def test_device_sets_the_machine_lacks_are_a_config_error_naming_the_fix():
    n = len(jax.devices())
    mesh = ps.MeshConfig(prefill_devices=(0, 1), decode_devices=(n, n + 1), prefill_tp=2, decode_tp=2)
    with pytest.raises(ps.ConfigError) as e:
        tiny("disaggregated", mesh=mesh)
    msg = str(e.value)
    assert f"has {n} cpu devices" in msg and f"[{n}, {n + 1}]" in msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in msg
    with pytest.raises(ps.ConfigError, match=rf"needs {2 * n} devices, but this machine has {n}"):
        tiny("disaggregated", mesh=ps.MeshConfig(prefill_tp=n, decode_tp=n))
    with pytest.raises(ps.ConfigError, match=rf"\[{n}\]"):  # colocated: the same typed error, not IndexError
        tiny("colocated", mesh=ps.MeshConfig(decode_devices=(n,)))
    with pytest.raises(ps.ConfigError, match=rf"needs {n + 1} devices, but"):
        tiny("colocated", mesh=ps.MeshConfig(decode_tp=n + 1))


def test_colocated_header_names_the_one_weight_copy_both_phases_use():
    header = describe_engine(tiny("colocated", prefill_weights="fp8", decode_weights="bfloat16"), "m")
    assert "one weight copy in bfloat16 for both phases" in header and "prefill_weights=fp8 unused" in header
    assert "prefill on" not in header and "with fp8 weights" not in header
    header = describe_engine(tiny("disaggregated", prefill_weights="fp8", decode_weights="bfloat16"), "m")
    assert "with fp8 weights" in header and "decode on" in header and "bfloat16 weights" in header


def test_a_path_that_is_not_a_checkpoint_is_one_typed_line():
    with pytest.raises(NotACheckpointError, match="is not a checkpoint directory \\(no such directory\\)"):
        ps.load_checkpoint("/no/such/dir")
    with pytest.raises(ps.CheckpointError, match="has no config.json"):
        ps.load_checkpoint(ROOT / "configs")
    out = subprocess.run([sys.executable, "experiments/serve.py", "checkpoint=/no/such/dir"], cwd=ROOT,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "error: NotACheckpointError: /no/such/dir is not a checkpoint directory (no such directory); expected a "
        "Hugging Face model directory with config.json and *.safetensors"], out.stderr


def test_policy_error_names_the_fp8_and_int4_shorthands():
    with pytest.raises(PolicyError) as e:
        phase_policy(ps.QuantConfig(decode_weights="int5"), "decode")
    assert "'fp8'" in str(e.value) and "'int4'" in str(e.value) and "kimi-int4" in str(e.value)


def test_an_oversized_kv_pool_is_named_with_its_numbers():
    page_bytes = int(np.random.default_rng().integers(1000, 9000))
    msg = oversized_pool(200_001, max_batch=64, max_pages_per_seq=64, page_bytes=page_bytes)
    assert msg is not None and "200,000 pages" in msg and "at most 4,096" in msg
    assert f"{200_000 * page_bytes / 2**20:,.1f} MiB" in msg
    assert oversized_pool(4 * 4096 + 1, 64, 64, page_bytes) is None  # within the factor: no warning


def test_the_engine_warns_about_an_oversized_pool_and_not_about_a_fitted_one():
    cfg = ps.ModelConfig.from_hf_config(TINY)
    params = ps.init_params(cfg, jax.random.key(1), "float32")
    quant = ps.QuantConfig(decode_weights="float32", kv_dtype="float32", prefill_kv_dtype="float32")

    def build(num_pages: int) -> ps.Engine:
        cache = ps.CacheConfig(page_size=8, num_pages=num_pages, max_pages_per_seq=4)
        return ps.Engine(cfg, params, ps.ServeConfig(mode="colocated", quant=quant, max_batch=2, cache=cache))

    with pytest.warns(UserWarning, match="the KV budget gives 4,000 pages"):
        build(4001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(9)


def test_entry_points_start_quietly():
    from jax._src import xla_bridge

    from phaseserve.quiet import BACKEND_PROBE_LOGGER

    assert xla_bridge.logger.name == BACKEND_PROBE_LOGGER  # the logger jax probes backends with
    code = "import logging; logging.basicConfig(level=logging.INFO); import phaseserve.quiet, jax; jax.devices()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "Unable to initialize backend" not in out.stderr, out.stderr
    assert logging.getLogger(BACKEND_PROBE_LOGGER).getEffectiveLevel() == logging.WARNING


def test_mesh_config_refuses_sizes_and_indices_that_cannot_be():
    for bad in (dict(decode_tp=0), dict(prefill_tp=-2), dict(decode_ep=1.5), dict(prefill_devices=(-1,)),
                dict(decode_devices=())):
        with pytest.raises(ps.ConfigError, match="MeshConfig"):
            ps.MeshConfig(**bad)


def test_main_job_ends_with_what_it_measured(tmp_path):
    out = subprocess.run([sys.executable, "experiments/serve.py", "max_tokens=12", "mode=colocated",
                          f"hydra.run.dir={tmp_path}"],
                         cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "mode colocated: one mesh" in lines[0] and "prefill_weights=fp8 unused" in lines[0]
    assert lines[-6].startswith("=== measured")
    assert [ln.split(":")[0] for ln in lines[-5:]] == ["throughput", "TTFT", "TPOT", "KV cache", "integrity"]
    assert "336 bytes per token" in lines[-2] and " 0 aborted" in lines[-1]
    assert "Unable to initialize backend" not in out.stdout + out.stderr


def test_a_stream_closed_early_still_counts_its_time():
    engine = tiny()
    engine.generate(requests("w", 1, 4))  # compile outside the measured run
    engine.reset_metrics()
    t = time.perf_counter()
    stream = engine.stream(requests("s", 2, 30))
    for _ in zip(range(6), stream, strict=False):
        pass
    stream.close()  # cancels the rest; the tokens handed out so far count, and so must the time they took
    elapsed = time.perf_counter() - t
    s = engine.summary()
    assert s["output_tokens"] == 6 and 0 < s["wall_s"] <= elapsed
