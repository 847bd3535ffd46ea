"""Run-level serving metrics: latency percentiles, throughput, cache occupancy, preemptions and aborts.

What one summary covers: everything since the engine was built or since :meth:`Engine.reset_metrics` -- the
outputs of every ``generate`` / ``stream`` call in between, and as wall time the *sum of those calls' own
durations* (each call opens a timed window with :meth:`RunMetrics.begin` and closes it with
:meth:`RunMetrics.finish`; time spent outside the calls does not count). Tokens and time are therefore always
counted over the same calls, so ``output_tok_per_s`` of two calls is their tokens over their summed wall time.

:func:`kernel_provenance` is the engine summary's ``kernels`` table: for each op of the prefill and decode steps,
which implementation was built (Pallas kernel, XLA reference, fallback with its reason, XLA for plain weights) and
how it was laid out on the phase's mesh (``phaseserve.kernel_mesh``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np

from phaseserve.engine.request import RequestOutput
from phaseserve.kernel_mesh import provenance_rows


def percentiles(values: list[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    return {f"p{q}": (float(np.percentile(vals, q)) if vals else None) for q in qs}


@dataclass
class RunMetrics:
    """Counters the engine updates as it runs; :meth:`summary` turns them and the outputs into one dict."""

    start: float = 0.0  # opening of the current (or last) timed window, perf_counter seconds
    end: float = 0.0  # its close
    busy_s: float = 0.0  # sum of the closed windows since the last reset
    decode_steps: int = 0
    prefill_batches: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    aborts: int = 0  # requests aborted by a failed page-tag check (KVIntegrityError)
    errors: int = 0
    nonfinite: int = 0  # of the errors: NaN/inf logits or attention output (NonFiniteLogitsError)
    integrity_checks: int = 0
    peak_running: int = 0
    peak_pages_in_use: int = 0
    decode_time: float = 0.0
    prefill_time: float = 0.0
    host_time: float = 0.0  # host time inside the decode call only (the summary counts schedule() via the wall)
    running_sum: int = 0  # running requests summed over the observed steps (a mean, not a list: a server that is
    running_steps: int = 0  # never idle observes a step forever)

    def begin(self) -> None:
        """Open a timed window (a ``generate`` / ``stream`` call starts)."""
        self.start = time.perf_counter()

    def finish(self) -> None:
        """Close the window opened by :meth:`begin`; its length adds to the run's wall time."""
        self.end = time.perf_counter()
        self.busy_s += self.end - self.start

    def observe(self, running: int, pages_in_use: int) -> None:
        self.peak_running = max(self.peak_running, running)
        self.peak_pages_in_use = max(self.peak_pages_in_use, pages_in_use)
        self.running_sum += running
        self.running_steps += 1

    @property
    def mean_running(self) -> float:
        """Mean running requests per observed step (0 before any)."""
        return self.running_sum / self.running_steps if self.running_steps else 0.0

    def summary(self, outputs: list[RequestOutput], prefix_lookup_pages: int = 0, prefix_hit_pages: int = 0) -> dict:
        """Aggregate counters and per-request metrics; prefix counts come from the scheduler that owns them.

        ``wall_s`` is the summed length of the closed windows (a driver that sets ``start`` / ``end`` itself
        without :meth:`finish` gets ``end - start``). ``host_fraction_of_decode`` is the share of the decode part
        of the loop (wall minus prefill) that is not the decode device call: scheduling, page tables, the
        integrity bookkeeping and token emission all count.
        """
        wall = max(self.busy_s or (self.end - self.start), 1e-9)
        done = [o for o in outputs if o.finish_reason in ("length", "stop")]
        out_tokens = sum(len(o.tokens) for o in outputs)
        return {
            "requests": len(outputs),
            "completed": len(done),
            "aborted": self.aborts,
            "errors": self.errors,
            "nonfinite_errors": self.nonfinite,
            "wall_s": wall,
            "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / wall,
            "prefill_tokens": self.prefill_tokens,
            "decode_steps": self.decode_steps,
            "ttft": percentiles([o.metrics.ttft for o in done]),
            "tpot": percentiles([o.metrics.tpot for o in done]),
            "e2e": percentiles([o.metrics.e2e for o in done]),
            "peak_concurrency": self.peak_running,
            "mean_concurrency": self.mean_running,
            "peak_pages_in_use": self.peak_pages_in_use,
            "preemptions": self.preemptions,
            "integrity_checks": self.integrity_checks,
            "prefix_hit_rate": prefix_hit_pages / prefix_lookup_pages if prefix_lookup_pages else 0.0,
            "host_fraction_of_decode": max(wall - self.prefill_time - self.decode_time, 0.0)
            / max(wall - self.prefill_time, 1e-9),
        }


def kernel_provenance(*logs: collections.Counter) -> list[dict]:
    """The phases' kernel logs merged into rows {phase, op, platform, impl, reason, layout, count}; ``count`` is the
    number of traced call sites (each compiled step runs what was traced), not of executions."""
    return provenance_rows(sum(logs, collections.Counter()))


OVERSIZE_FACTOR = 4  # a pool this many times larger than the running requests can hold draws a warning


def oversized_pool(num_pages: int, max_batch: int, max_pages_per_seq: int, page_bytes: int) -> str | None:
    """A warning (with the numbers) when the KV pool is far larger than the work can use, else None.

    At most ``max_batch * max_pages_per_seq`` pages are held by running requests at once (the rest can only keep
    finished prefixes for reuse). A pool more than :data:`OVERSIZE_FACTOR` times that is memory the work cannot
    use; ``page_bytes`` is one page's size in the chosen KV dtype.
    """
    usable = max_batch * max_pages_per_seq
    if num_pages - 1 <= OVERSIZE_FACTOR * usable:
        return None
    return (f"the KV budget gives {num_pages - 1:,} pages ({(num_pages - 1) * page_bytes / 2**20:,.1f} MiB) but "
            f"max_batch={max_batch} x max_pages_per_seq={max_pages_per_seq} running requests can hold at most "
            f"{usable:,} ({usable * page_bytes / 2**20:,.1f} MiB): memory the work cannot use -- lower "
            f"CacheConfig.kv_budget_bytes (or set num_pages) to fit the work")
