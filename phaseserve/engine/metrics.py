"""Run-level serving metrics: latency percentiles, throughput, cache occupancy, preemptions and aborts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from phaseserve.engine.request import RequestOutput


def percentiles(values: list[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    return {f"p{q}": (float(np.percentile(vals, q)) if vals else None) for q in qs}


@dataclass
class RunMetrics:
    """Counters the engine updates as it runs; :meth:`summary` turns them and the outputs into one dict."""

    start: float = 0.0
    end: float = 0.0
    decode_steps: int = 0
    prefill_batches: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    aborts: int = 0
    errors: int = 0
    integrity_checks: int = 0
    peak_running: int = 0
    peak_pages_in_use: int = 0
    decode_time: float = 0.0
    prefill_time: float = 0.0
    host_time: float = 0.0  # scheduler and bookkeeping time in the decode loop
    running_samples: list[int] = field(default_factory=list)

    def observe(self, running: int, pages_in_use: int) -> None:
        self.peak_running = max(self.peak_running, running)
        self.peak_pages_in_use = max(self.peak_pages_in_use, pages_in_use)
        self.running_samples.append(running)

    def summary(self, outputs: list[RequestOutput], prefix_lookup_pages: int = 0, prefix_hit_pages: int = 0) -> dict:
        """Aggregate counters and per-request metrics; prefix counts come from the scheduler that owns them."""
        wall = max(self.end - self.start, 1e-9)
        done = [o for o in outputs if o.finish_reason in ("length", "stop")]
        out_tokens = sum(len(o.tokens) for o in outputs)
        return {
            "requests": len(outputs),
            "completed": len(done),
            "aborted": self.aborts,
            "errors": self.errors,
            "wall_s": wall,
            "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / wall,
            "prefill_tokens": self.prefill_tokens,
            "decode_steps": self.decode_steps,
            "ttft": percentiles([o.metrics.ttft for o in done]),
            "tpot": percentiles([o.metrics.tpot for o in done]),
            "e2e": percentiles([o.metrics.e2e for o in done]),
            "peak_concurrency": self.peak_running,
            "mean_concurrency": float(np.mean(self.running_samples)) if self.running_samples else 0.0,
            "peak_pages_in_use": self.peak_pages_in_use,
            "preemptions": self.preemptions,
            "integrity_checks": self.integrity_checks,
            "prefix_hit_rate": prefix_hit_pages / prefix_lookup_pages if prefix_lookup_pages else 0.0,
            "host_fraction_of_decode": self.host_time / max(self.decode_time + self.host_time, 1e-9),
        }
