"""Benchmarks and experiments: Hydra structured configs, workloads, side-by-side sweeps, tables and plots.

- :mod:`~phaseserve.bench.schema`: the structured configs behind ``configs/`` (registered in Hydra's ConfigStore
  on import) and :func:`serve_config_from_hydra`, the one translation from a composed config to engine objects.
- :mod:`~phaseserve.bench.workload`: length distributions, arrival patterns, the client loop driving the engine.
- :mod:`~phaseserve.bench.measure`: engines per arm, interleaved repeats, paired ratios, the environment record.
- :mod:`~phaseserve.bench.report`: JSON, markdown tables, matplotlib plots.
- the experiments: :mod:`~phaseserve.bench.kv_dtype`, :mod:`~phaseserve.bench.weight_dtype`,
  :mod:`~phaseserve.bench.integrity`, :mod:`~phaseserve.bench.reproduce` (``experiments/*.py`` are their thin
  Hydra entry points).
"""

from phaseserve.bench.schema import (
    BenchConfig,
    CacheSpec,
    EngineSpec,
    LengthSpec,
    MeshSpec,
    ModelSpec,
    QuantSpec,
    WorkloadSpec,
    load_model,
    serve_config,
    serve_config_from_hydra,
    setup_jax,
)

__all__ = ["BenchConfig", "CacheSpec", "EngineSpec", "LengthSpec", "MeshSpec", "ModelSpec", "QuantSpec",
           "WorkloadSpec", "load_model", "serve_config", "serve_config_from_hydra", "setup_jax"]
