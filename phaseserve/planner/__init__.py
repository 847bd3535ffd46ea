"""Capacity and roofline planner for real deployments: model preset x hardware x parallel layout.

``ps.planner.plan(model, gpu, num_gpus, weights, kv)`` returns the documented dict (DESIGN.md): checkpoint and
per-device weight sizes, KV bytes per token, resident KV tokens per replica, whether it fits, the layout, the
hardware and every assumption used; with ``prompt_len`` / ``output_len`` also admission and roofline throughput.

- :mod:`~phaseserve.planner.inputs`: typed errors, accelerator specs with their sources, :class:`Assumptions`;
- :mod:`~phaseserve.planner.deployment`: capacity of one deployment (:class:`Deployment`, :func:`plan`);
- :mod:`~phaseserve.planner.roofline`: prefill and decode step times (upper bounds);
- :mod:`~phaseserve.planner.published`: the planner against the published figures of :mod:`phaseserve.figures`,
  each with its role;
- :mod:`~phaseserve.planner.report`: every table for a set of deployments (``experiments/capacity.py``).

What the published matches show (``benchmarks/capacity/README.md`` has the table, recomputed on every run): one
assumption, ``reserve_gib = 12``, is **fitted** to the Kimi K2.6 BF16-KV token count (+0.6%); the Kimi FP8-KV
count **follows** from it by the KV byte ratio (+0.1%); the GLM-5 checkpoint and per-GPU weight sizes are
**byte counts** with no fitted parameter, and they are what fixes the GB-as-GiB rule (-0.1%, -0.0%, +0.0%,
+1.2%); **held out** are the GLM-5 INT4 KV-token count, +1.2% (its FP8-indexer-key reading was chosen because it
fits; +24% without the keys), and Qwen3-30B-A3B's BF16 weights per rank at tensor parallel 4 from a vLLM log,
-0.2% (a test keeps these numbers equal to the computed ones). Two published checkpoint sizes (Kimi K2.6 595 GB,
GLM-5.2 BF16 1507 GB) fit only the decimal reading of "GB"; the report says so and keeps the rule.

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
from phaseserve.planner.published import (
    CHECKS,
    PUBLISHED_THROUGHPUT,
    READING_CHECKS,
    Check,
    check_published,
    roles_summary,
    sensitivity,
    throughput_vs_published,
)
from phaseserve.planner.report import capacity_report, capacity_verdicts

__all__ = ["CHECKS", "HARDWARE", "PUBLISHED_THROUGHPUT", "READING_CHECKS", "WEIGHT_ALIASES", "Assumptions", "Check",
           "Deployment", "Hardware", "PlannerError", "UnknownHardwareError", "UnknownModelError", "capacity_report",
           "capacity_verdicts", "check_published", "deployment", "hardware", "plan", "roles_summary", "sensitivity",
           "throughput_vs_published", "weight_policy"]
