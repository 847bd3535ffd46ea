"""Computed verdicts: each published claim judged from the numbers of one run, never from fixed prose.

A speed claim is judged on a paired ratio (``num / den`` within each repeat, :func:`~lab.bench.measure.paired`)
through the 95% bootstrap confidence interval of its median (``scipy.stats.bootstrap``); fewer than 3 repeats
judge nothing (``unresolved``):

- the whole interval on the published side of 1.0 -> ``reproduced`` (the direction; the size is shown beside it);
- the whole interval on the other side -> ``not reproduced``;
- the interval contains 1.0 -> ``unresolved`` (this machine's repeat-to-repeat spread cannot tell).

A count claim (requests admitted, bytes, faults caught) is deterministic and judged against a threshold.
Every experiment prints its verdict lines last (:func:`final_lines`), then its run directory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from lab.bench.report import pct

REPRODUCED, NOT_REPRODUCED, UNRESOLVED = "reproduced", "not reproduced", "unresolved"


@dataclass(frozen=True)
class Verdict:
    claim: str  # what is compared, e.g. "INT4/FP8 decode-step tok/s at concurrency 1"
    measured: str  # the measured value with its interval / range
    published: str  # the published value (from lab.figures)
    outcome: str  # REPRODUCED | NOT_REPRODUCED | UNRESOLVED (+ a short computed qualifier)

    def line(self) -> str:
        return f"{self.claim}: {self.measured} (published {self.published}) -> {self.outcome}"

    def to_dict(self) -> dict:
        return asdict(self)


MIN_REPEATS = 3  # fewer paired repeats than this judge nothing


def interval(st: dict) -> tuple[float | None, float | None, str]:
    """(low, high, kind) of a paired-ratio stats dict: the bootstrap CI when there is one, else the range;
    (None, None, ...) below :data:`MIN_REPEATS` repeats."""
    if (st or {}).get("n", 0) < MIN_REPEATS:
        return None, None, "range"
    if st.get("ci_low") is not None:
        return st["ci_low"], st["ci_high"], "95% CI"
    return st.get("min"), st.get("max"), "range"


def ratio_text(st: dict) -> str:
    """``+12.0% (95% CI +3.0%..+20.0%, range +1.0%..+25.0%, 5 repeats)``: a ratio stats dict as percentages."""
    if not st or st.get("median") is None:
        return "not measured"
    lo, hi, kind = interval(st)
    if lo is None:
        lo, hi = st.get("min"), st.get("max")
    parts = []
    if kind == "95% CI":
        parts.append(f"95% CI {pct(lo)}..{pct(hi)}")
    if st.get("n", 0) > 1:
        parts.append(f"range {pct(st['min'])}..{pct(st['max'])}")
    parts.append(f"{st.get('n', 0)} repeat{'s' if st.get('n', 0) != 1 else ''}")
    return f"{pct(st['median'])} ({', '.join(parts)})"


def direction(st: dict, published_ratio: float) -> str:
    """Outcome of a paired ratio against the direction of a published ratio (> 1: gain, < 1: loss)."""
    lo, hi, _ = interval(st)
    if lo is None or hi is None:
        return UNRESOLVED + f" (fewer than {MIN_REPEATS} repeats)"
    up = published_ratio > 1
    if (lo > 1) if up else (hi < 1):
        return REPRODUCED + " in direction"
    if (hi < 1) if up else (lo > 1):
        return NOT_REPRODUCED + " (opposite direction)"
    return UNRESOLVED + " (the interval contains no change)"


def bound(st: dict, limit: float) -> str:
    """Outcome of a paired ratio against a published bound on the size of a change (``|ratio - 1| < limit``)."""
    lo, hi, kind = interval(st)
    if lo is None or hi is None:
        return UNRESOLVED + f" (fewer than {MIN_REPEATS} repeats)"
    if 1 - limit < lo and hi < 1 + limit:
        return REPRODUCED + f" (the whole {kind} within {100 * limit:g}%)"
    if lo >= 1 + limit or hi <= 1 - limit:
        return NOT_REPRODUCED + f" (the whole {kind} beyond {100 * limit:g}%)"
    return UNRESOLVED + f" (the {kind} is wider than the {100 * limit:g}% bound)"


def across(outcomes: dict, label: str = "c=") -> str:
    """One outcome for a claim judged at several points: not reproduced where any point says so, reproduced only
    where every point does, otherwise unresolved; the points of each kind are named."""
    kinds = {k: [p for p, o in outcomes.items() if o.startswith(k)] for k in (NOT_REPRODUCED, REPRODUCED, UNRESOLVED)}
    names = {k: ", ".join(f"{label}{p}" for p in ps) for k, ps in kinds.items()}
    if kinds[NOT_REPRODUCED]:
        rest = [f"{k} at {names[k]}" for k in (REPRODUCED, UNRESOLVED) if kinds[k]]
        return f"{NOT_REPRODUCED} at {names[NOT_REPRODUCED]}" + (f" ({'; '.join(rest)})" if rest else "")
    if len(kinds[REPRODUCED]) == len(outcomes):
        return REPRODUCED + f" at every point ({names[REPRODUCED]})"
    return UNRESOLVED + f" at {names[UNRESOLVED]}" + (f" ({REPRODUCED} at {names[REPRODUCED]})"
                                                      if kinds[REPRODUCED] else "")


def points_text(by_point: dict, label: str = "c=") -> str:
    """``c=1: +1.0% [CI lo..hi]; c=8: ...`` for paired-ratio stats by point (the range below 3 repeats)."""
    out = []
    for p, st in by_point.items():
        lo, hi, kind = interval(st)
        if lo is None:
            lo, hi, kind = st.get("min"), st.get("max"), "range"
        out.append(f"{label}{p}: {pct(st.get('median'))} [{kind} {pct(lo)}..{pct(hi)}]")
    return "; ".join(out)


def at_least(measured: float, threshold: float) -> str:
    return REPRODUCED if measured >= threshold else NOT_REPRODUCED


def final_lines(verdicts: list[Verdict | dict], out_dir: str | Path) -> list[str]:
    """The lines every experiment ends with: its verdicts (objects or their dicts), then the run directory."""
    return [(v if isinstance(v, Verdict) else Verdict(**v)).line() for v in verdicts] + [f"run directory: {out_dir}"]
