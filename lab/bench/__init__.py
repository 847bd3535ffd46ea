"""Benchmarks and experiments: Hydra structured configs, workloads, side-by-side sweeps, tables and plots.

- :mod:`~lab.bench.schema`: each experiment's own config node, in-process overrides, JAX setup (the
  structured configs of ``configs/`` and the translation to engine objects are :mod:`phaseserve.config_hydra`).
- :mod:`~lab.bench.workload`: length distributions, arrival patterns, the client loop driving the engine.
- :mod:`~lab.bench.measure`: engines per arm, interleaved compile-free repeats, paired ratios with bootstrap
  intervals, the environment record.
- :mod:`~lab.bench.verdict`: each published claim judged from the run's numbers; the last lines of every run.
- :mod:`~lab.bench.publish`: results.json -> summary, report and plots; re-rendering from committed JSON.
- :mod:`~lab.bench.report`: JSON, markdown tables (:mod:`lab.markdown`), matplotlib plots.
- the experiments: :mod:`~lab.bench.kv_dtype`, :mod:`~lab.bench.weight_dtype`,
  :mod:`~lab.bench.integrity`, :mod:`~lab.bench.reproduce` (``experiments/*.py`` are their thin
  Hydra entry points).
"""

from lab.bench.schema import experiment_spec, setup_jax, with_overrides

__all__ = ["experiment_spec", "setup_jax", "with_overrides"]
