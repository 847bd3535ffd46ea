"""Benchmarks and experiments: Hydra structured configs, workloads, side-by-side sweeps, tables and plots.

- :mod:`~phaseserve.bench.schema`: each experiment's own config node, in-process overrides, JAX setup (the
  structured configs of ``configs/`` and the translation to engine objects are :mod:`phaseserve.config_hydra`).
- :mod:`~phaseserve.bench.workload`: length distributions, arrival patterns, the client loop driving the engine.
- :mod:`~phaseserve.bench.measure`: engines per arm, interleaved compile-free repeats, paired ratios with bootstrap
  intervals, the environment record.
- :mod:`~phaseserve.bench.verdict`: each published claim judged from the run's numbers; the last lines of every run.
- :mod:`~phaseserve.bench.publish`: results.json -> summary, report and plots; re-rendering from committed JSON.
- :mod:`~phaseserve.bench.report`: JSON, markdown tables (:mod:`phaseserve.markdown`), matplotlib plots.
- the experiments: :mod:`~phaseserve.bench.kv_dtype`, :mod:`~phaseserve.bench.weight_dtype`,
  :mod:`~phaseserve.bench.integrity`, :mod:`~phaseserve.bench.reproduce` (``experiments/*.py`` are their thin
  Hydra entry points).
"""

from phaseserve.bench.schema import experiment_spec, setup_jax, with_overrides

__all__ = ["experiment_spec", "setup_jax", "with_overrides"]
