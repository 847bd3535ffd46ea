"""The experiment harness's side of the Hydra configs: each experiment's own node, overrides, JAX setup.

The schema of ``configs/`` (registered in Hydra's ConfigStore on import) and the translation of a composed tree
into engine objects live beside the configs, in :mod:`phaseserve.config_hydra`; this module adds what only
experiments need: :func:`experiment_spec` (the free-form ``experiment`` node validated against an experiment's
dataclass), :func:`with_overrides` (CLI-style overrides applied in-process) and :func:`setup_jax`.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from phaseserve.config_hydra import repo_path


def experiment_spec(cfg: DictConfig, cls: type) -> Any:
    """``cfg.experiment`` validated against the experiment's dataclass (unknown keys and bad types fail)."""
    merged = OmegaConf.merge(OmegaConf.structured(cls), cfg.experiment or {})
    return OmegaConf.to_object(merged)


def with_overrides(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with dotted keys replaced (``{"quant.kv_dtype": "fp8"}``), as CLI overrides would."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in overrides.items():
        OmegaConf.update(out, key, value, force_add=False)
    return out


def setup_jax(cfg: DictConfig) -> None:
    """Simulated CPU devices and the persistent compilation cache; call before the first JAX computation.

    Both are best effort once JAX has started (tests): the device count is then whatever the process has.
    """
    import jax

    n = int(cfg.mesh.host_devices or 1)
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # JAX already started in this process
            pass
    if cfg.jax_cache_dir:
        d = repo_path(cfg.jax_cache_dir)
        d.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(d))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
