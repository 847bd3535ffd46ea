"""Planner inputs: typed errors, accelerator specs (with their sources) and the assumptions every plan states.

Units: ``*_gib`` are 2**30 bytes, bandwidths 1e12 B/s, matrix rates 1e12 op/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phaseserve.config import ConfigError


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
    weight_layout: str = "even"  # "even": every non-expert weight split over attn_tp (vLLM's placement, which the
    #   published figures are checked with); "engine": phaseserve's own placement (the logical-axis rules of
    #   phaseserve.kernel_mesh: embeddings, lm_head, the MLA down-projections, norms and routers replicated, a
    #   dimension split only where every stored array allows it), checked against TPU compiles
    #   (benchmarks/tpu_compile)
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




def with_overrides(assumptions: Assumptions | None, overrides: dict[str, Any]) -> Assumptions:
    """``assumptions`` (default :class:`Assumptions`) with fields replaced; unknown names are a PlannerError."""
    base = assumptions or Assumptions()
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Assumptions)}
    if unknown:
        raise PlannerError(f"unknown assumption(s) {sorted(unknown)}; known: "
                           f"{[f.name for f in dataclasses.fields(Assumptions)]}")
    return dataclasses.replace(base, **overrides)
