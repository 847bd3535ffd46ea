"""lab.bench: config composition and validation, the Hydra -> engine translation, workloads, the client
loop against a tiny engine, statistics, tables and plots."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import phaseserve as ps
from lab.bench import measure, schema, verdict, workload
from lab.bench import report as rp
from phaseserve import config_hydra
from phaseserve.cache.paged import kv_bytes_per_page, pages_for_budget
from phaseserve.config import ConfigError
from phaseserve.config_hydra import REPO_ROOT, LengthSpec

CONFIGS = str(REPO_ROOT / "configs")
TINY = ["model=tiny_mla", "progress=false"]


def _compose(name: str = "config", overrides=()):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


# ---- composition ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["config", "experiment/kv_dtype", "experiment/weight_dtype", "experiment/integrity",
                                  "experiment/reproduce", "experiment/operating_point"])
def test_every_primary_config_composes(name):
    cfg = _compose(name)
    assert set(cfg) >= {"model", "quant", "cache", "mesh", "engine", "workload", "experiment"}
    if name != "config":
        assert cfg.experiment.name == name.split("/")[1]


def test_integrity_at_the_published_shape_fits_its_model_and_pool():
    """8,192-token inputs and 1,000-token outputs on the default architecture with its context raised: every
    offered request fits the model's context, one sequence's page cap and, all at once, the pool."""
    from phaseserve.engine.request import Limits

    cfg = _compose("experiment/integrity_published")
    w = cfg.workload
    assert (cfg.experiment.name, w.prompt.mean, w.output.mean) == ("integrity", 8192, 1000)
    model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cfg.model))
    serve = config_hydra.serve_config(cfg, model_cfg)
    assert Limits.of(model_cfg, serve, serve.cache.num_pages).max_context >= 8192 + 1000
    per_req = config_hydra.pages_per_request(8192, 1000, 16)
    assert serve.cache.num_pages - 1 >= max(w.concurrency) * per_req and serve.max_prefill_tokens >= 8192
    assert model_cfg.hidden_size == 256 and model_cfg.num_layers == 4  # the default architecture


def test_prefix_caching_is_on_by_default_and_the_cache_group_turns_it_off():
    on = _compose("config", TINY)
    model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(on.model))
    cache = config_hydra.serve_config(on, model_cfg).cache
    assert cache.prefix_caching is True and cache.retain_prefixes is False
    off = _compose("config", [*TINY, "cache.prefix_caching=false", "cache.retain_prefixes=true"])
    cache = config_hydra.serve_config(off, model_cfg).cache
    assert cache.prefix_caching is False and cache.retain_prefixes is True


def test_experiment_defaults_select_their_groups():
    kv = _compose("experiment/kv_dtype")
    assert list(kv.quant.kv_dtype) == ["bfloat16", "float8_e4m3fn"]
    assert kv.cache.kv_budget_requests == 16 and kv.cache.num_pages is None
    assert list(kv.workload.concurrency) == [1, 4, 8, 16, 32]
    integ = _compose("experiment/integrity")
    assert list(integ.experiment.arms) == ["on", "off", "noop"]  # strings, not YAML booleans
    assert integ.experiment.reference == "off" and integ.workload.prompt.mean == 160


@pytest.mark.parametrize("bad", ["quant.bogus=1", "cache.page_size=sixteen", "workload.prompt.bogus=3",
                                 "model.checkpoint_dir=x"])
def test_schema_rejects_unknown_keys_and_bad_types(bad):
    with pytest.raises(Exception, match="bogus|sixteen|checkpoint_dir"):
        _compose("config", [bad])


def test_model_group_options_resolve_to_configs():
    for option, arch in [("tiny_mla", "DeepseekV3ForCausalLM"), ("tiny_gqa", "Qwen3MoeForCausalLM"),
                         ("moonlight", "DeepseekV3ForCausalLM"), ("glm5", "GlmMoeDsaForCausalLM"),
                         ("default_random", "DeepseekV3ForCausalLM")]:
        cfg = _compose("config", [f"model={option}"])
        model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cfg.model))
        assert model_cfg.architecture == arch, option
    cut = _compose("config", ["model=kimi_k26", "+model.overrides.num_hidden_layers=2"])
    assert ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cut.model)).num_layers == 2


def test_the_default_model_is_the_shipped_checkpoint():
    cfg = _compose("config")
    assert cfg.model.checkpoint == "models/default" and cfg.model.name == "default"
    model_cfg, params = config_hydra.load_model(cfg)
    shaped = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(_compose("config", ["model=default_random"]).model))
    assert model_cfg.replace(eos_token_ids=(), bos_token_id=None) == shaped.replace(eos_token_ids=(), bos_token_id=None)
    assert ps.model.params.param_count(params) > 1_000_000
    with pytest.raises(ConfigError, match="no config.json"):
        config_hydra.load_model(_compose("config", ["model.checkpoint=models/nowhere"]))


def test_experiment_spec_validates_the_experiment_node():
    from lab.bench.kv_dtype import KvDtypeSpec

    cfg = _compose("experiment/kv_dtype", ["experiment.repeats=5"])
    assert schema.experiment_spec(cfg, KvDtypeSpec).repeats == 5
    bad = OmegaConf.create({"experiment": {"name": "kv_dtype", "repeatz": 1}})
    with pytest.raises(Exception, match="repeatz"):
        schema.experiment_spec(bad, KvDtypeSpec)


# ---- Hydra -> engine objects ------------------------------------------------------------------------------
def test_serve_config_maps_every_field():
    cfg = _compose("config", TINY + ["quant=phase", "quant.kv_dtype=fp8", "cache.num_pages=77", "cache.integrity=false",
                                     "cache.admission=on_demand", "engine.mode=colocated", "engine.max_batch=5",
                                     "engine.max_prefill_tokens=512", "mesh=cpu8"])
    model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cfg.model))
    s = config_hydra.serve_config(cfg, model_cfg)
    assert (s.quant.prefill_weights, s.quant.decode_weights, s.quant.kv_dtype) == ("fp8", "int4", "float8_e4m3fn")
    assert s.quant.fp8_block == (128, 128) and s.quant.int4_group_size == 128
    assert (s.cache.num_pages, s.cache.integrity, s.cache.admission, s.cache.page_size) == (77, False, "on_demand", 16)
    assert (s.mode, s.max_batch, s.max_prefill_tokens) == ("colocated", 5, 512)
    assert s.mesh == ps.MeshConfig(prefill_devices=(0, 1), decode_devices=(2, 3, 4, 5), prefill_tp=2, decode_tp=2,
                                   decode_ep=2)


def test_serve_config_refuses_sweep_lists_and_ambiguous_sizes():
    cfg = _compose("experiment/kv_dtype", TINY)
    model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cfg.model))
    with pytest.raises(ConfigError, match="quant.kv_dtype is a sweep list"):
        config_hydra.serve_config(cfg, model_cfg)
    both = _compose("config", TINY + ["cache.kv_budget_bytes=100000"])  # num_pages is set by cache/default too
    with pytest.raises(ConfigError, match="exactly one of"):
        config_hydra.serve_config(both, model_cfg)
    one = _compose("config", TINY + ["workload.concurrency=[2,6]"])
    assert config_hydra.serve_config(one, model_cfg).max_batch == 6  # the largest swept concurrency


def test_budget_in_requests_holds_exactly_that_many_bf16_requests():
    cfg = _compose("experiment/kv_dtype", TINY + ["quant.kv_dtype=bf16", "cache.kv_budget_requests=3"])
    model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cfg.model))
    per_req = config_hydra.pages_per_request(32, 64, 16)
    assert per_req == math.ceil((32 + 64 - 1) / 16) == 6
    budget = config_hydra.budget_bytes_for_requests(model_cfg, cfg)
    assert budget == (3 * 6 + 1) * kv_bytes_per_page(model_cfg, "bfloat16", 16)
    assert pages_for_budget(model_cfg, "bfloat16", 16, budget) == 3 * 6 + 1
    fp8_pages = pages_for_budget(model_cfg, "float8_e4m3fn", 16, budget) - 1
    assert 2 * 3 * 6 > fp8_pages >= int(1.9 * 3 * 6)  # the scale bytes keep it just under 2x
    assert config_hydra.serve_config(cfg, model_cfg).cache.kv_budget_bytes == budget


# ---- workloads --------------------------------------------------------------------------------------------
def test_length_distributions():
    rng = np.random.default_rng(0)
    assert (workload.sample_lengths(LengthSpec("fixed", 7), 5, rng) == 7).all()
    u = workload.sample_lengths(LengthSpec("uniform", 0, 3, 9), 2000, rng)
    assert u.min() == 3 and u.max() == 9
    ln = workload.sample_lengths(LengthSpec("lognormal", 50, 10, 80, 0.8), 4000, rng)
    assert ln.min() >= 10 and ln.max() <= 80 and 40 <= np.median(ln) <= 60 and (ln == 80).any()
    assert workload.max_length(LengthSpec("uniform", 0, 3, 9)) == 9 and workload.max_length(LengthSpec(mean=12)) == 12
    with pytest.raises(ValueError, match="unknown length distribution"):
        workload.sample_lengths(LengthSpec("zipf"), 2, rng)
    with pytest.raises(ValueError, match="min <= max"):
        workload.sample_lengths(LengthSpec("uniform", 0, 9, 3), 2, rng)


def test_requests_follow_the_workload():
    w = _compose("config", TINY + ["workload.shared_prefix=5", "workload.output.dist=uniform", "workload.output.min=2",
                                   "workload.output.max=6"]).workload
    reqs = workload.make_requests(w, 100, 40, seed=3, tag="x")
    assert len({r.id for r in reqs}) == 40 and all(r.id.startswith("x-") for r in reqs)
    assert all(32 <= len(r.prompt) <= 96 and 2 <= r.max_tokens <= 6 and r.ignore_eos for r in reqs)
    assert all(r.prompt[:5] == reqs[0].prompt[:5] for r in reqs) and len({tuple(r.prompt[5:]) for r in reqs}) == 40
    again = workload.make_requests(w, 100, 40, seed=3, tag="y")
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # same seed: same requests for every arm
    assert workload.num_requests(w, 8) == 16 and workload.num_requests(w, 1) == 4


# ---- the client loop on a tiny engine ---------------------------------------------------------------------
def test_client_loop_on_a_tiny_engine():
    """One engine from serve_config_from_hydra (compiled once; the checks share it): 6 usable pages of 8 tokens hold
    3 requests of 12 + 5 tokens (2 pages each); max_batch 4."""
    cfg = _compose("config", TINY + ["+model.overrides.num_hidden_layers=1", "workload.concurrency=4",
                                     "cache.num_pages=7", "cache.page_size=8", "workload.prompt.dist=fixed",
                                     "workload.prompt.mean=12", "workload.output.mean=5"])
    model_cfg, params, serve = config_hydra.serve_config_from_hydra(cfg)
    assert isinstance(serve, ps.ServeConfig) and serve.max_batch == 4 and serve.cache.num_pages == 7
    eng = ps.Engine(model_cfg, params, serve)
    workload.warmup(eng, cfg.workload, 4, model_cfg.vocab_size)
    w, vocab = cfg.workload, model_cfg.vocab_size
    before = measure.CompileCounter.count()

    # closed loop: `concurrency` requests in flight; the pages, not the clients, bound the admitted batch
    reqs = workload.make_requests(w, vocab, 7, seed=1, tag="closed")
    s = workload.drive(eng, reqs, 2, "closed")
    assert s["completed"] == 7 and s["output_tokens"] == 35 and s["peak_concurrency"] == 2
    assert s["finish_reasons"] == {"length": 7} and s["offered_concurrency"] == 2
    assert s["steady_tok_per_s"] > 0 and 0 < s["steady_window_s"] < s["wall_s"]
    s = workload.drive(eng, reqs, 4, "closed")  # 4 offered, the pages admit 3
    assert s["completed"] == 7 and s["peak_concurrency"] == 3 and s["peak_pages_in_use"] == 6
    probe = workload.probe_admission(eng, workload.make_requests(w, vocab, 4, seed=2, tag="probe"))
    assert probe == {"offered": 4, "admitted": 3, "pages_in_use": 6, "usable_pages": 6}
    assert eng.allocator.num_free == eng.num_pages - 1 and not eng.has_work

    # burst and poisson arrivals
    s = workload.drive(eng, workload.make_requests(w, vocab, 6, seed=4, tag="burst"), 4, "burst")
    assert s["completed"] == 6 and s["peak_concurrency"] == 3 and s["steady_tok_per_s"] is None
    s = workload.drive(eng, workload.make_requests(w, vocab, 5, seed=5, tag="poisson"), 4, "poisson", rate=200.0)
    assert s["completed"] == 5 and s["wall_s"] > 0
    with pytest.raises(ValueError, match="arrival"):
        workload.drive(eng, reqs, 4, "sometimes")

    # the warm-up compiled every shape these runs reached; the counter does see a new compilation
    assert measure.CompileCounter.count() == before
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
    assert measure.CompileCounter.count() > before

    # reset refuses a busy or leaking engine
    eng.add_request(ps.Request(id="busy", prompt=[1, 2, 3], max_tokens=2, ignore_eos=True))
    with pytest.raises(RuntimeError, match="queued or running"):
        workload.reset_engine(eng, 2)
    eng.generate([])
    leak = eng.allocator.allocate(1)
    with pytest.raises(RuntimeError, match="leak"):
        workload.reset_engine(eng, 2)
    eng.allocator.free(leak)
    workload.reset_engine(eng, 3)
    assert eng.scheduler.max_batch == 3 and eng.summary()["requests"] == 0


def test_warmup_covers_every_page_table_width_the_outputs_reach():
    """Requests of 4 + 20 tokens in pages of 4 grow from 2 to 6 pages while they decode, so their decode steps use
    page tables 4 and then 6 wide (``shapes.width_bucket``); the warm-up's runs generate the workload's whole
    output, so a run of the workload afterwards compiles nothing (3-token warm-up runs stopped at width 4)."""
    cfg = _compose("config", TINY + ["+model.overrides.num_hidden_layers=1", "workload.concurrency=2",
                                     "cache.num_pages=32", "cache.page_size=4", "workload.prompt.dist=fixed",
                                     "workload.prompt.mean=4", "workload.output.mean=20"])
    model_cfg, params, serve = config_hydra.serve_config_from_hydra(cfg)
    eng = ps.Engine(model_cfg, params, serve)
    workload.warmup(eng, cfg.workload, 2, model_cfg.vocab_size)
    before = measure.CompileCounter.count()
    s = workload.drive(eng, workload.make_requests(cfg.workload, model_cfg.vocab_size, 4, seed=1, tag="run"), 2,
                       "closed")
    assert s["completed"] == 4 and s["output_tokens"] == 80
    assert measure.CompileCounter.count() == before


# ---- statistics -------------------------------------------------------------------------------------------
def _rec(arm, point, rep, tput, p95=None):
    return {"arm": arm, "point": point, "repeat": rep, "output_tok_per_s": tput, "e2e": {"p95": p95}}


def test_aggregate_and_paired_ratios():
    recs = [_rec("a", 1, 0, 100.0, 2.0), _rec("b", 1, 0, 150.0, 1.0), _rec("a", 1, 1, 120.0, 4.0),
            _rec("b", 1, 1, 120.0, None), _rec("a", 1, 2, 80.0, 3.0), _rec("b", 1, 2, 100.0, 6.0)]
    agg = measure.aggregate(recs, ["output_tok_per_s", "e2e.p95"])
    assert agg["a"][1]["output_tok_per_s"] == {"median": 100.0, "min": 80.0, "max": 120.0, "n": 3,
                                               "rel_spread": 0.4}
    assert agg["b"][1]["e2e.p95"]["n"] == 2 and agg["b"][1]["e2e.p95"]["median"] == 3.5
    r = measure.paired(recs, "b", "a", "output_tok_per_s")[1]
    assert r["values"] == [1.5, 1.0, 1.25] and r["median"] == 1.25 and (r["min"], r["max"]) == (1.0, 1.5)
    assert measure.paired(recs, "b", "a", "e2e.p95")[1]["values"] == [0.5, 2.0]  # the None repeat is skipped
    assert measure.stats([None])["median"] is None
    assert measure.rotated(["x", "y", "z"], 4) == ["y", "z", "x"]


def test_interleaved_rotates_the_arm_order_and_counts_compiles():
    calls = []
    recs = measure.interleaved({"a": None, "b": None}, [1, 2], 2,
                               lambda eng, arm, p, rep: calls.append((rep, p, arm)) or {"x": 1}, desc="t",
                               progress=False)
    assert calls == [(0, 1, "a"), (0, 1, "b"), (0, 2, "b"), (0, 2, "a"), (1, 1, "b"), (1, 1, "a"), (1, 2, "a"),
                     (1, 2, "b")]
    assert all(r["compiles"] == 0 for r in recs) and [r["order"] for r in recs[:4]] == [0, 1, 0, 1]


# ---- tables and plots -------------------------------------------------------------------------------------
def test_formatting_and_markdown():
    assert rp.fmt(1558.4) == "1,558" and rp.fmt(0.012345) == "0.0123" and rp.fmt(3) == "3" and rp.fmt(None) == "–"
    assert rp.pct(1.41) == "+41.0%" and rp.pct(0.7) == "-30.0%" and rp.pct(None) == "–"
    assert rp.spread({"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}) == "2.00 [1.00, 3.00]"
    assert rp.pct_spread({"median": 1.1, "min": 1.0, "max": 1.2, "n": 2}) == "+10.0% [+0.0%, +20.0%]"
    md = rp.markdown_table(["a", "b"], [[1, 2.5], ["x", None]])
    assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2.50 |", "| x | – |"]
    from lab.markdown import table  # the one writer: dict rows too (the planner's tables)

    assert table([{"a": 1234, "b": True}, {"a": 0.5}]).splitlines()[2:] == ["| 1,234 | yes |", "| 0.500 | – |"]


def test_plots_and_outputs_are_written(tmp_path):
    series = {"A": ([1, 2, 4], [1.0, 2.0, None], [0.5, 1.5, None], [1.5, 2.5, None]), "B": ([1, 2], [2.0, 1.0],
                                                                                             None, None)}
    for path in (rp.line_plot(tmp_path / "l.png", series, xlabel="x", ylabel="y", title="t", hlines={"cap": 1.5}),
                 rp.bar_plot(tmp_path / "b.png", ["g"], {"A": ([3.0], [2.0], [4.0]), "B": ([1.0], None, None)},
                             ylabel="y", title="t")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    rows = [{"model": "m", "gpu": "g", "weights": w, "kv": "fp8", "kv_tokens": t, "fits": t > 0}
            for w, t in (("int4", 1000), ("fp8", 0))]
    assert rp.kv_tokens_plot(tmp_path / "kv.png", rows, title="t").stat().st_size > 5000
    cfg = _compose("config", TINY)
    paths = rp.write_outputs(tmp_path / "out", cfg, {"x": np.float32(1.5), "y": float("nan"), "k": {1: [2]}}, "# hi")
    assert paths["json"].read_text().count('"x": 1.5') == 1 and '"y": null' in paths["json"].read_text()
    assert paths["markdown"].read_text() == "# hi\n" and "tiny-mla-moe" in paths["config"].read_text()


def test_environment_record():
    env = measure.environment()
    assert env["machine"] and env["jax"] == __import__("jax").__version__ and env["cpu_cores"] >= 1
    assert len(env["load_average_1m_5m_15m"]) == 3 and env["date"][:2] == "20"
    env["cpu_detail"] = "family 6 model 207 stepping 2"  # whatever this machine's lscpu says (test below)
    assert f"Processor (family 6 model 207 stepping 2), {env['cpu_cores']} cores" in rp.environment_section(
        env | {"machine": "Processor"})
    assert isinstance(env["git_modified"], list)  # a run names the tracked files it changed from its commit
    clean = rp.environment_section(env | {"git_commit": "abc1234", "git_modified": []})
    assert "git commit: abc1234\n" in clean + "\n" and "uncommitted" not in clean
    dirty = rp.environment_section(env | {"git_commit": "abc1234", "git_modified": ["phaseserve/x.py"]})
    assert "git commit: abc1234, with uncommitted changes to 1 tracked file(s): phaseserve/x.py" in dirty


def test_cpu_detail_names_the_cache_and_vector_extensions(monkeypatch):
    lscpu = ("Model name:  Intel(R) Xeon(R) Processor\nCPU family:  6\nModel:  207\nStepping:  2\n"
             "Flags:  fpu sse avx2 avx512f amx_tile\nL3 cache:  260 MiB (1 instance)\n")
    monkeypatch.setattr(measure, "_cmd", lambda argv: lscpu)
    assert measure.cpu_detail() == "family 6 model 207 stepping 2, L3 260 MiB (1 instance), avx2 avx512f"
    monkeypatch.setattr(measure, "_cmd", lambda argv: "Model name: x\nFlags: fpu sse\n")
    assert measure.cpu_detail() == "family ? model ? stepping ?, no AVX2"
    monkeypatch.setattr(measure, "_cmd", lambda argv: "")
    assert measure.cpu_detail() == ""


def test_multirun_summary_collects_every_job_without_ratios(tmp_path):
    from lab.bench import multirun

    for job, kv, tput in (("0", "bf16", 100.0), ("1", "fp8", 150.0), ("10", "fp8", 90.0)):
        d = tmp_path / job
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- quant.kv_dtype={kv}\n- model=tiny_mla\n")
        agg = {kv.upper(): {"8": {"steady_tok_per_s": {"median": tput}, "peak_concurrency": {"median": 8.0}}}}
        rp.write_json(d / "results.json", {"experiment": "kv_dtype", "summary": {"aggregate": agg}})
    (tmp_path / "2").mkdir()  # a failed job without results is skipped
    data = multirun.collect(tmp_path)
    assert data["jobs"] == ["0", "1", "10"] and [r["steady_tok_per_s"] for r in data["rows"]] == [100.0, 150.0, 90.0]
    md = multirun.summary_markdown(data)
    assert "Overrides common to every job: `model=tiny_mla`" in md and "take no ratios" in md
    assert "| 1 | quant.kv_dtype=fp8 | FP8 | 8 | 150 | 8.00 |" in md and "end-to-end" not in md
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    multirun.MultirunSummary().on_multirun_end(cfg)
    assert (tmp_path / "README.md").read_text() == md and (tmp_path / "summary.json").exists()


def test_gpu_recipe_composes_to_the_operating_point_budget():
    """The (not yet run) one-H200 recipe: Moonlight shapes, a budget of 256 BF16 requests of 1,024 + 256 tokens (the
    operating-point rule on the planner's roofline curve), FP8 ~2x in the same bytes, both offered."""
    from lab.bench import operating_point as op

    cfg = _compose("experiment/kv_dtype", ["model=moonlight", "mesh=single", "cache=gpu_budget",
                                           "workload=gpu_kv_budget", "engine.max_prefill_tokens=16384"])
    model_cfg = ps.ModelConfig.from_hf_config(config_hydra.hf_dict(cfg.model))
    budget = config_hydra.budget_bytes_for_requests(model_cfg, cfg)
    per_req = config_hydra.pages_per_request(1024, 256, 16)
    assert per_req == 80 and budget == (256 * 80 + 1) * kv_bytes_per_page(model_cfg, "bfloat16", 16)
    fp8_requests = (pages_for_budget(model_cfg, "float8_e4m3fn", 16, budget) - 1) // per_req
    assert fp8_requests == 508  # 2 * 576 / (576 + 4) = 1.986x, rounded down to whole requests
    assert 1024 + 256 <= 128 * 16 <= model_cfg.max_position_embeddings
    spec = op.OperatingPointSpec()
    assert spec.gpu_context == 1024 + 256 // 2
    choice = op.gpu_curve(spec)["choice"]
    assert cfg.cache.kv_budget_requests == choice["batch"] and {choice["batch"], 2 * choice["batch"]} <= set(
        cfg.workload.concurrency)


def _st(vals):
    return measure.stats(vals, ci=True) | {"values": vals}


def test_median_ci_is_a_scipy_bootstrap_interval_of_the_median():
    vals = [1.08, 1.12, 1.10, 1.15, 1.09]
    lo, hi = measure.median_ci(vals)
    assert min(vals) <= lo <= np.median(vals) <= hi <= max(vals) and lo < hi
    assert measure.median_ci([1.0, 1.0, 1.0]) == (1.0, 1.0) and measure.median_ci([1.0, 2.0]) == (None, None)
    st = _st(vals)
    assert (st["ci_low"], st["ci_high"]) == (lo, hi)


def test_verdicts_are_computed_from_the_interval():
    faster, slower = _st([1.10, 1.12, 1.09, 1.11, 1.13]), _st([0.90, 0.93, 0.91, 0.92, 0.88])
    mixed, two = _st([0.95, 1.04, 1.10, 0.97, 1.01]), _st([1.2, 1.3])
    assert verdict.direction(faster, 1.41).startswith("reproduced")
    assert verdict.direction(slower, 1.41).startswith("not reproduced")
    assert verdict.direction(slower, 0.85).startswith("reproduced")  # a published loss, measured as a loss
    assert verdict.direction(mixed, 1.41).startswith("unresolved")
    assert verdict.direction(two, 1.41) == "unresolved (fewer than 3 repeats)"
    assert verdict.bound(_st([0.995, 1.004, 0.998, 1.001]), 0.01).startswith("reproduced")
    assert verdict.bound(slower, 0.01).startswith("not reproduced")
    assert verdict.bound(mixed, 0.01).startswith("unresolved")
    assert verdict.ratio_text(faster).startswith("+11.0% (95% CI +")
    v = verdict.Verdict("claim", "measured", "published", "reproduced")
    assert verdict.across({1: "reproduced in direction", 8: "not reproduced (x)", 32: "unresolved (y)"}) \
        == "not reproduced at c=8 (reproduced at c=1; unresolved at c=32)"
    assert verdict.across({1: "reproduced (a)", 8: "reproduced (b)"}) == "reproduced at every point (c=1, c=8)"
    assert verdict.across({1: "reproduced (a)", 8: "unresolved (b)"}) == "unresolved at c=8 (reproduced at c=1)"
    assert verdict.points_text({2: faster}).startswith("c=2: +11.0% [95% CI +")
    line = "claim: measured (published published) -> reproduced"
    assert verdict.final_lines([v, v.to_dict()], "out/x") == [line, line, "run directory: out/x"]


def test_a_compile_inside_a_timed_run_is_rerun_once_then_refused():
    seen = []
    fn = jax.jit(lambda x: x * 5 + 1)

    def compiles_first_time(eng, arm, point, rep):  # a shape the warm-up missed: compiled on first use only
        fn(jnp.arange(point))
        seen.append(arm)
        return {"x": 1}

    recs = measure.interleaved({"a": None}, [11.0], 1, compiles_first_time, desc="t", progress=False)
    assert seen == ["a", "a"] and recs[0]["reruns"] == 1 and recs[0]["compiles"] == 0

    def always_compiles(eng, arm, point, rep):
        jax.jit(lambda x: x * len(seen) + 1)(jnp.arange(2.0))  # a new function every call
        seen.append(arm)
        return {}

    with pytest.raises(measure.CompileInTimedRun, match="twice in a row"):
        measure.interleaved({"a": None}, [1], 1, always_compiles, desc="t", progress=False)


BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _reproduce_table(root: Path) -> list[list[str]]:
    from lab.bench import reproduce

    reproduce.render(root / "reproduce", log=lambda *_: None)
    md = (root / "reproduce" / "README.md").read_text().splitlines()
    start = md.index("| experiment | result | published (GPU) | measured here | verdict |") + 2
    rows = []
    for line in md[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _perturb(x, rng, skip=("point", "repeat", "order", "arm", "concurrency", "environment", "settings", "id",
                           "role", "dir", "overrides", "compilation")):
    """Every measured number of a results JSON moved (floats scaled, counts shifted); identities kept."""
    if isinstance(x, dict):
        return {k: (v if k in skip else _perturb(v, rng)) for k, v in x.items()}
    if isinstance(x, list):
        return [_perturb(v, rng) for v in x]
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):  # small counts shifted, byte counts scaled
        return x + int(rng.integers(1, 5)) if abs(x) < 1000 else int(x * rng.uniform(1.3, 1.9))
    if isinstance(x, float):
        return x * float(rng.uniform(1.3, 1.9))
    return x


def test_every_number_in_the_reproduce_table_is_read_from_json_or_the_registry(tmp_path, monkeypatch):
    """Render the committed reproduce report; move every published figure -> every published cell with a number
    changes and no measured cell does; move every measured number in the JSON -> every measured cell with a number
    changes and no published cell does. So no number is a literal of the report template."""
    import shutil

    from lab import figures

    for name in ("kv_dtype", "weight_dtype", "integrity", "reproduce"):
        shutil.copytree(BENCH / name, tmp_path / name)
    base = _reproduce_table(tmp_path)
    assert len(base) >= 8 and {r[0] for r in base} == {"kv_dtype", "weight_dtype", "integrity", "capacity"}
    has_digit = [[any(ch.isdigit() for ch in c) for c in r] for r in base]

    rng = np.random.default_rng(0)
    moved = {f.id: dataclasses.replace(f, value=f.value * float(rng.uniform(1.2, 1.9))) for f in figures.FIGURES}
    with monkeypatch.context() as m:
        m.setattr(figures, "_BY_ID", moved)
        fig_moved = _reproduce_table(tmp_path)
    for r0, r1, d in zip(base, fig_moved, has_digit, strict=True):
        assert r1[3] == r0[3], r0  # measured: unchanged
        assert r1[2] != r0[2] or not d[2], r0  # published: read from the registry

    for path in [tmp_path / n / "results.json" for n in ("kv_dtype", "weight_dtype", "integrity")] + [
            tmp_path / "reproduce" / "capacity" / "capacity.json"]:
        data = json.loads(path.read_text())
        path.write_text(json.dumps(_perturb({k: v for k, v in data.items() if k != "summary"}, rng)))
    data_moved = _reproduce_table(tmp_path)
    for r0, r2, d in zip(base, data_moved, has_digit, strict=True):
        assert r2[2] == r0[2], r0  # published: unchanged
        assert r2[3] != r0[3] or not d[3], r0  # measured: read from the JSON records
