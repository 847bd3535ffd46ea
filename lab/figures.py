"""The published figures phaseserve reproduces or checks itself against: one registry, every figure with its source.

Every module that compares with a published number (the planner, the presets' checkpoint sizes, the bench
experiments and their reports) reads it from here by id, so a figure is typed once. ``docs/published.md`` is
generated from this module (:func:`markdown`); a test keeps the two equal.

**The one GB rule.** A figure published in "GB" is read as GiB (2**30 bytes) -- the unit serving engines and
``nvidia-smi`` report memory in. :func:`gib` applies it; ``gib(id, reading="decimal")`` gives the other reading
(1e9 bytes), which reports use only to say that a figure fits *that* reading and not the rule
(:func:`readings`), never to switch the reading per figure.

Sources. The target results the project was built to reproduce come from the Cloudflare Blog post "Smaller, faster,
safer: running Kimi and GLM at scale" (its Kimi K2.6 FP8-KV, GLM-5 INT4-weight and page-tag integrity parts;
``docs/design.md`` restates them). Figures found later (checkpoint sizes, a vLLM log) name the page they come from.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GB_RULE = "GiB"  # how every published "GB" is read (see the module docstring)
READINGS = {"GiB": GIB, "decimal": 10**9}
_DESIGN = 'Cloudflare Blog, "Smaller, faster, safer: running Kimi and GLM at scale" ({} part)'
_KIMI, _GLM = _DESIGN.format("Kimi K2.6 FP8-KV, 8xH200"), _DESIGN.format("GLM-5.x INT4-weight, 8-way TP")
_INTEGRITY = _DESIGN.format("page-tag integrity")


@dataclass(frozen=True)
class Figure:
    """One published number: what it counts, in which unit it was published, and where it comes from."""

    id: str
    value: float
    unit: str  # "GB" (read under GB_RULE), "GiB" (binary as published), "tokens", "tok/s", "requests", "ratio", ...
    what: str
    source: str


FIGURES: tuple[Figure, ...] = (
    # ---- Kimi K2.6, 8xH200, INT4 weights: FP8 vs BF16 KV under one memory budget
    Figure("kimi.kv_tokens.bf16", 686_000, "tokens", "Kimi K2.6 8xH200, BF16 KV: resident KV tokens", _KIMI),
    Figure("kimi.kv_tokens.fp8", 1_370_000, "tokens", "Kimi K2.6 8xH200, FP8 KV: resident KV tokens", _KIMI),
    Figure("kimi.peak_requests.bf16", 32, "requests", "Kimi K2.6, BF16 KV: concurrent requests at the peak", _KIMI),
    Figure("kimi.peak_requests.fp8", 64, "requests", "Kimi K2.6, FP8 KV: concurrent requests at the peak", _KIMI),
    Figure("kimi.peak_tok_s.bf16", 1_558, "tok/s", "Kimi K2.6, BF16 KV: throughput at 32 requests", _KIMI),
    Figure("kimi.peak_tok_s.fp8", 2_192, "tok/s", "Kimi K2.6, FP8 KV: throughput at 64 requests", _KIMI),
    Figure("kimi.cost_per_token_ratio", 0.70, "ratio", "Kimi K2.6: FP8-KV cost per token / BF16-KV (~30% lower)",
           _KIMI),
    Figure("kimi.checkpoint", 595, "GB", "moonshotai/Kimi-K2.6 files (INT4 experts + BF16 rest, incl. ~0.9 GB "
           "vision tower not modelled)", "unsloth's Kimi-K2.6 page (lossless re-encoding listed at 595 GB)"),
    # ---- GLM-5.x, 8-way TP: INT4 vs FP8 weights
    Figure("glm5.checkpoint.fp8", 705, "GB", "GLM-5 FP8 checkpoint", _GLM),
    Figure("glm5.checkpoint.int4", 421, "GB", "GLM-5 INT4 checkpoint (routed experts INT4 g32 + BF16 scales, rest "
           "BF16)", _GLM),
    Figure("glm5.weights_per_gpu.fp8", 88, "GB", "GLM-5 FP8 weights per GPU, 8-way TP", _GLM),
    Figure("glm5.weights_per_gpu.int4", 52, "GB", "GLM-5 INT4 weights per GPU, 8-way TP", _GLM),
    Figure("glm5.kv_tokens.int4", 1_180_000, "tokens", "GLM-5 INT4 8xH200: room for KV tokens", _GLM),
    Figure("glm5.decode_c1_tok_s.fp8", 60, "tok/s", "GLM-5 FP8 weights: decode tok/s at concurrency 1", _GLM),
    Figure("glm5.decode_c1_tok_s.int4", 92, "tok/s", "GLM-5 INT4 weights: decode tok/s at concurrency 1", _GLM),
    Figure("glm5.decode_gain.min", 0.16, "ratio-1", "GLM-5 INT4/FP8 decode gain, lowest across concurrencies", _GLM),
    Figure("glm5.decode_gain.max", 0.55, "ratio-1", "GLM-5 INT4/FP8 decode gain, highest across concurrencies", _GLM),
    Figure("glm5.prefill_tok_s.fp8", 10_160, "tok/s", "GLM-5 FP8 weights: prefill prompt tok/s", _GLM),
    Figure("glm5.prefill_tok_s.int4", 8_660, "tok/s", "GLM-5 INT4 weights: prefill prompt tok/s", _GLM),
    Figure("glm5.quality_delta_points", 0.8, "points", "GLM-5 INT4 vs FP8: largest benchmark-score difference", _GLM),
    Figure("glm52.checkpoint.bf16", 1507, "GB", "GLM-5.2 BF16 checkpoint (GLM-5's glm_moe_dsa shapes)",
           "a GLM-5.2-NVFP4 model card ('GLM-5.2 BF16 (1507 GB)')"),
    # ---- integrity check
    Figure("integrity.max_delta", 0.01, "ratio", "integrity check on: throughput and p95 latency change below 1%",
           _INTEGRITY),
    Figure("integrity.input_tokens", 8_192, "tokens", "integrity measurement: input tokens per request",
           _INTEGRITY),
    Figure("integrity.output_tokens", 1_000, "tokens", "integrity measurement: output tokens per request",
           _INTEGRITY),
    # ---- held out: never used to set anything in the planner
    Figure("qwen3_30b.weights_per_gpu.bf16_tp4", 14.2474, "GiB", "Qwen3-30B-A3B BF16, tensor parallel 4 (vLLM "
           "0.8.5 on 4xA10): 'Model loading took 14.2474 GiB' per rank",
           "vllm-project/vllm issue #17327 (Qwen3 Usage Guide), log in a comment by cpwan, 2025-04-30"),
)
_BY_ID = {f.id: f for f in FIGURES}


class UnknownFigureError(KeyError):
    """The id is not in :data:`FIGURES`."""


def figure(fid: str) -> Figure:
    if fid not in _BY_ID:
        raise UnknownFigureError(f"unknown published figure {fid!r}; known: {sorted(_BY_ID)}")
    return _BY_ID[fid]


def value(fid: str) -> float:
    """The number as published (in its own unit)."""
    return figure(fid).value


def ratio(num: str, den: str) -> float:
    """``value(num) / value(den)`` (e.g. the published throughput gain)."""
    return value(num) / value(den)


def gib(fid: str, reading: str = GB_RULE) -> float:
    """A memory figure in GiB: "GB" figures under ``reading`` (default: the rule), "GiB" figures as published."""
    f = figure(fid)
    if f.unit == "GiB":
        return f.value
    if f.unit != "GB":
        raise ValueError(f"figure {fid!r} is in {f.unit}, not a memory size")
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {sorted(READINGS)}, got {reading!r}")
    return f.value * READINGS[reading] / GIB


def readings(fid: str, counted_gib: float) -> dict[str, float]:
    """Relative error of a counted size (GiB) against the figure under each reading of "GB"."""
    if figure(fid).unit == "GiB":
        return {"GiB": counted_gib / gib(fid) - 1}
    return {r: counted_gib / gib(fid, r) - 1 for r in READINGS}


def reading_note(fid: str, counted_gib: float, tol: float = 0.03) -> str:
    """'' when the figure fits the rule (within ``tol``); otherwise which reading it fits, said plainly."""
    errs = readings(fid, counted_gib)
    if abs(errs.get(GB_RULE, errs.get("GiB", 0.0))) <= tol:
        return ""
    fits = [r for r, e in errs.items() if abs(e) <= tol]
    other = f"; it fits only the {fits[0]} reading ({100 * errs[fits[0]]:+.1f}%)" if fits else ""
    return f"does not fit the GB-as-GiB rule ({100 * errs[GB_RULE]:+.1f}%){other}"


def markdown() -> str:
    """The registry as a markdown table (``docs/published.md``)."""
    lines = ["| id | value | unit | what | source |", "|---|---:|---|---|---|"]
    lines += [f"| `{f.id}` | {f.value:,} | {f.unit} | {f.what} | {f.source} |" for f in FIGURES]
    return "\n".join(lines)
