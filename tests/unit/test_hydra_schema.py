"""Every :class:`~phaseserve.config.ServeConfig` field is reachable from Hydra and the server (issue 62).

The test walks every field of ``ServeConfig``, recursively through its nested dataclasses, sets a valid value
that differs from what the composed config gives through a Hydra override on ``configs/config.yaml`` (the
experiments' tree, ``Engine.from_hydra``) and on ``configs/server.yaml`` (the HTTP server), and checks that the
``ServeConfig`` the engine would be built with carries it and nothing else changed. The keys are spelled here as a
user writes them, independently of :mod:`phaseserve.config_hydra`: ``quant.*``, ``cache.*``, ``mesh.*`` for the
nested configs, ``engine.<field>`` for ``ServeConfig``'s own fields. A field added to the dataclasses without a
Hydra path fails here; the fields deliberately left out are ``config_hydra.NOT_FROM_HYDRA``, each with its reason,
and every one of them must really be unreachable.

``experiments/serve.py`` (its own ``configs/serve.yaml``) goes through the same translation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
import typing
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

import phaseserve.config as config_module
from phaseserve import config_hydra
from phaseserve.config import CacheConfig, ConfigError, MeshConfig, ModelConfig, QuantConfig, ServeConfig
from phaseserve.config_hydra import NOT_FROM_HYDRA, REPO_ROOT

CONFIGS = str(REPO_ROOT / "configs")
ROOTS = ("config", "server")  # configs/config.yaml (experiments, Engine.from_hydra), configs/server.yaml (the server)
# other fields a value needs set with it (cross-field rules of the dataclasses and of the cache's one size)
WITH = {
    "cache.kv_budget_bytes": ["cache.num_pages=null"],  # one of num_pages / kv_budget_bytes / kv_budget_requests
    "mesh.replicas": ["mesh.prefill_devices=null", "mesh.decode_devices=null"],  # each replica lays out its block
}


def leaf_paths(cls: type = ServeConfig, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every non-dataclass field of ``cls`` as a path of field names, through nested dataclasses."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_paths(hints[f.name], prefix + (f.name,))
        else:
            out.append(prefix + (f.name,))
    return out


def hydra_key(path: tuple[str, ...]) -> str:
    """What a user writes: ``cache.preemption`` for ``ServeConfig.cache.preemption``, ``engine.seed`` for
    ``ServeConfig.seed``."""
    return ".".join(path) if len(path) > 1 else f"engine.{path[0]}"


def field_of(path: tuple[str, ...]) -> tuple[dataclasses.Field, Any]:
    """The dataclass field at ``path`` and its resolved type."""
    cls = ServeConfig
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
    return next(f for f in dataclasses.fields(cls) if f.name == path[-1]), typing.get_type_hints(cls)[path[-1]]


def value_at(serve: ServeConfig, path: tuple[str, ...]) -> Any:
    obj: Any = serve
    for name in path:
        obj = getattr(obj, name)
    return obj


def choices_of(default: str) -> tuple[str, ...]:
    """The names a string field takes: the first tuple constant of ``phaseserve.config`` that holds its default."""
    for value in vars(config_module).values():
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value) and default in value:
            return value
    raise AssertionError(f"no tuple of names in phaseserve/config.py holds {default!r}")


def other_value(path: tuple[str, ...], base: Any) -> Any:
    """A valid value of the field at ``path`` other than ``base`` (what the composed config gives)."""
    f, hint = field_of(path)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    assert len(args) == 1, f"{path}: no rule for a value of type {hint}"
    kind = args[0]
    if kind is bool:
        return not base
    if kind is int:
        return 2 if base is None else base + 1
    if kind is float:
        return 0.5 if base is None else base / 2
    if kind is str:
        return next(c for c in choices_of(f.default) if c != base)
    if typing.get_origin(kind) is tuple:
        if typing.get_args(kind)[-1] is Ellipsis:  # tuple[int, ...]: one index more
            return (0,) if base is None else tuple(base) + (max(base) + 1,)
        return tuple(2 * x for x in base) if base is not None else (1,) * len(typing.get_args(kind))
    raise AssertionError(f"{path}: no rule for a value of type {hint}")


def override(key: str, value: Any) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, tuple | list):
            return "[" + ",".join(fmt(x) for x in v) + "]"
        return repr(v) if isinstance(v, float) else str(v)

    return f"{key}={fmt(value)}"


def _compose(root: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=root, overrides=overrides)


def model_of(cfg) -> ModelConfig:
    m = cfg.model
    if m.get("checkpoint"):
        hf = json.loads((config_hydra.repo_path(m.checkpoint) / "config.json").read_text())
        return ModelConfig.from_hf_config(hf)
    return ModelConfig.from_hf_config(config_hydra.hf_dict(m))


def engine_serve_config(cfg, monkeypatch) -> ServeConfig:
    """The ``ServeConfig`` ``Engine.from_hydra`` / ``ReplicatedEngine.from_hydra`` (the server's engine backend)
    builds from ``cfg``, without loading weights."""
    from phaseserve.engine.engine import hydra_engine_args

    monkeypatch.setattr(config_hydra, "load_model", lambda c: (model_of(c), None))
    return hydra_engine_args(cfg)[2]


def reachable(root: str, path: tuple[str, ...], monkeypatch) -> tuple[bool, str]:
    """Whether a Hydra override of ``path`` on ``root`` lands in ``ServeConfig`` (and only there)."""
    base_cfg = _compose(root, [])
    base = engine_serve_config(base_cfg, monkeypatch)
    value = other_value(path, value_at(base, path))
    key = hydra_key(path)
    overrides = [override(key, value)] + WITH.get(key, [])
    try:
        cfg = _compose(root, overrides)
    except (HydraException, OmegaConfBaseException) as e:
        return False, f"{overrides}: {type(e).__name__}: {e}"
    serve = engine_serve_config(cfg, monkeypatch)
    got = value_at(serve, path)
    if got != value:
        return False, f"{overrides} gave ServeConfig.{'.'.join(path)} = {got!r}, not {value!r}"
    touched = {path} | {tuple(o.split("=")[0].replace("engine.", "").split(".")) for o in WITH.get(key, [])}
    if cfg.cache.max_pages_per_seq is None:  # derived by ServeConfig from max_context and page_size
        touched.add(("cache", "max_pages_per_seq"))
    changed = [p for p in leaf_paths() if p not in touched and value_at(serve, p) != value_at(base, p)]
    assert not changed, f"{overrides} also changed {changed}"
    return True, ""


def test_the_walk_sees_every_nested_config():
    paths = leaf_paths()
    assert {p[0] for p in paths if len(p) > 1} == {"quant", "cache", "mesh"}
    for cls, group in ((QuantConfig, "quant"), (CacheConfig, "cache"), (MeshConfig, "mesh")):
        assert {p[1] for p in paths if p[0] == group} == {f.name for f in dataclasses.fields(cls)}
    assert ("cache", "preemption") in paths and ("cache", "memory_fraction") in paths and ("seed",) in paths


@pytest.mark.parametrize("root", ROOTS)
@pytest.mark.parametrize("path", leaf_paths(), ids=hydra_key)
def test_every_serve_config_field_is_set_from_hydra(root, path, monkeypatch):
    ok, why = reachable(root, path, monkeypatch)
    if ".".join(path) in NOT_FROM_HYDRA:
        assert not ok, f"{'.'.join(path)} is listed in NOT_FROM_HYDRA but {hydra_key(path)} sets it"
    else:
        assert ok, f"ServeConfig.{'.'.join(path)} is not reachable from configs/{root}.yaml: {why}"


def test_the_unreachable_list_names_real_fields_with_reasons():
    fields = {".".join(p) for p in leaf_paths()}
    assert set(NOT_FROM_HYDRA) <= fields, set(NOT_FROM_HYDRA) - fields
    assert all(isinstance(why, str) and why.strip() for why in NOT_FROM_HYDRA.values())


def test_swap_preemption_and_the_memory_fraction_reach_the_server(monkeypatch):
    """The issue's two settings on the server's tree, the pool left to size itself by the memory fraction (no page
    count or byte budget)."""
    from phaseserve.server.launch import compose as server_compose

    cfg = server_compose(["cache.admission=on_demand", "cache.preemption=swap", "cache.num_pages=null",
                          "cache.memory_fraction=0.5"])
    c = engine_serve_config(cfg, monkeypatch).cache
    assert (c.admission, c.preemption, c.memory_fraction, c.num_pages, c.kv_budget_bytes) == \
        ("on_demand", "swap", 0.5, None, None)
    two_sizes = "exactly one of num_pages, kv_budget_bytes, kv_budget_requests, or by cache.memory_fraction"
    with pytest.raises(ConfigError, match=two_sizes):  # two sizes at once are still refused
        engine_serve_config(server_compose(["cache.kv_budget_bytes=1048576"]), monkeypatch)


def test_a_misspelled_key_is_refused():
    with pytest.raises(HydraException, match="preemptoin"):
        _compose("config", ["cache.preemptoin=swap"])


def _serve_main():
    spec = importlib.util.spec_from_file_location("serve_main", REPO_ROOT / "experiments" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_main_job_uses_the_one_translation():
    """``experiments/serve.py`` builds the ``ServeConfig`` it built with its own translation before, through
    ``config_hydra.serve_config``, and takes the cache's and the quantization's every key."""
    serve_main = _serve_main()
    source = (REPO_ROOT / "experiments" / "serve.py").read_text()
    assert not any(f"{name}(" in source for name in ("ServeConfig", "QuantConfig", "CacheConfig", "MeshConfig"))
    model_cfg = ModelConfig.from_hf_config(json.loads((REPO_ROOT / "models" / "default" / "config.json").read_text()))
    serve = config_hydra.serve_config(serve_main.engine_tree(_compose("serve", [])), model_cfg)
    assert serve == ServeConfig(
        mode="disaggregated", max_batch=8,
        quant=QuantConfig(prefill_weights="fp8", decode_weights="int4", kv_dtype="float8_e4m3fn",
                          prefill_kv_dtype="bfloat16", int4_group_size=32, fp8_block=(128, 128)),
        cache=CacheConfig(page_size=16, kv_budget_bytes=4194304, max_pages_per_seq=32, integrity=True,
                          admission="reserve"))
    tree = serve_main.engine_tree(_compose("serve", ["cache.admission=on_demand", "cache.preemption=swap",
                                                     "mode=colocated", "quant.fp8_block=null"]))
    swapped = config_hydra.serve_config(tree, model_cfg)
    assert (swapped.cache.preemption, swapped.mode, swapped.quant.fp8_block) == ("swap", "colocated", None)
