"""Hydra structured configs (the schema of ``configs/``) and the one translation to engine objects.

The Hydra tree (``configs/config.yaml`` and its groups) mirrors the dataclasses of :mod:`phaseserve.config`;
each group's YAML extends the schema registered here (``defaults: [schema, _self_]``), so a misspelled key
or a wrong type is an error at composition time::

    model:    ModelSpec      checkpoint | preset | inline hf dict, random weights unless a checkpoint
    quant:    QuantSpec      -> QuantConfig   (field for field)
    cache:    CacheSpec      -> CacheConfig   (+ ``kv_budget_requests``: size the byte budget by the workload)
    mesh:     MeshSpec       -> MeshConfig    (+ ``host_devices``: simulated CPU devices)
    engine:   EngineSpec     -> ServeConfig's mode, max_batch, max_prefill_tokens, max_context, seed, overlap_prefill,
                              decoding_prefill_tokens, prefill_in_flight, decode_lookahead, decode_hit_suffix
    workload: WorkloadSpec   lengths, arrivals, concurrency (played by :mod:`lab.bench.workload`)
    experiment: free-form    validated by each experiment against its own dataclass (``bench.schema``)

Sweep axes. A few fields accept either one value or a list: ``quant.kv_dtype``, ``quant.prefill_weights``,
``quant.decode_weights``, ``cache.integrity``, ``workload.concurrency`` (and each experiment's arm list). A list
is swept *inside one process*, the arms interleaved, which is the only way ratios are reported; a single value
is one point, which is what each job of a Hydra multirun gets (``-m quant.kv_dtype=bf16,fp8
workload.concurrency=1,8``). :func:`serve_config_from_hydra` needs single values.

This module sits beside the configs, below the engine: ``Engine.from_hydra`` calls
:func:`serve_config_from_hydra`, and the engine itself imports no Hydra. The experiment harness
(``lab.bench``) builds on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from phaseserve.config import (
    CacheConfig,
    ConfigError,
    MeshConfig,
    ModelConfig,
    QuantConfig,
    ServeConfig,
    canonical_dtype,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- schema -----------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """Which model to serve. Exactly one of ``checkpoint``, ``preset``, ``hf``."""

    name: str = "model"
    checkpoint: str | None = None  # HF directory (config.json + *.safetensors); relative to the repository root
    preset: str | None = None  # phaseserve.presets name ("moonlight-16b-a3b", "tiny-mla-moe"): random weights
    hf: dict[str, Any] | None = None  # inline config.json values: random weights
    overrides: dict[str, Any] = field(default_factory=dict)  # config.json keys replaced (e.g. num_hidden_layers: 2)
    dtype: str = "float32"  # params before the per-phase quantization
    seed: int = 0  # random weights


@dataclass
class QuantSpec:
    """Per-phase representations (:class:`~phaseserve.config.QuantConfig`). Policy strings: quant/policy.py."""

    prefill_weights: Any = "bfloat16"  # str, or a list swept in one process
    decode_weights: Any = "bfloat16"  # str, or a list
    kv_dtype: Any = "bfloat16"  # decode cache storage (QuantConfig.kv_dtype): str, or a list
    prefill_kv_dtype: str = "bfloat16"  # dtype prefill computes KV in (QuantConfig.prefill_kv_dtype)
    int4_group_size: int = 128
    fp8_block: list[int] | None = field(default_factory=lambda: [128, 128])  # None: per-channel scales


@dataclass
class CacheSpec:
    """The paged decode cache (:class:`~phaseserve.config.CacheConfig`). One of the three sizes is used."""

    page_size: int = 16
    num_pages: int | None = None  # explicit page count (null page included) ...
    kv_budget_bytes: int | None = None  # ... or a byte budget (pages then depend on the KV dtype) ...
    kv_budget_requests: float | None = None  # ... or bytes that hold this many workload requests in budget_dtype
    budget_dtype: str = "bfloat16"  # dtype kv_budget_requests is counted in
    max_pages_per_seq: int | None = 16  # null: enough pages for engine.max_context (ServeConfig derives it)
    integrity: Any = True  # bool, or a list
    admission: str = "reserve"  # "reserve" | "on_demand"
    prefix_caching: bool = True  # prompt pages shared by hash between requests
    retain_prefixes: bool = False  # and kept after their requests end until reissued (vLLM's APC)


@dataclass
class MeshSpec:
    """Device sets (:class:`~phaseserve.config.MeshConfig`)."""

    host_devices: int = 2  # CPU only: simulated devices, applied before JAX starts (jax_num_cpu_devices)
    prefill_devices: list[int] | None = None  # indices into jax.devices(); None: first prefill_tp devices
    decode_devices: list[int] | None = None  # None: the next decode_tp * decode_ep devices
    prefill_tp: int = 1
    decode_tp: int = 1
    decode_ep: int = 1
    replicas: int = 1  # data-parallel engine replicas (ReplicatedEngine), each over its own block of devices
    replica_devices: str = "blocks"  # blocks: a device block each; shared: all devices each, compiled steps shared


@dataclass
class EngineSpec:
    """The rest of :class:`~phaseserve.config.ServeConfig`, and engine keyword arguments."""

    mode: str = "disaggregated"  # "disaggregated" | "colocated"
    max_batch: int | None = None  # concurrency cap; None: the workload's (largest) concurrency
    max_prefill_tokens: int = 2048
    max_context: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    overlap_prefill: bool = True  # decode steps run while a launched prefill computes
    decoding_prefill_tokens: int | None = 256  # prompt tokens per prefill launch while requests decode (None: all)
    prefill_in_flight: int = 1  # prefill launches queued on the prefill mesh at once
    decode_lookahead: bool = True  # launch the next decode step before reading this one's tokens
    decode_hit_suffix: bool = True  # a prefix hit's last token runs as a decode row (no prefill launch)
    attn_impl: str = "auto"  # "auto" | "pallas" | "reference" (Engine(attn_impl=...))
    matmul_impl: str = "auto"  # quantized-weight matmuls, same choices (Engine(matmul_impl=...))


@dataclass
class LengthSpec:
    """A token-length distribution."""

    dist: str = "fixed"  # "fixed" (always ``mean``) | "uniform" [min, max] | "lognormal" (median mean, clipped)
    mean: int = 64
    min: int = 1
    max: int = 256
    sigma: float = 0.5  # lognormal shape


def max_length(spec: LengthSpec | Any) -> int:
    """The longest length the distribution can produce (what the cache budget is sized for)."""
    get = (lambda k: spec[k]) if isinstance(spec, dict) else (lambda k: getattr(spec, k))
    return int(get("mean")) if get("dist") == "fixed" else int(get("max"))


@dataclass
class WorkloadSpec:
    """What clients send (:mod:`lab.bench.workload`)."""

    name: str = "workload"
    prompt: LengthSpec = field(default_factory=LengthSpec)
    output: LengthSpec = field(default_factory=lambda: LengthSpec(mean=32))
    arrival: str = "closed"  # "closed" (keep `concurrency` in flight) | "burst" (all at t=0) | "poisson"
    rate: float = 8.0  # poisson: requests per second
    concurrency: Any = 8  # int, or a list swept in one process
    num_requests: int | None = None  # per run; None: waves * concurrency (at least min_requests)
    waves: int = 2
    min_requests: int = 4
    shared_prefix: int = 0  # leading prompt tokens common to every request (prefix-cache hits)
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0


@dataclass
class BenchConfig:
    """The root of ``configs/config.yaml``."""

    model: ModelSpec = field(default_factory=ModelSpec)
    quant: QuantSpec = field(default_factory=QuantSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    mesh: MeshSpec = field(default_factory=MeshSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    experiment: Any = None  # each experiment validates its own node (experiment_spec)
    jax_cache_dir: str | None = "outputs/.jax_cache"  # persistent compilation cache; null: off
    progress: bool = True  # progress bars


def register_configs() -> None:
    """Register the schemas: the root as ``schema`` and each group's as ``<group>/schema``."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=BenchConfig)
    for group, node in (("model", ModelSpec), ("quant", QuantSpec), ("cache", CacheSpec), ("mesh", MeshSpec),
                        ("workload", WorkloadSpec)):
        cs.store(group=group, name="schema", node=node)


register_configs()


# ---- helpers ----------------------------------------------------------------------------------------------
def as_list(value: Any) -> list:
    """A sweep axis as a list (a single value is a one-point sweep)."""
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    return [value]


def single(value: Any, key: str) -> Any:
    if isinstance(value, (list, tuple, ListConfig)):
        if len(value) != 1:
            raise ConfigError(f"{key} is a sweep list {list(value)}; pick one value (or run an experiment)")
        return value[0]
    return value


def to_container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def repo_path(path: str) -> Path:
    """A config path: absolute as given, relative to the repository root otherwise."""
    p = Path(os.path.expanduser(path))
    return p if p.is_absolute() else REPO_ROOT / p


# ---- model ------------------------------------------------------------------------------------------------
def hf_dict(model: DictConfig | ModelSpec) -> dict:
    """The config.json dict of a preset / inline model spec, with ``overrides`` applied."""
    from phaseserve.presets import preset

    m = to_container(model) if not isinstance(model, ModelSpec) else dataclasses.asdict(model)
    if m.get("preset"):
        hf = preset(m["preset"])
    elif m.get("hf"):
        hf = dict(m["hf"])
    else:
        raise ConfigError("model needs one of checkpoint, preset, hf")
    target = hf.get("text_config", hf)
    target.update(m.get("overrides") or {})
    return hf


def load_model(cfg: DictConfig) -> tuple[ModelConfig, Any]:
    """``(ModelConfig, params)``: a checkpoint, or random weights (one jitted init) of a preset / inline dict."""
    import jax

    from phaseserve.model.params import init_params
    from phaseserve.quant.loader import load_checkpoint  # the one loader: plain, FP8 and INT4 checkpoints

    m = cfg.model
    given = [k for k in ("checkpoint", "preset", "hf") if m.get(k)]
    if len(given) != 1:
        raise ConfigError(f"model {m.get('name')!r} needs exactly one of checkpoint, preset, hf; got {given}")
    if m.checkpoint:
        path = repo_path(m.checkpoint)
        if not (path / "config.json").exists():
            raise ConfigError(f"model checkpoint {str(path)!r} has no config.json")
        model_cfg, params = load_checkpoint(path, dtype=m.dtype)
        if m.overrides:
            raise ConfigError("model.overrides apply to random-weight models only")
        return model_cfg, params
    model_cfg = ModelConfig.from_hf_config(hf_dict(m))
    params = jax.jit(lambda k: init_params(model_cfg, k, m.dtype))(jax.random.key(int(m.seed)))
    return model_cfg, params


# ---- engine configs ---------------------------------------------------------------------------------------
def pages_per_request(prompt_len: int, output_len: int, page_size: int) -> int:
    """Pages a request reserves at admission (the scheduler's ``max_pages_ever``)."""
    return math.ceil((prompt_len + max(output_len, 2) - 1) / page_size)


def budget_bytes_for_requests(model_cfg: ModelConfig, cfg: DictConfig) -> int:
    """Bytes that hold ``cache.kv_budget_requests`` requests of the longest workload shape in ``budget_dtype``,
    plus the null page."""
    from phaseserve.cache.paged import kv_bytes_per_page

    c = cfg.cache
    per_req = pages_per_request(max_length(cfg.workload.prompt), max_length(cfg.workload.output), c.page_size)
    pages = math.ceil(float(c.kv_budget_requests) * per_req) + 1
    return pages * kv_bytes_per_page(model_cfg, canonical_dtype(c.budget_dtype), c.page_size)


def serve_config(cfg: DictConfig, model_cfg: ModelConfig) -> ServeConfig:
    """The :class:`ServeConfig` of a composed config whose sweep axes hold single values."""
    q, c, m, e = cfg.quant, cfg.cache, cfg.mesh, cfg.engine
    quant = QuantConfig(
        prefill_weights=str(single(q.prefill_weights, "quant.prefill_weights")),
        decode_weights=str(single(q.decode_weights, "quant.decode_weights")),
        kv_dtype=canonical_dtype(str(single(q.kv_dtype, "quant.kv_dtype"))),
        prefill_kv_dtype=canonical_dtype(q.prefill_kv_dtype), int4_group_size=int(q.int4_group_size),
        fp8_block=tuple(q.fp8_block) if q.fp8_block is not None else None)
    sizes = [k for k in ("num_pages", "kv_budget_bytes", "kv_budget_requests") if c.get(k) is not None]
    if len(sizes) != 1:
        raise ConfigError(f"cache needs exactly one of num_pages, kv_budget_bytes, kv_budget_requests; got {sizes}")
    budget = c.kv_budget_bytes
    if c.kv_budget_requests is not None:
        budget = budget_bytes_for_requests(model_cfg, cfg)
    cache = CacheConfig(page_size=int(c.page_size), num_pages=c.num_pages, kv_budget_bytes=budget,
                        max_pages_per_seq=None if c.max_pages_per_seq is None else int(c.max_pages_per_seq),
                        integrity=bool(single(c.integrity, "cache.integrity")), admission=str(c.admission),
                        prefix_caching=bool(c.get("prefix_caching", True)),
                        retain_prefixes=bool(c.get("retain_prefixes", False)))
    mesh = MeshConfig(prefill_devices=tuple(m.prefill_devices) if m.prefill_devices is not None else None,
                      decode_devices=tuple(m.decode_devices) if m.decode_devices is not None else None,
                      prefill_tp=int(m.prefill_tp), decode_tp=int(m.decode_tp), decode_ep=int(m.decode_ep),
                      replicas=int(m.replicas), replica_devices=str(m.get("replica_devices", "blocks")))
    max_batch = e.max_batch if e.max_batch is not None else max(int(x) for x in as_list(cfg.workload.concurrency))
    return ServeConfig(mode=str(e.mode), quant=quant, cache=cache, mesh=mesh, max_batch=int(max_batch),
                       max_prefill_tokens=int(e.max_prefill_tokens), max_context=e.max_context, seed=int(e.seed),
                       overlap_prefill=bool(e.get("overlap_prefill", True)),
                       decoding_prefill_tokens=e.get("decoding_prefill_tokens", 256),
                       prefill_in_flight=int(e.get("prefill_in_flight", 1)),
                       decode_lookahead=bool(e.get("decode_lookahead", True)),
                       decode_hit_suffix=bool(e.get("decode_hit_suffix", True)))


def serve_config_from_hydra(cfg: DictConfig) -> tuple[ModelConfig, Any, ServeConfig]:
    """``(ModelConfig, params, ServeConfig)`` from a composed ``configs/config.yaml`` tree (single values on the
    sweep axes). ``Engine.from_hydra`` wraps this; ``cfg.engine.attn_impl`` is the engine's ``attn_impl``."""
    model_cfg, params = load_model(cfg)
    return model_cfg, params, serve_config(cfg, model_cfg)
