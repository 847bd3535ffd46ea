"""Hydra structured configs (the schema of ``configs/``) and the one translation to engine objects.

The Hydra tree (``configs/config.yaml`` and its groups) mirrors the dataclasses of :mod:`phaseserve.config`;
each group's YAML extends the schema registered here (``defaults: [schema, _self_]``), so a misspelled key
or a wrong type is an error at composition time::

    model:    ModelSpec      checkpoint | preset | inline hf dict, random weights unless a checkpoint
    quant:    QuantSpec      -> QuantConfig   (field for field)
    cache:    CacheSpec      -> CacheConfig   (+ ``kv_budget_requests``: size the byte budget by the workload)
    mesh:     MeshSpec       -> MeshConfig    (+ ``host_devices``: simulated CPU devices)
    engine:   EngineSpec     -> ServeConfig's own fields (+ the engine's ``attn_impl``, ``matmul_impl``)
    workload: WorkloadSpec   lengths, arrivals, concurrency (played by :mod:`lab.bench.workload`)
    experiment: free-form    validated by each experiment against its own dataclass (``bench.schema``)

The four engine nodes are generated from the dataclasses (:func:`_spec`), and :func:`serve_config` reads them back
field for field, so every ``ServeConfig`` field is a Hydra key (``cache.preemption``, ``engine.seed``) and a field
added to :mod:`phaseserve.config` is one at once: the only Hydra-side facts are the tables ``NODES``, ``SWEEPS``,
``HYDRA_DEFAULTS``, ``HYDRA_ONLY`` and ``NOT_FROM_HYDRA`` (empty). ``tests/unit/test_hydra_schema.py`` sets every
field through ``configs/config.yaml`` and ``configs/server.yaml``. ``experiments/serve.py`` goes through the same
translation.

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
import functools
import math
import operator
import os
import types
import typing
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


# The engine's nodes are generated from the dataclasses of phaseserve.config, so a field added there is a Hydra key
# at once (tests/unit/test_hydra_schema.py sets every one through configs/config.yaml and configs/server.yaml).
# Where Hydra differs from the dataclasses, the four tables below say how; nothing else is written twice.
NODES = {"quant": QuantConfig, "cache": CacheConfig, "mesh": MeshConfig, "engine": ServeConfig}  # node -> dataclass;
# ServeConfig's nested configs are the nodes of their field names, its other fields the `engine` node
SWEEPS = {"quant": ("prefill_weights", "decode_weights", "kv_dtype"), "cache": ("integrity",)}  # one value or a list
HYDRA_DEFAULTS = {
    "cache.max_pages_per_seq": 16,  # the default model's 256-token context (null: derived from engine.max_context)
    "engine.max_batch": None,  # null: the workload's (largest) concurrency
}
HYDRA_ONLY = {  # keys that are not fields of the dataclasses: (name, type, default)
    "cache": [("kv_budget_requests", float | None, None),  # a byte budget that holds this many workload requests ...
              ("budget_dtype", str, "bfloat16")],  # ... in this KV dtype (budget_bytes_for_requests)
    "mesh": [("host_devices", int, 2)],  # CPU only: simulated devices, applied before JAX starts (jax_num_cpu_devices)
    "engine": [("attn_impl", str, "auto"),  # "auto" | "pallas" | "reference" (Engine(attn_impl=...))
               ("matmul_impl", str, "auto")],  # quantized-weight matmuls, the same choices (Engine(matmul_impl=...))
}
NOT_FROM_HYDRA: dict[str, str] = {}  # ServeConfig field path ("cache.x", "seed") -> why Hydra cannot set it: none


def _hydra_type(hint: Any) -> Any:
    """The OmegaConf type of a dataclass field's type: OmegaConf has lists where the dataclasses keep tuples
    (``tuple[int, ...] | None`` -> ``list[int] | None``; :func:`_config` turns them back)."""
    if isinstance(hint, types.UnionType):
        return functools.reduce(operator.or_, (_hydra_type(a) for a in typing.get_args(hint)))
    if typing.get_origin(hint) is tuple:
        return list[typing.get_args(hint)[0]]
    return hint


def _spec_default(value: Any) -> Any:
    """A dataclass field default: a tuple becomes a fresh list each time (OmegaConf's lists are mutable)."""
    if isinstance(value, tuple | list):
        return field(default_factory=lambda v=tuple(value): list(v))
    return field(default=value)


def _spec(name: str, node: str, doc: str) -> type:
    """The structured config of Hydra node ``node``: a field for each field of its dataclass (nested configs are
    nodes of their own), typed as OmegaConf types it, with the dataclass's default unless ``HYDRA_DEFAULTS`` says
    otherwise; ``SWEEPS`` take a list too; then the node's ``HYDRA_ONLY`` keys."""
    cls = NODES[node]
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        path = f.name if node == "engine" else f"{node}.{f.name}"
        if dataclasses.is_dataclass(hints[f.name]) or path in NOT_FROM_HYDRA:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = HYDRA_DEFAULTS.get(f"{node}.{f.name}", default)
        typ = Any if f.name in SWEEPS.get(node, ()) else _hydra_type(hints[f.name])
        if default is None and type(None) not in typing.get_args(typ) and typ is not Any:
            typ = typ | None
        specs.append((f.name, typ, _spec_default(default)))
    specs += [(k, typ, _spec_default(default)) for k, typ, default in HYDRA_ONLY.get(node, [])]
    return dataclasses.make_dataclass(name, specs, namespace={"__doc__": doc, "__module__": __name__})


QuantSpec = _spec("QuantSpec", "quant", "Per-phase representations (:class:`~phaseserve.config.QuantConfig`), "
                  "field for field. Policy strings: quant/policy.py.")
CacheSpec = _spec("CacheSpec", "cache", "The paged decode cache (:class:`~phaseserve.config.CacheConfig`): at most "
                  "one of ``num_pages``, ``kv_budget_bytes``, ``kv_budget_requests`` (none: ``memory_fraction``).")
MeshSpec = _spec("MeshSpec", "mesh", "Device sets (:class:`~phaseserve.config.MeshConfig`), and ``host_devices``.")
EngineSpec = _spec("EngineSpec", "engine", "The rest of :class:`~phaseserve.config.ServeConfig`, and the engine's "
                   "``attn_impl`` / ``matmul_impl`` keyword arguments.")


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


def _config(node_name: str, node: Any, **given: Any) -> Any:
    """The dataclass of Hydra node ``node_name`` (``NODES``) from ``node``, field for field: the node's value of
    every field it holds (a list becomes the tuple the dataclass keeps; a sweep axis must hold one value), the
    dataclass's default for any it lacks, ``given`` in place of both."""
    cls = NODES[node_name]
    values = to_container(node) if node is not None else {}
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            v = values[f.name]
            if f.name in SWEEPS.get(node_name, ()):
                v = single(v, f"{node_name}.{f.name}")
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**(kw | given))


def serve_config(cfg: DictConfig, model_cfg: ModelConfig) -> ServeConfig:
    """The :class:`ServeConfig` of a composed config whose sweep axes hold single values: the ``quant``, ``cache``,
    ``mesh`` and ``engine`` nodes field for field (a missing node or key: the dataclass's default), but for the KV
    dtypes (canonical names), the cache's size (``kv_budget_requests`` becomes bytes; none of the three sizes:
    ``memory_fraction`` of the free accelerator memory) and ``engine.max_batch`` (null: the workload's largest
    concurrency)."""
    q, c, e = cfg.quant, cfg.cache, cfg.get("engine") or {}
    quant = _config("quant", q, kv_dtype=canonical_dtype(str(single(q.get("kv_dtype", "bfloat16"), "quant.kv_dtype"))),
                    prefill_kv_dtype=canonical_dtype(str(q.get("prefill_kv_dtype", "bfloat16"))))
    sizes = [k for k in ("num_pages", "kv_budget_bytes", "kv_budget_requests") if c.get(k) is not None]
    if len(sizes) > 1:
        raise ConfigError(f"cache sizes its pool by exactly one of num_pages, kv_budget_bytes, kv_budget_requests, "
                          f"or by cache.memory_fraction of the free accelerator memory with none; got {sizes}")
    budget = budget_bytes_for_requests(model_cfg, cfg) if c.get("kv_budget_requests") is not None \
        else c.get("kv_budget_bytes")
    max_batch = e.get("max_batch")
    if max_batch is None:
        max_batch = max(int(x) for x in as_list(cfg.workload.concurrency))
    return _config("engine", e, quant=quant, cache=_config("cache", c, kv_budget_bytes=budget),
                   mesh=_config("mesh", cfg.get("mesh")), max_batch=int(max_batch))


def serve_config_from_hydra(cfg: DictConfig) -> tuple[ModelConfig, Any, ServeConfig]:
    """``(ModelConfig, params, ServeConfig)`` from a composed ``configs/config.yaml`` tree (single values on the
    sweep axes). ``Engine.from_hydra`` wraps this; ``cfg.engine.attn_impl`` is the engine's ``attn_impl``."""
    model_cfg, params = load_model(cfg)
    return model_cfg, params, serve_config(cfg, model_cfg)
