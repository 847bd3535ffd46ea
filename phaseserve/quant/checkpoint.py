"""Orbax save/restore of any representation's param tree, restoring straight into target shardings.

A quantized tree (``Int4Weight`` / ``Fp8Weight`` containers among plain arrays) is an ordinary pytree, so orbax
saves every stored array (fp8 bytes, packed nibbles, scales) as it is: a round trip is bit-exact. The static
parts of a container (INT4 group size, FP8 block) live in the tree structure, which the restore target
supplies; :func:`save_params` also writes ``phaseserve_quant.json`` (the policy string) next to the arrays
so :func:`restore_params` can rebuild the target from ``(cfg, policy)`` alone.

Restoring onto a mesh: the target is the abstract tree (``abstract_quantized(cfg, policy)``: ``ArrayInfo``
leaves with logical axes) turned into ``jax.ShapeDtypeStruct``s carrying ``NamedSharding``s by
:func:`shardings_for`. Orbax reads each device's shard directly into place, so a checkpoint written from one
mesh restores onto any other without materialising the full array on one device.

:func:`shardings_for` reads the engine's rules table (``phaseserve.kernel_mesh.DEFAULT_RULES``: logical axis
-> mesh axis), applied per stored array: a dimension stays unsharded when the mesh axis does not divide it (e.g. the
``K/G`` rows of a scale) or the mesh axis is already used by an earlier dimension.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from phaseserve.config import ModelConfig, to_dtype
from phaseserve.kernel_mesh import DEFAULT_RULES
from phaseserve.model.params import is_info
from phaseserve.quant.policy import QuantPolicy, resolve_policy
from phaseserve.quant.quantize import abstract_quantized

META_FILE = "phaseserve_quant.json"


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: list | None = None) -> Mesh:
    """A mesh over the first ``prod(shape)`` devices (simulated CPU devices in tests)."""
    devs = list(devices if devices is not None else jax.devices())
    n = int(np.prod(shape))
    if len(devs) < n:
        raise ValueError(f"mesh {dict(zip(names, shape, strict=True))} needs {n} devices, {len(devs)} available")
    return Mesh(np.array(devs[:n]).reshape(shape), names)


def spec_for(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mesh,
             rules: dict[str, str | None] | None = None) -> PartitionSpec:
    """PartitionSpec of one array from its logical axes (unshardable dimensions stay replicated); ``rules`` default
    to the engine's one table, :data:`phaseserve.kernel_mesh.DEFAULT_RULES`."""
    rules = dict(DEFAULT_RULES if rules is None else rules)
    used: set[str] = set()
    spec = []
    for dim, ax in zip(shape, axes, strict=True):
        m = rules.get(ax) if ax is not None else None
        if m is None or m not in mesh.shape or m in used or dim % mesh.shape[m]:
            spec.append(None)
            continue
        used.add(m)
        spec.append(m)
    return PartitionSpec(*spec)


def shardings_for(abstract: Any, mesh: Mesh, rules: dict[str, str | None] | None = None) -> Any:
    """ArrayInfo tree -> tree of ``NamedSharding`` (containers kept)."""
    return jax.tree.map(lambda i: NamedSharding(mesh, spec_for(i.shape, i.axes, mesh, rules)), abstract,
                        is_leaf=is_info)


def restore_target(abstract: Any, mesh: Mesh | None = None, rules: dict[str, str | None] | None = None) -> Any:
    """ArrayInfo tree -> ``ShapeDtypeStruct`` tree carrying target shardings (one device when no mesh)."""
    if mesh is None:
        mesh = make_mesh((1,), ("tp",))

    def leaf(i):
        sharding = NamedSharding(mesh, spec_for(i.shape, i.axes, mesh, rules))
        return jax.ShapeDtypeStruct(i.shape, to_dtype(i.dtype), sharding=sharding)

    return jax.tree.map(leaf, abstract, is_leaf=is_info)


def save_params(path: str | Path, params: Any, policy: str | QuantPolicy | None = None, overwrite: bool = False,
                ) -> Path:
    """Save a (possibly quantized, possibly sharded) params tree with orbax; ``policy`` is recorded."""
    path = Path(path).absolute()
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists (pass overwrite=True)")
        shutil.rmtree(path)
    ckpt = ocp.StandardCheckpointer()
    try:
        ckpt.save(path, params)
        ckpt.wait_until_finished()
    finally:
        ckpt.close()
    if policy is not None:
        (path / META_FILE).write_text(json.dumps({"policy": resolve_policy(policy).describe()}))
    return path


def saved_policy(path: str | Path) -> QuantPolicy | None:
    """The policy recorded by :func:`save_params` (None if it recorded none)."""
    meta = Path(path).absolute() / META_FILE
    return resolve_policy(json.loads(meta.read_text())["policy"]) if meta.exists() else None


def restore_params(path: str | Path, target: Any = None, *, cfg: ModelConfig | None = None,
                   policy: str | QuantPolicy | None = None, mesh: Mesh | None = None,
                   rules: dict[str, str | None] | None = None) -> Any:
    """Restore a tree saved by :func:`save_params` straight into target shardings.

    ``target``: a tree of ``jax.ShapeDtypeStruct`` (with shardings) or of ``ArrayInfo`` (placed by
    ``mesh``/``rules``). Without it, the target is ``abstract_quantized(cfg, policy)`` with ``policy`` defaulting
    to the one recorded at save time.
    """
    path = Path(path).absolute()
    if target is None:
        if cfg is None:
            raise ValueError("restore_params needs a target tree or a model config")
        policy = policy if policy is not None else saved_policy(path)
        if policy is None:
            raise ValueError(f"{path} records no policy: pass policy= or a target tree")
        target = abstract_quantized(cfg, policy)
    if any(is_info(x) for x in jax.tree.leaves(target, is_leaf=is_info)):
        target = restore_target(target, mesh, rules)
    ckpt = ocp.StandardCheckpointer()
    try:
        return ckpt.restore(path, target)
    finally:
        ckpt.close()
