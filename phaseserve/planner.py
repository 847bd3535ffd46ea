"""Capacity and roofline planner for real deployments: model preset x hardware x parallel layout.

What it computes (no arrays are allocated; the byte counts come from the library, not re-derived here):

- checkpoint size and weight bytes per device for a weight representation, from
  :func:`phaseserve.quant.size_report.preset_report` (``ArrayInfo`` trees, scales included, MTP layers as shipped);
- KV bytes per token from :func:`phaseserve.cache.paged.kv_bytes_per_token` (FP8 per-token scales included) plus
  the DSA indexer keys of GLM-5 (:func:`phaseserve.cache.paged.indexer_bytes_per_token`);
- resident KV tokens per serving replica, under a stated per-device memory budget::

      per-device KV budget = hbm_gib * hbm_utilization - weights per device - reserve_gib
      pages per device     = floor(budget / (page bytes / kv_shards))
      kv_tokens (replica)  = pages per device * page_size * attention-DP groups

  where ``kv_shards`` is how many devices one token's KV is split over (MLA: 1, the latent is replicated on
  every tensor-parallel rank; GQA: the KV heads split over up to ``num_kv_heads`` ranks);
- admitted concurrency for a workload (prompt + output tokens) under the two admission rules of the engine's
  scheduler: ``"reserve"`` (prompt + max output reserved at admission) and ``"on_demand"`` (pages grow as
  tokens are written; steady state averages each request's pages over its lifetime);
- roofline step times. Prefill is compute-bound: matmul FLOPs / the matrix rate of each weight's
  representation (FP8 at the FP8 rate; INT4 *dequantized to BF16 before the matmul*, so at the BF16 rate;
  BF16 at the BF16 rate) plus attention FLOPs at the BF16 rate. Decode is bandwidth-bound: weight bytes actually
  read per step (routed experts: only those the batch touches, ``E * (1 - (1 - k/E)^B)`` per layer under
  uniform routing, saturating to all experts as the batch grows) plus the KV bytes read, / HBM bandwidth;
  the step takes the larger of that and its compute time.

Every assumption is a field of :class:`Assumptions` with a documented default, and :func:`plan` returns them
with its numbers. The one set of defaults reproduces the published figures listed in :data:`PUBLISHED_FIGURES`
(see ``benchmarks/capacity/README.md``). Not modelled: communication (all-reduce / all-to-all), kernel launch
and scheduling overheads (``decode_overhead_s`` adds a fixed per-step cost if wanted), expert load imbalance,
speculative decoding, prefix caching. Roofline times are upper bounds on speed, not predictions of it.

Units: ``*_gib`` are 2**30 bytes, bandwidths 1e12 B/s, matrix rates 1e12 op/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from phaseserve import presets
from phaseserve.cache import paged
from phaseserve.config import ConfigError, ModelConfig, canonical_dtype
from phaseserve.quant.policy import PolicyError, QuantPolicy, resolve_policy
from phaseserve.quant.size_report import GIB, SizeReport, checkpoint_report, preset_report


class PlannerError(ConfigError):
    """A planner input is invalid (unknown preset or hardware, impossible layout, bad workload)."""


class UnknownModelError(PlannerError):
    """The model name is not one of :data:`phaseserve.presets.PRESETS`."""


class UnknownHardwareError(PlannerError):
    """The hardware name is not one of :data:`HARDWARE`."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator. Matrix rates are dense (no structured sparsity), per device."""

    name: str
    hbm_gib: float  # device memory as the runtime reports it
    hbm_tbps: float  # HBM bandwidth, TB/s (1e12 B/s)
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 matrix unit (FP8 weights are upcast and run at the BF16 rate)
    int8_tops: float
    source: str

    def rate(self, kind: str) -> float:
        """Matrix op/s for an operand kind: "bfloat16" | "fp8" | "int8"."""
        if kind == "fp8":
            return 1e12 * (self.fp8_tflops if self.fp8_tflops is not None else self.bf16_tflops)
        if kind == "int8":
            return 1e12 * self.int8_tops
        return 1e12 * self.bf16_tflops


# Public spec sheets. NVIDIA publishes tensor rates "with sparsity"; the dense rates here are half of those.
# NVIDIA's "GB" of HBM is, to within 0.5%, the GiB the driver reports (nvidia-smi memory.total), which is
# what a serving engine budgets against; we store the reported value.
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s; BF16 1,979 / FP8 3,958 / INT8 3,958
    # TFLOPS-TOPS with sparsity. nvidia-smi memory.total 81,559 MiB = 79.65 GiB.
    Hardware("h100", 81559 / 1024, 3.35, 989.5, 1979.0, 1979.0, "NVIDIA H100 datasheet (SXM5)"),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; same tensor rates as H100 SXM.
    # nvidia-smi memory.total 143,771 MiB = 140.40 GiB.
    Hardware("h200", 143771 / 1024, 4.8, 989.5, 1979.0, 1979.0, "NVIDIA H200 datasheet (SXM)"),
    # NVIDIA HGX B200 datasheet, per GPU (8 per board): 180 GB HBM3e, 8 TB/s; FP16/BF16 36 PF, FP8 72 PF,
    # INT8 72 POPS per board with sparsity -> 2.25 / 4.5 / 4.5 dense per GPU. nvidia-smi 183,359 MiB.
    Hardware("b200", 183359 / 1024, 8.0, 2250.0, 4500.0, 4500.0, "NVIDIA HGX B200 datasheet"),
    # Google Cloud TPU docs (cloud.google.com/tpu/docs/v5e, /v5p, /v6e): per chip.
    Hardware("tpu-v5e", 16.0, 0.819, 197.0, None, 394.0, "Cloud TPU v5e docs: 16 GB HBM2, 819 GBps"),
    Hardware("tpu-v5p", 95.0, 2.765, 459.0, None, 918.0, "Cloud TPU v5p docs: 95 GB HBM2e, 2765 GBps"),
    Hardware("tpu-v6e", 32.0, 1.638, 918.0, None, 1836.0, "Cloud TPU v6e docs: 32 GB HBM, 1638 GBps"),
)}
_HW_ALIASES = {"v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "trillium": "tpu-v6e", "v5litepod": "tpu-v5e"}

# Short weight names -> the policies of phaseserve.quant.policy (as the published checkpoints ship).
WEIGHT_ALIASES = {"int4": "kimi-int4", "fp8": "glm-fp8", "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class Assumptions:
    """Every assumption the planner makes. Defaults are the one set that the published figures are checked with."""

    hbm_utilization: float = 0.90  # fraction of device memory the engine may use (vLLM's gpu_memory_utilization)
    reserve_gib: float = 12.0  # per device, inside that fraction: activations, CUDA graphs, NCCL buffers, runtime
    page_size: int = 64  # tokens per KV page; capacity is rounded down to whole pages per device
    gpus_per_replica: int | None = None  # devices serving one model copy; None: all num_gpus (one replica)
    attn_tp: int | None = None  # tensor-parallel degree of attention/dense weights; None: gpus_per_replica.
    #   Routed experts are always split over the whole replica (EP or TP: same bytes per device); the rest is
    #   split over attn_tp ranks and replicated over gpus_per_replica // attn_tp attention-data-parallel groups.
    mla_latent_replicated: bool = True  # MLA: every TP rank holds the whole latent of every token (as vLLM/SGLang)
    include_indexer: bool = True  # cache the DSA indexer keys of GLM-5-style models
    indexer_dtype: str | None = None  # dtype of the indexer keys; None: the KV dtype
    load_mtp: bool = True  # weights in memory include the checkpoint's MTP layers (as shipped; used for spec decode)
    int4_compute: str = "bfloat16"  # matrix rate INT4 weights run at: dequantized to BF16 before the matmul
    attention_compute: str = "bfloat16"  # matrix rate of attention scores/values (KV computed in BF16 in prefill)
    dsa_sparse_decode: bool = True  # DSA decode reads only index_topk latent entries (+ all indexer keys)
    bandwidth_efficiency: float = 1.0  # achieved / peak HBM bandwidth in decode (1.0 = roofline)
    compute_efficiency: float = 1.0  # achieved / peak matrix rate (1.0 = roofline)
    decode_overhead_s: float = 0.0  # fixed cost per decode step (launches, collectives); 0 = pure roofline

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    key = _HW_ALIASES.get(key, key)
    if key not in HARDWARE:
        raise UnknownHardwareError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)} (aliases "
                                   f"{sorted(_HW_ALIASES)})")
    return HARDWARE[key]


def weight_policy(weights: str | QuantPolicy) -> QuantPolicy:
    """``"int4"`` (routed experts INT4 g32 + bf16 scales, rest BF16), ``"fp8"`` (GLM-FP8), ``"bf16"``, or any policy."""
    if isinstance(weights, QuantPolicy):
        return weights
    spec = WEIGHT_ALIASES.get(str(weights).strip().lower(), weights)
    try:
        return resolve_policy(spec)
    except PolicyError as e:
        raise PlannerError(f"unknown weight representation {weights!r}: {e}") from e


def _kv_dtype(kv: str) -> str:
    try:
        return canonical_dtype(str(kv).strip().lower())
    except ConfigError as e:
        raise PlannerError(f"unknown KV dtype {kv!r}: {e}") from e


@lru_cache(maxsize=64)
def _reports(model: str, policy_text: str) -> tuple[ModelConfig, SizeReport, SizeReport]:
    """(config, checkpoint report as shipped incl. MTP, serving report of the forward pass without MTP)."""
    if model not in presets.PRESETS:
        raise UnknownModelError(f"unknown model preset {model!r}; presets: {sorted(presets.PRESETS)}")
    cfg = presets.preset_config(model)
    policy = resolve_policy(policy_text)
    return cfg, preset_report(model, policy), checkpoint_report(cfg, policy)


def _kind(rep: str) -> str:
    return "int4" if rep.startswith("int4") else "fp8" if rep.startswith("fp8") else "bfloat16"


class Deployment:
    """One serving deployment: a model preset in one weight representation and KV dtype on ``num_gpus`` devices.

    Build it with :func:`deployment` (or read its :meth:`summary` through :func:`plan`).
    """

    def __init__(self, model: str, gpu: str | Hardware, num_gpus: int, weights: str | QuantPolicy, kv: str,
                 assumptions: Assumptions):
        a = self.a = assumptions
        self.model = str(model).strip().lower()
        self.hw = hardware(gpu)
        self.weights = weights if isinstance(weights, str) else weights.name
        self.policy = weight_policy(weights)
        self.kv = _kv_dtype(kv)
        self.indexer_dtype = _kv_dtype(a.indexer_dtype) if a.indexer_dtype else self.kv
        self.cfg, self.checkpoint, self.serving = _reports(self.model, self.policy.describe())
        if num_gpus < 1:
            raise PlannerError(f"num_gpus must be >= 1, got {num_gpus}")
        if not 0 < a.hbm_utilization <= 1 or a.reserve_gib < 0 or a.page_size < 1:
            raise PlannerError(f"bad memory assumptions: {a}")
        self.num_gpus = int(num_gpus)
        g = self.gpus_per_replica = int(a.gpus_per_replica or num_gpus)
        t = self.attn_tp = int(a.attn_tp or g)
        if num_gpus % g or g % t:
            raise PlannerError(f"layout: num_gpus={num_gpus} must be a multiple of gpus_per_replica={g}, "
                               f"which must be a multiple of attn_tp={t}")
        self.replicas, self.attn_dp = num_gpus // g, g // t
        self.kv_shards = self._kv_shards()

        # ---- weights
        loaded = self.checkpoint if a.load_mtp else self.serving
        experts = loaded.bytes_of("routed_experts")
        self.weight_bytes_per_device = experts / g + (loaded.total_bytes - experts) / t
        # ---- KV
        self.latent_bytes_per_token = paged.kv_bytes_per_token(self.cfg, self.kv)
        self.indexer_bytes_per_token = (paged.indexer_bytes_per_token(self.cfg, self.indexer_dtype)
                                        if a.include_indexer else 0)
        self.kv_bytes_per_token = self.latent_bytes_per_token + self.indexer_bytes_per_token
        page_bytes = (paged.kv_bytes_per_page(self.cfg, self.kv, a.page_size)
                      + a.page_size * self.indexer_bytes_per_token)
        self.page_bytes_per_device = math.ceil(page_bytes / self.kv_shards)
        self.usable_bytes_per_device = self.hw.hbm_gib * GIB * a.hbm_utilization
        self.kv_budget_bytes_per_device = (self.usable_bytes_per_device - self.weight_bytes_per_device
                                           - a.reserve_gib * GIB)
        self.fits = self.kv_budget_bytes_per_device > 0
        self.pages_per_device = max(0, int(self.kv_budget_bytes_per_device // self.page_bytes_per_device))
        self.kv_tokens = self.pages_per_device * a.page_size * self.attn_dp  # per replica

    def _kv_shards(self) -> int:
        cfg, t = self.cfg, self.attn_tp
        if cfg.is_mla:
            return 1 if self.a.mla_latent_replicated else t
        h = cfg.num_kv_heads
        if (t <= h and h % t) or (t > h and t % h):
            raise PlannerError(f"layout: attn_tp={t} does not divide or tile num_kv_heads={h}")
        return min(t, h)

    # ---- admission ------------------------------------------------------------------------------------------
    def admitted(self, prompt_len: int, output_len: int, rule: str = "reserve", max_batch: int | None = None) -> int:
        """Requests resident at once per replica for a workload, under an admission rule.

        ``"reserve"``: each request holds ``ceil((prompt + output) / page_size)`` pages from admission on.
        ``"on_demand"``: pages grow with the sequence; in steady state (staggered requests) a request holds on
        average ``mean_t ceil((prompt + t) / page_size)`` pages over its ``output`` decode steps, and the
        scheduler preempts on the rare peaks. ``max_batch`` caps the result (the engine's decode rows).
        """
        if prompt_len < 1 or output_len < 1:
            raise PlannerError(f"workload needs prompt_len >= 1 and output_len >= 1, got {prompt_len}, {output_len}")
        s = self.a.page_size
        if rule == "reserve":
            per_request = math.ceil((prompt_len + output_len) / s)
        elif rule == "on_demand":
            per_request = float(np.mean(np.ceil((prompt_len + np.arange(1, output_len + 1)) / s)))
        else:
            raise PlannerError(f"admission rule must be 'reserve' or 'on_demand', got {rule!r}")
        n = int(self.pages_per_device // per_request) * self.attn_dp
        return min(n, max_batch) if max_batch is not None else n

    # ---- roofline -------------------------------------------------------------------------------------------
    def _linear(self, tokens: float, lm_head_rows: float) -> dict[str, float]:
        """Matmul FLOPs by compute kind for ``tokens`` tokens through the serving weights (whole replica)."""
        cfg = self.cfg
        out: dict[str, float] = {}
        for r in self.serving.rows:
            if r.tensor_class in ("embeddings", "norms") or r.rep == "float32":
                continue  # lookups, vectors and the router's f32 bias: no matmul
            if r.tensor_class == "routed_experts":
                n = tokens * r.params * cfg.num_experts_per_tok / max(cfg.num_experts, 1)
            elif r.tensor_class == "lm_head":
                n = lm_head_rows * r.params
            else:
                n = tokens * r.params
            kind = _kind(r.rep)
            kind = self.a.int4_compute if kind == "int4" else kind
            out[kind] = out.get(kind, 0.0) + 2.0 * n
        return out

    def _attn_flops_per_pair(self) -> tuple[float, float]:
        """(attention FLOPs per query-key pair over all layers, DSA indexer FLOPs per pair) in prefill."""
        cfg = self.cfg
        if cfg.is_mla:
            per = 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        else:
            per = 4 * cfg.num_heads * cfg.head_dim
        idx = 2 * cfg.index_n_heads * cfg.index_head_dim if cfg.index_topk else 0
        return per * cfg.num_layers, idx * cfg.num_layers

    def _compute_time(self, flops: dict[str, float], devices: int) -> float:
        eff = self.a.compute_efficiency
        return sum(f / (self.hw.rate(k) * eff * devices) for k, f in flops.items())

    def prefill(self, prompt_len: int, batch: int = 1) -> dict[str, float]:
        """Compute-bound prefill of ``batch`` prompts of ``prompt_len`` tokens on one replica."""
        if prompt_len < 1 or batch < 1:
            raise PlannerError(f"prefill needs prompt_len >= 1 and batch >= 1, got {prompt_len}, {batch}")
        cfg = self.cfg
        flops = self._linear(batch * prompt_len, batch)  # logits only for each prompt's last position
        pair, idx_pair = self._attn_flops_per_pair()
        p = prompt_len
        pairs = p * (p + 1) / 2  # causal
        if cfg.index_topk:  # DSA: each query attends to at most index_topk keys; the indexer scores all of them
            k = min(p, cfg.index_topk)
            pairs = k * (k + 1) / 2 + (p - k) * k
        att = self.a.attention_compute
        flops[att] = flops.get(att, 0.0) + batch * (pairs * pair + p * (p + 1) / 2 * idx_pair)
        t = self._compute_time(flops, self.gpus_per_replica)
        return {"seconds": t, "prompt_tok_s": batch * prompt_len / t, "flops": sum(flops.values())}

    def decode(self, concurrency: int, context_len: int) -> dict[str, Any]:
        """One bandwidth-bound decode step of ``concurrency`` requests (per replica) with ``context_len`` cached."""
        if concurrency < 1 or context_len < 0:
            raise PlannerError(f"decode needs concurrency >= 1 and context_len >= 0, got {concurrency}, {context_len}")
        cfg, a, g, t = self.cfg, self.a, self.gpus_per_replica, self.attn_tp
        b = concurrency
        frac = 1.0
        if cfg.is_moe:
            frac = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** b
        rep = self.serving
        experts, embed = rep.bytes_of("routed_experts"), rep.bytes_of("embeddings")
        embed_rows = min(1.0, b / cfg.vocab_size) * embed  # only the looked-up rows are read
        weight_bytes = experts * frac / g + (rep.total_bytes - experts - embed + embed_rows) / t
        latent_ctx = context_len
        if cfg.index_topk and a.dsa_sparse_decode:
            latent_ctx = min(context_len, cfg.index_topk)
        per_request = latent_ctx * self.latent_bytes_per_token + context_len * self.indexer_bytes_per_token
        kv_bytes = b / self.attn_dp * per_request / self.kv_shards
        mem_s = (weight_bytes + kv_bytes) / (self.hw.hbm_tbps * 1e12 * a.bandwidth_efficiency)
        flops = self._linear(b, b)
        if cfg.is_mla:  # absorbed MLA: scores against the latent (+rope), values from the latent
            per_key = 2 * cfg.num_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        else:
            per_key = 4 * cfg.num_heads * cfg.head_dim
        idx = 2 * cfg.index_n_heads * cfg.index_head_dim if cfg.index_topk else 0
        att = b * cfg.num_layers * (latent_ctx * per_key + context_len * idx)
        # attention runs in attn_dp groups of attn_tp ranks; the linear FLOPs spread over the whole replica
        compute_s = self._compute_time(flops, g) + self._compute_time({a.attention_compute: att}, g)
        step = max(mem_s, compute_s) + a.decode_overhead_s
        return {"concurrency": b, "context_len": context_len, "step_s": step, "tok_s": b / step,
                "tok_s_per_request": 1.0 / step, "bound": "memory" if mem_s >= compute_s else "compute",
                "weight_gib_read_per_device": weight_bytes / GIB, "kv_gib_read_per_device": kv_bytes / GIB,
                "expert_fraction_read": frac, "memory_s": mem_s, "compute_s": compute_s}

    def decode_curve(self, concurrencies: list[int], prompt_len: int, output_len: int,
                     rule: str = "on_demand") -> list[dict[str, Any]]:
        """Decode tok/s vs concurrency at the workload's mean context ``prompt + output / 2``.

        Each row says whether that concurrency fits in the KV cache under ``rule`` (``fits_kv``).
        """
        limit = self.admitted(prompt_len, output_len, rule)
        ctx = prompt_len + output_len // 2
        return [{**self.decode(c, ctx), "fits_kv": c <= limit} for c in concurrencies]

    # ---- summary --------------------------------------------------------------------------------------------
    def summary(self, prompt_len: int | None = None, output_len: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "gpu": self.hw.name, "num_gpus": self.num_gpus, "weights": self.weights,
            "weight_policy": self.policy.describe(), "kv": self.kv,
            "checkpoint_gib": self.checkpoint.gib, "checkpoint_gb": self.checkpoint.gb,
            "weight_gib_per_device": self.weight_bytes_per_device / GIB,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_latent": self.latent_bytes_per_token,
            "kv_bytes_per_token_indexer": self.indexer_bytes_per_token,
            "kv_bytes_per_token_per_device": self.kv_bytes_per_token / self.kv_shards,
            "kv_budget_gib_per_device": self.kv_budget_bytes_per_device / GIB,
            "kv_pages_per_device": self.pages_per_device, "kv_tokens": self.kv_tokens,
            "kv_tokens_total": self.kv_tokens * self.replicas, "fits": self.fits,
            "replicas": self.replicas, "gpus_per_replica": self.gpus_per_replica, "attn_tp": self.attn_tp,
            "attn_dp": self.attn_dp, "kv_shards": self.kv_shards,
            "hardware": dataclasses.asdict(self.hw), "assumptions": self.a.to_dict(),
        }
        if prompt_len is not None and output_len is not None:
            ctx = prompt_len + output_len // 2
            adm = {r: self.admitted(prompt_len, output_len, r) for r in ("reserve", "on_demand")}
            out["workload"] = {
                "prompt_len": prompt_len, "output_len": output_len,
                "admitted_reserve": adm["reserve"], "admitted_on_demand": adm["on_demand"],
                "prefill_prompt_tok_s": self.prefill(prompt_len)["prompt_tok_s"],
                "decode_tok_s_c1": self.decode(1, ctx)["tok_s"],
                "decode_tok_s_at_admitted": (self.decode(adm["on_demand"], ctx)["tok_s"]
                                             if adm["on_demand"] else 0.0),
            }
        return out


def _assumptions(assumptions: Assumptions | None, overrides: dict[str, Any]) -> Assumptions:
    base = assumptions or Assumptions()
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Assumptions)}
    if unknown:
        raise PlannerError(f"unknown assumption(s) {sorted(unknown)}; known: "
                           f"{[f.name for f in dataclasses.fields(Assumptions)]}")
    return dataclasses.replace(base, **overrides)


def deployment(model: str = "kimi-k2.6", gpu: str | Hardware = "h200", num_gpus: int = 8,
               weights: str | QuantPolicy = "int4", kv: str = "fp8", assumptions: Assumptions | None = None,
               **overrides: Any) -> Deployment:
    """A :class:`Deployment`; keyword ``overrides`` replace fields of ``assumptions`` (default :class:`Assumptions`)."""
    return Deployment(model, gpu, num_gpus, weights, kv, _assumptions(assumptions, overrides))


def plan(model: str = "kimi-k2.6", gpu: str | Hardware = "h200", num_gpus: int = 8,
         weights: str | QuantPolicy = "int4", kv: str = "fp8", *, prompt_len: int | None = None,
         output_len: int | None = None, assumptions: Assumptions | None = None, **overrides: Any) -> dict:
    """Capacity plan as a plain dict (the public contract, see DESIGN.md).

    Keys include ``checkpoint_gib``, ``weight_gib_per_device``, ``kv_bytes_per_token``, ``kv_tokens`` (resident
    KV tokens per serving replica), ``fits``, the layout, ``hardware`` and every assumption used
    (``assumptions``). With ``prompt_len`` and ``output_len`` it adds a ``workload`` section: admitted
    concurrency under both admission rules and roofline prefill / decode throughput.
    """
    return deployment(model, gpu, num_gpus, weights, kv, assumptions, **overrides).summary(prompt_len, output_len)


# ---- the published figures this planner is checked against ---------------------------------------------------
@dataclass(frozen=True)
class Figure:
    """A published number, the deployment it describes, and the plan key it is compared with."""

    name: str
    published: float
    key: str  # a key of plan()'s dict
    deploy: dict  # plan() arguments
    note: str = ""


_GLM = {"model": "glm-5", "gpu": "h200", "num_gpus": 8}
PUBLISHED_FIGURES: tuple[Figure, ...] = (
    Figure("Kimi K2.6 8xH200, BF16 KV: resident KV tokens", 686_000, "kv_tokens",
           {"model": "kimi-k2.6", "gpu": "h200", "num_gpus": 8, "weights": "int4", "kv": "bf16"},
           "INT4 weights as shipped"),
    Figure("Kimi K2.6 8xH200, FP8 KV: resident KV tokens", 1_370_000, "kv_tokens",
           {"model": "kimi-k2.6", "gpu": "h200", "num_gpus": 8, "weights": "int4", "kv": "fp8"},
           "INT4 weights as shipped"),
    Figure("GLM-5 FP8 checkpoint (GiB)", 705.0, "checkpoint_gib", {**_GLM, "weights": "fp8"},
           "published 'GB' read as GiB"),
    Figure("GLM-5 INT4 checkpoint (GiB)", 421.0, "checkpoint_gib", {**_GLM, "weights": "int4"},
           "routed experts INT4 g32 + bf16 scales, rest BF16; 'GB' read as GiB"),
    Figure("GLM-5 FP8 weights per GPU, 8-way TP (GiB)", 88.0, "weight_gib_per_device", {**_GLM, "weights": "fp8"}),
    Figure("GLM-5 INT4 weights per GPU, 8-way TP (GiB)", 52.0, "weight_gib_per_device", {**_GLM, "weights": "int4"}),
    Figure("GLM-5 INT4 8xH200: resident KV tokens", 1_180_000, "kv_tokens", {**_GLM, "weights": "int4", "kv": "fp8"},
           "FP8 KV (the decode representation) + FP8 DSA indexer keys"),
)


def check_published(assumptions: Assumptions | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """Each :data:`PUBLISHED_FIGURES` entry planned under one set of assumptions, with its relative error."""
    rows = []
    for f in PUBLISHED_FIGURES:
        planned = plan(**f.deploy, assumptions=assumptions, **overrides)[f.key]
        rows.append({"figure": f.name, "published": f.published, "planned": planned,
                     "error": planned / f.published - 1.0, "note": f.note})
    return rows


# Published throughput figures. A roofline is an upper bound (no communication, launch or scheduling costs), so
# these are shown beside the roofline for scale and for their *ratios*; they are not asserted.
@dataclass(frozen=True)
class Throughput:
    name: str
    published: float
    deploy: dict  # plan() arguments
    phase: str  # "decode" (tok/s at `concurrency`) | "prefill" (prompt tok/s)
    concurrency: int = 1


PUBLISHED_THROUGHPUT: tuple[Throughput, ...] = (
    Throughput("GLM-5 FP8 weights, decode tok/s at concurrency 1", 60, {**_GLM, "weights": "fp8", "kv": "fp8"},
               "decode"),
    Throughput("GLM-5 INT4 weights, decode tok/s at concurrency 1", 92, {**_GLM, "weights": "int4", "kv": "fp8"},
               "decode"),
    Throughput("GLM-5 FP8 weights, prefill prompt tok/s", 10_160, {**_GLM, "weights": "fp8", "kv": "fp8"}, "prefill"),
    Throughput("GLM-5 INT4 weights, prefill prompt tok/s", 8_660, {**_GLM, "weights": "int4", "kv": "fp8"},
               "prefill"),
    Throughput("Kimi K2.6 BF16 KV, decode tok/s at 32 requests", 1_558,
               {"model": "kimi-k2.6", "gpu": "h200", "num_gpus": 8, "weights": "int4", "kv": "bf16"}, "decode", 32),
    Throughput("Kimi K2.6 FP8 KV, decode tok/s at 64 requests", 2_192,
               {"model": "kimi-k2.6", "gpu": "h200", "num_gpus": 8, "weights": "int4", "kv": "fp8"}, "decode", 64),
)


SENSITIVITY: tuple[dict[str, Any], ...] = (
    {}, {"reserve_gib": 8.0}, {"reserve_gib": 11.0}, {"reserve_gib": 13.0}, {"reserve_gib": 16.0},
    {"hbm_utilization": 0.95}, {"include_indexer": False}, {"load_mtp": False}, {"page_size": 16},
    {"mla_latent_replicated": False},
)


def sensitivity(variations: tuple[dict[str, Any], ...] = SENSITIVITY) -> list[dict[str, Any]]:
    """Error of every published capacity figure when one assumption departs from the defaults."""
    rows = []
    for v in variations:
        errs = check_published(**v)
        rows.append({"change": ", ".join(f"{k}={x}" for k, x in v.items()) or "(defaults)"}
                    | {f"#{i + 1}": f"{100 * r['error']:+.1f}%" for i, r in enumerate(errs)}
                    | {"all within 3%": all(abs(r["error"]) < 0.03 for r in errs)})
    return rows


def throughput_vs_published(prompt_len: int = 8192, output_len: int = 1024, assumptions: Assumptions | None = None,
                            **overrides: Any) -> list[dict[str, Any]]:
    """Roofline numbers beside :data:`PUBLISHED_THROUGHPUT` (decode at the workload's mean context)."""
    rows = []
    for f in PUBLISHED_THROUGHPUT:
        d = deployment(**f.deploy, assumptions=assumptions, **overrides)
        if f.phase == "prefill":
            value = d.prefill(prompt_len)["prompt_tok_s"]
        else:
            value = d.decode(f.concurrency, prompt_len + output_len // 2)["tok_s"]
        rows.append({"figure": f.name, "published": f.published, "roofline": value,
                     "roofline / published": value / f.published})
    return rows


def capacity_report(models: list[str], gpus: list[str], num_gpus: int | dict[str, int], weights: list[str],
                    kvs: list[str], prompt_len: int, output_len: int, concurrencies: list[int],
                    compare_models: list[str] = (), compare_gpus: list[str] = (),
                    assumptions: Assumptions | None = None, **overrides: Any) -> tuple[dict[str, Any], str]:
    """Every planner table for a set of deployments: ``(json-able dict, markdown)``.

    ``num_gpus`` is one count or ``{"default": n, "<model>": m}``. ``compare_*`` adds KV tokens of those models
    (INT4 weights, FP8 KV) on each of ``compare_gpus``.
    """
    a = _assumptions(assumptions, overrides)
    counts = num_gpus if isinstance(num_gpus, dict) else {"default": num_gpus}

    def n_for(m: str) -> int:
        return int(counts.get(m, counts.get("default", 8)))

    out: dict[str, Any] = {"assumptions": a.to_dict(), "workload": {"prompt_len": prompt_len,
                                                                  "output_len": output_len}}
    out["published_capacity"] = check_published(a)
    out["published_throughput"] = throughput_vs_published(prompt_len, output_len, a)
    cap, dec, pre = [], [], []
    for m in models:
        for g in gpus:
            for w in weights:
                for kv in kvs:
                    p = plan(m, g, n_for(m), w, kv, prompt_len=prompt_len, output_len=output_len, assumptions=a)
                    wl = p.pop("workload")
                    cap.append({k: p[k] for k in ("model", "gpu", "num_gpus", "weights", "kv", "checkpoint_gib",
                                                  "weight_gib_per_device", "kv_bytes_per_token",
                                                  "kv_budget_gib_per_device", "kv_tokens")}
                               | {"admitted_reserve": wl["admitted_reserve"],
                                  "admitted_on_demand": wl["admitted_on_demand"]})
                    d = deployment(m, g, n_for(m), w, kv, a)
                    curve = d.decode_curve(concurrencies, prompt_len, output_len)
                    dec.append({"model": m, "gpu": g, "weights": w, "kv": kv}
                               | {f"c={r['concurrency']}": r["tok_s"] if r["fits_kv"] else None for r in curve})
                pr = deployment(m, g, n_for(m), w, kvs[0], a).prefill(prompt_len)
                pre.append({"model": m, "gpu": g, "weights": w, "prompt_tok_s": pr["prompt_tok_s"],
                            "seconds_per_prompt": pr["seconds"]})
    out["capacity"], out["decode_tok_s"], out["prefill"] = cap, dec, pre
    out["by_hardware"] = [
        {k: p[k] for k in ("model", "gpu", "num_gpus", "weights", "kv", "weight_gib_per_device", "fits",
                           "kv_tokens")}
        for m in compare_models for g in compare_gpus for p in [plan(m, g, n_for(m), "int4", "fp8", assumptions=a)]]
    out["hardware"] = [dataclasses.asdict(h) for h in HARDWARE.values()]

    out["sensitivity"] = sensitivity()
    pct = [{"#": i + 1, **r, "error": f"{100 * r['error']:+.2f}%"} for i, r in enumerate(out["published_capacity"])]
    md = [f"## Published capacity figures vs the planner (one assumption set)\n\n{markdown_table(pct)}",
          "## Sensitivity: the published figures (#) when one assumption changes\n\n"
          + markdown_table(out["sensitivity"]),
          f"## Capacity (workload {prompt_len} + {output_len} tokens)\n\n{markdown_table(cap)}",
          f"## Roofline decode tok/s per replica vs concurrency (context {prompt_len} + {output_len // 2}; "
          f"— = exceeds the KV cache under on-demand admission)\n\n{markdown_table(dec)}",
          f"## Roofline prefill ({prompt_len}-token prompts, one replica)\n\n{markdown_table(pre)}",
          "## Published throughput vs the roofline (upper bounds; not asserted)\n\n"
          + markdown_table(out["published_throughput"])]
    if out["by_hardware"]:
        md.append(f"## KV tokens by hardware (INT4 weights, FP8 KV)\n\n{markdown_table(out['by_hardware'])}")
    md.append(f"## Hardware specs\n\n{markdown_table(out['hardware'])}")
    md.append("## Assumptions\n\n" + markdown_table([{"assumption": k, "value": v} for k, v in a.to_dict().items()]))
    return out, "\n\n".join(md) + "\n"


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A markdown table of ``rows`` (floats to 4 significant digits, large numbers with thousands separators)."""
    if not rows:
        return ""
    columns = columns or list(rows[0])

    def fmt(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, int) or (isinstance(v, float) and abs(v) >= 1e3):
            return f"{v:,.0f}"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
