"""Capacity of one serving deployment: weights per device, KV bytes per token, resident KV tokens, admission.

No arrays are allocated; the byte counts come from the library, not re-derived here:

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
- admitted concurrency for a workload under the engine scheduler's two admission rules (:meth:`Deployment.admitted`).

Step times are :mod:`phaseserve.planner.roofline`'s; :func:`plan` returns both as the public dict.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Any

import numpy as np

from phaseserve import presets
from phaseserve.cache import paged
from phaseserve.config import ConfigError, ModelConfig, canonical_dtype
from phaseserve.planner import roofline
from phaseserve.planner.inputs import (
    Assumptions,
    Hardware,
    PlannerError,
    UnknownModelError,
    hardware,
    with_overrides,
)
from phaseserve.quant.policy import PolicyError, QuantPolicy, resolve_policy
from phaseserve.quant.size_report import GIB, SizeReport, checkpoint_report, preset_report

# Short weight names -> the policies of phaseserve.quant.policy (as the published checkpoints ship).
WEIGHT_ALIASES = {"int4": "kimi-int4", "fp8": "glm-fp8", "bf16": "bfloat16", "bfloat16": "bfloat16"}


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



@lru_cache(maxsize=64)
def engine_weight_bytes(cfg: ModelConfig, policy_text: str, tp: int, ep: int) -> float:
    """Bytes per device of the serving weights (no MTP) on an ``(ep, tp)`` mesh as the engine places them
    (``phaseserve.sharding.param_shardings``: each stored array's spec from ``kernel_mesh.weight_spec``), counted
    on an abstract mesh: no devices, no arrays. Unpadded (TPU tiled layouts add a little: benchmarks/tpu_compile)."""
    import jax
    from jax.sharding import AbstractMesh, PartitionSpec

    from phaseserve.kernel_mesh import component_specs, weight_spec
    from phaseserve.model.params import logical_axes
    from phaseserve.quant.quantize import abstract_quantized, shape_dtype_tree

    params = shape_dtype_tree(abstract_quantized(cfg, resolve_policy(policy_text)))
    mesh = AbstractMesh((ep, tp), ("ep", "tp"))
    total = 0.0

    def one(axes: tuple, w: Any) -> None:
        nonlocal total
        specs = component_specs(w, weight_spec(axes, w, mesh))
        arrays = jax.tree.leaves(w)
        spec_list = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for arr, spec in zip(arrays, spec_list, strict=True):
            split = math.prod(mesh.shape[ax] for ax in spec if ax is not None)
            total += math.prod(arr.shape) * np.dtype(arr.dtype).itemsize / split

    jax.tree.map(one, logical_axes(cfg), params, is_leaf=lambda x: isinstance(x, tuple))
    return total


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
        if a.weight_layout not in ("even", "engine"):
            raise PlannerError(f"weight_layout must be 'even' or 'engine', got {a.weight_layout!r}")
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
        if a.weight_layout == "engine":  # the serving weights as phaseserve places them; MTP layers split evenly
            mtp = loaded.total_bytes - self.serving.total_bytes
            self.weight_bytes_per_device = engine_weight_bytes(self.cfg, self.policy.describe(), t, g // t) + mtp / t
        # ---- KV
        self.latent_bytes_per_token = paged.kv_bytes_per_token(self.cfg, self.kv, include_indexer=False)
        self.indexer_bytes_per_token = (paged.indexer_bytes_per_token(self.cfg, self.indexer_dtype)
                                        if a.include_indexer else 0)
        self.kv_bytes_per_token = self.latent_bytes_per_token + self.indexer_bytes_per_token
        page_bytes = (paged.kv_bytes_per_page(self.cfg, self.kv, a.page_size, include_indexer=False)
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
    # ---- step times (phaseserve.planner.roofline) -------------------------------------------------------------
    def prefill_time(self, prompt_len: int, batch: int = 1) -> dict[str, float]:
        return roofline.prefill_time(self, prompt_len, batch)

    def decode_time(self, concurrency: int, context_len: int) -> dict[str, Any]:
        return roofline.decode_time(self, concurrency, context_len)

    def decode_curve(self, concurrencies: list[int], prompt_len: int, output_len: int,
                     rule: str = "on_demand") -> list[dict[str, Any]]:
        return roofline.decode_curve(self, concurrencies, prompt_len, output_len, rule)

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
                "prefill_prompt_tok_s": self.prefill_time(prompt_len)["prompt_tok_s"],
                "decode_tok_s_c1": self.decode_time(1, ctx)["tok_s"],
                "decode_tok_s_at_admitted": (self.decode_time(adm["on_demand"], ctx)["tok_s"]
                                             if adm["on_demand"] else 0.0),
            }
        return out


def deployment(model: str = "kimi-k2.6", gpu: str | Hardware = "h200", num_gpus: int = 8,
               weights: str | QuantPolicy = "int4", kv: str = "fp8", assumptions: Assumptions | None = None,
               **overrides: Any) -> Deployment:
    """A :class:`Deployment`; keyword ``overrides`` replace fields of ``assumptions`` (default :class:`Assumptions`)."""
    return Deployment(model, gpu, num_gpus, weights, kv, with_overrides(assumptions, overrides))


def plan(model: str = "kimi-k2.6", gpu: str | Hardware = "h200", num_gpus: int = 8,
         weights: str | QuantPolicy = "int4", kv: str = "fp8", *, prompt_len: int | None = None,
         output_len: int | None = None, assumptions: Assumptions | None = None, **overrides: Any) -> dict:
    """Capacity plan as a plain dict (the public contract, see docs/design.md).

    Keys include ``checkpoint_gib``, ``weight_gib_per_device``, ``kv_bytes_per_token``, ``kv_tokens`` (resident
    KV tokens per serving replica), ``fits``, the layout, ``hardware`` and every assumption used
    (``assumptions``). With ``prompt_len`` and ``output_len`` it adds a ``workload`` section: admitted
    concurrency under both admission rules and roofline prefill / decode throughput.
    """
    return deployment(model, gpu, num_gpus, weights, kv, assumptions, **overrides).summary(prompt_len, output_len)

