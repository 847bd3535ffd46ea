"""The planner (:mod:`phaseserve.planner`) against published figures, and its reports.

- :mod:`~lab.planner.published`: the planner against the published figures of :mod:`lab.figures`, each with its
  role, and the published checkpoint sizes (:data:`~lab.planner.published.PUBLISHED`);
- :mod:`~lab.planner.report`: every table for a set of deployments (``experiments/capacity.py``).

What the published matches show (``benchmarks/capacity/README.md`` has the table, recomputed on every run): one
assumption, ``reserve_gib = 12``, is **fitted** to the Kimi K2.6 BF16-KV token count (+0.6%); the Kimi FP8-KV
count **follows** from it by the KV byte ratio (+0.1%); the GLM-5 checkpoint and per-GPU weight sizes are
**byte counts** with no fitted parameter, and they are what fixes the GB-as-GiB rule (-0.1%, -0.0%, +0.0%,
+1.2%); **held out** are the GLM-5 INT4 KV-token count, +1.2% (its FP8-indexer-key reading was chosen because it
fits; +24% without the keys), and Qwen3-30B-A3B's BF16 weights per rank at tensor parallel 4 from a vLLM log,
-0.2% (a test keeps these numbers equal to the computed ones). Two published checkpoint sizes (Kimi K2.6 595 GB,
GLM-5.2 BF16 1507 GB) fit only the decimal reading of "GB"; the report says so and keeps the rule.
"""

from lab.planner.published import (
    CHECKS,
    PUBLISHED,
    PUBLISHED_THROUGHPUT,
    READING_CHECKS,
    Check,
    Published,
    check_published,
    roles_summary,
    sensitivity,
    throughput_vs_published,
)
from lab.planner.report import capacity_report, capacity_verdicts

__all__ = ["CHECKS", "PUBLISHED", "PUBLISHED_THROUGHPUT", "READING_CHECKS", "Check", "Published", "capacity_report",
           "capacity_verdicts", "check_published", "roles_summary", "sensitivity", "throughput_vs_published"]
