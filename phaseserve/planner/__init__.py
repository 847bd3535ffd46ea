"""Capacity and roofline planner for real deployments: model preset x hardware x parallel layout.

``ps.planner.plan(model, gpu, num_gpus, weights, kv)`` returns the documented dict (docs/design.md): checkpoint and
per-device weight sizes, KV bytes per token, resident KV tokens per replica, whether it fits, the layout, the
hardware and every assumption used; with ``prompt_len`` / ``output_len`` also admission and roofline throughput.

- :mod:`~phaseserve.planner.inputs`: typed errors, accelerator specs with their sources, :class:`Assumptions`;
- :mod:`~phaseserve.planner.deployment`: capacity of one deployment (:class:`Deployment`, :func:`plan`);
- :mod:`~phaseserve.planner.roofline`: prefill and decode step times (upper bounds).

The planner checked against published figures, and the capacity report, are lab code: :mod:`lab.planner`
(``lab.planner.published``, ``lab.planner.report``).

Units: ``*_gib`` are 2**30 bytes, bandwidths 1e12 B/s, matrix rates 1e12 op/s.
"""

from phaseserve.planner.deployment import WEIGHT_ALIASES, Deployment, deployment, plan, weight_policy
from phaseserve.planner.inputs import (
    HARDWARE,
    Assumptions,
    Hardware,
    PlannerError,
    UnknownHardwareError,
    UnknownModelError,
    hardware,
)

__all__ = ["HARDWARE", "WEIGHT_ALIASES", "Assumptions", "Deployment", "Hardware", "PlannerError",
           "UnknownHardwareError", "UnknownModelError", "deployment", "hardware", "plan", "weight_policy"]
