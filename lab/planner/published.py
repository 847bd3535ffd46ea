"""The planner against published figures (values and sources: :mod:`lab.figures`), each with its role.

Roles -- what a match of each figure does and does not show:

- ``fitted``: ``reserve_gib`` (the one assumption not taken from a spec sheet, an engine default or a byte count)
  was chosen inside the window this figure allows; matching it shows nothing.
- ``follows``: determined by a fitted figure up to a byte ratio (same memory budget, other KV bytes per token);
  it checks the KV byte accounting, not the budget.
- ``count``: a byte count with no fitted parameter; the GB-as-GiB rule (:data:`lab.figures.GB_RULE`) is
  the reading under which these figures match, so they fix the rule rather than test it.
- ``held-out``: used to set nothing; its error is the planner's out-of-sample error. The GLM-5 KV-token figure's
  reading (FP8 KV + FP8 DSA indexer keys) was chosen because it fits: without the keys the planner gives +24%.

:data:`READING_CHECKS` are published checkpoint sizes that fit only the *decimal* reading of "GB"; they are
reported as such (:func:`lab.figures.reading_note`), never re-read to fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lab import figures
from phaseserve.planner.deployment import deployment, plan
from phaseserve.planner.inputs import Assumptions


# Published checkpoint sizes (:mod:`lab.figures` entries, read under its one GB rule: a published "GB" is GiB).
# GLM-5's FP8 (705) and INT4 (421) sizes fit that reading; Kimi K2.6's 595 GB and GLM-5.2 BF16's 1507 GB fit
# only the decimal one, which :func:`lab.figures.reading_note` reports instead of re-reading them.
@dataclass(frozen=True)
class Published:
    """A published checkpoint size: a :mod:`lab.figures` entry, in GiB under the GB rule."""

    figure: str  # id in lab.figures

    @property
    def gib(self) -> float:
        return figures.gib(self.figure)

    @property
    def source(self) -> str:
        return figures.figure(self.figure).source

    def reading_note(self, counted_gib: float) -> str:
        """'' if the count fits the GB rule; else which reading of "GB" the figure fits."""
        return figures.reading_note(self.figure, counted_gib)

PUBLISHED: dict[tuple[str, str], Published] = {
    ("glm-5", "glm-fp8"): Published("glm5.checkpoint.fp8"),
    ("glm-5", "kimi-int4"): Published("glm5.checkpoint.int4"),
    ("glm-5", "bfloat16"): Published("glm52.checkpoint.bf16"),
    ("kimi-k2.6", "kimi-int4"): Published("kimi.checkpoint"),
}


FITTED, FOLLOWS, COUNT, HELD_OUT = "fitted", "follows", "count", "held-out"
ROLES = (FITTED, FOLLOWS, COUNT, HELD_OUT)
TOLERANCE = 0.03  # every CHECKS figure within 3% under one assumption set


@dataclass(frozen=True)
class Check:
    """A published figure (id in :mod:`lab.figures`), the plan() key and deployment it is compared with."""

    figure: str
    key: str  # a key of plan()'s dict
    deploy: dict  # plan() arguments
    role: str
    note: str = ""

    @property
    def name(self) -> str:
        return figures.figure(self.figure).what

    def published(self) -> float:
        """The published value in the plan key's unit (memory figures in GiB under the GB rule)."""
        return figures.gib(self.figure) if "gib" in self.key else figures.value(self.figure)


_KIMI = {"model": "kimi-k2.6", "gpu": "h200", "num_gpus": 8, "weights": "int4"}
_GLM = {"model": "glm-5", "gpu": "h200", "num_gpus": 8}
CHECKS: tuple[Check, ...] = (
    Check("kimi.kv_tokens.bf16", "kv_tokens", {**_KIMI, "kv": "bf16"}, FITTED, "INT4 weights as shipped"),
    Check("kimi.kv_tokens.fp8", "kv_tokens", {**_KIMI, "kv": "fp8"}, FOLLOWS, "INT4 weights as shipped"),
    Check("glm5.checkpoint.fp8", "checkpoint_gib", {**_GLM, "weights": "fp8"}, COUNT),
    Check("glm5.checkpoint.int4", "checkpoint_gib", {**_GLM, "weights": "int4"}, COUNT),
    Check("glm5.weights_per_gpu.fp8", "weight_gib_per_device", {**_GLM, "weights": "fp8"}, COUNT),
    Check("glm5.weights_per_gpu.int4", "weight_gib_per_device", {**_GLM, "weights": "int4"}, COUNT),
    Check("glm5.kv_tokens.int4", "kv_tokens", {**_GLM, "weights": "int4", "kv": "fp8"}, HELD_OUT,
          "read as FP8 KV + FP8 DSA indexer keys (the reading that fits; without the keys +24%)"),
    Check("qwen3_30b.weights_per_gpu.bf16_tp4", "weight_gib_per_device",
          {"model": "qwen3-30b-a3b", "gpu": "h200", "num_gpus": 4, "weights": "bf16", "kv": "bf16"}, HELD_OUT,
          "weights per rank do not depend on the GPU model (the log is from A10s)"),
)
READING_CHECKS: tuple[Check, ...] = (
    Check("kimi.checkpoint", "checkpoint_gib", {**_KIMI, "kv": "fp8"}, COUNT, "vision tower not modelled"),
    Check("glm52.checkpoint.bf16", "checkpoint_gib", {**_GLM, "weights": "bf16"}, COUNT, "GLM-5 shapes"),
)


def check_published(assumptions: Assumptions | None = None, checks: tuple[Check, ...] = CHECKS,
                    **overrides: Any) -> list[dict[str, Any]]:
    """Each check planned under one set of assumptions: published (GB rule applied), planned, error, role."""
    rows = []
    for c in checks:
        planned = plan(**c.deploy, assumptions=assumptions, **overrides)[c.key]
        pub = c.published()
        row = {"figure": c.name, "id": c.figure, "role": c.role, "published": pub, "planned": planned,
               "error": planned / pub - 1.0, "note": c.note}
        if figures.figure(c.figure).unit == "GB":
            row["reading"] = figures.reading_note(c.figure, planned) or f"fits the GB-as-{figures.GB_RULE} rule"
        rows.append(row)
    return rows


def roles_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Plain lines, computed from :func:`check_published` rows: which figures were fitted, which follow, which are
    byte counts, which are held out, with the held-out errors."""
    def ids(role: str) -> list[dict]:
        return [r for r in rows if r["role"] == role]

    def errs(rs: list[dict]) -> str:
        return ", ".join(f"{r['figure']} {100 * r['error']:+.1f}%" for r in rs)

    return [f"- fitted (reserve_gib chosen inside the window it allows): {errs(ids(FITTED))}",
            f"- follows from the fitted figure by the KV byte ratio: {errs(ids(FOLLOWS))}",
            f"- byte counts with no fitted parameter (they fix the GB-as-{figures.GB_RULE} rule): "
            f"{errs(ids(COUNT))}",
            f"- held out (set nothing): {errs(ids(HELD_OUT))}"]


# Published throughput figures. A roofline is an upper bound (no communication, launch or scheduling costs), so
# these are shown beside the roofline for scale and for their *ratios*; they are not asserted.
@dataclass(frozen=True)
class Throughput:
    figure: str
    deploy: dict  # plan() arguments
    phase: str  # "decode" (tok/s at `concurrency`) | "prefill" (prompt tok/s)
    concurrency: int = 1


PUBLISHED_THROUGHPUT: tuple[Throughput, ...] = (
    Throughput("glm5.decode_c1_tok_s.fp8", {**_GLM, "weights": "fp8", "kv": "fp8"}, "decode"),
    Throughput("glm5.decode_c1_tok_s.int4", {**_GLM, "weights": "int4", "kv": "fp8"}, "decode"),
    Throughput("glm5.prefill_tok_s.fp8", {**_GLM, "weights": "fp8", "kv": "fp8"}, "prefill"),
    Throughput("glm5.prefill_tok_s.int4", {**_GLM, "weights": "int4", "kv": "fp8"}, "prefill"),
    Throughput("kimi.peak_tok_s.bf16", {**_KIMI, "kv": "bf16"}, "decode", 32),
    Throughput("kimi.peak_tok_s.fp8", {**_KIMI, "kv": "fp8"}, "decode", 64),
)

SENSITIVITY: tuple[dict[str, Any], ...] = (
    {}, {"reserve_gib": 8.0}, {"reserve_gib": 11.0}, {"reserve_gib": 13.0}, {"reserve_gib": 16.0},
    {"hbm_utilization": 0.95}, {"include_indexer": False}, {"load_mtp": False}, {"page_size": 16},
    {"mla_latent_replicated": False},
)


def sensitivity(variations: tuple[dict[str, Any], ...] = SENSITIVITY) -> list[dict[str, Any]]:
    """Error of every checked figure when one assumption departs from the defaults."""
    rows = []
    for v in variations:
        errs = check_published(**v)
        rows.append({"change": ", ".join(f"{k}={x}" for k, x in v.items()) or "(defaults)"}
                    | {f"#{i + 1}": f"{100 * r['error']:+.1f}%" for i, r in enumerate(errs)}
                    | {f"all within {100 * TOLERANCE:g}%": all(abs(r["error"]) < TOLERANCE for r in errs)})
    return rows


def throughput_vs_published(prompt_len: int = 8192, output_len: int = 1024, assumptions: Assumptions | None = None,
                            **overrides: Any) -> list[dict[str, Any]]:
    """Roofline numbers beside :data:`PUBLISHED_THROUGHPUT` (decode at the workload's mean context)."""
    rows = []
    for f in PUBLISHED_THROUGHPUT:
        d = deployment(**f.deploy, assumptions=assumptions, **overrides)
        if f.phase == "prefill":
            value = d.prefill_time(prompt_len)["prompt_tok_s"]
        else:
            value = d.decode_time(f.concurrency, prompt_len + output_len // 2)["tok_s"]
        pub = figures.value(f.figure)
        rows.append({"figure": figures.figure(f.figure).what, "published": pub, "roofline": value,
                     "roofline / published": value / pub})
    return rows
