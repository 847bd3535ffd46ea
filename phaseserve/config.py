"""Configuration dataclasses for phaseserve.

Everything a run is parameterised by lives here as a frozen dataclass:

- ``ModelConfig``: the architecture (GQA or MLA attention, dense or MoE MLP), built from a Hugging Face
  ``config.json`` with :meth:`ModelConfig.from_hf_config`.
- ``QuantConfig``: the weight representation per phase and the KV-cache dtype.
- ``CacheConfig``: the paged decode cache (page size, number of pages or byte budget, integrity, admission and
  preemption policies). With neither ``num_pages`` nor ``kv_budget_bytes`` the engine takes ``memory_fraction``
  of the accelerator's free memory, or :data:`DEFAULT_CPU_KV_BYTES` on the CPU.

Every field is checked when the dataclass is built (types, ranges, known names): a bad value raises
:class:`ConfigError` before anything is allocated.
- ``MeshConfig``: which devices the prefill and decode phases run on.
- ``ServeConfig``: everything the engine needs, composed of the above.

Dtypes are always spelled as strings (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ``"int4"``) and
converted to numpy/JAX dtypes in exactly one place, :func:`to_dtype`.

About GLM-5 (``GlmMoeDsaForCausalLM``): its DeepSeek Sparse Attention indexer picks the ``index_topk``
keys each query attends to. While a sequence is no longer than ``index_topk`` the indexer selects every
causal key, so attention is exactly dense attention; phaseserve runs it that way and refuses longer
sequences with :class:`SequenceTooLongError` until the indexer is implemented. The indexer's weights are
still loaded (they are part of the checkpoint and count in memory plans).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "int8": np.int8,
    "int32": np.int32,
    "uint8": np.uint8,
    "uint32": np.uint32,
}
# Short names accepted wherever a dtype string is (configs, CLI overrides).
DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn",
                 "e4m3": "float8_e4m3fn"}


class ConfigError(ValueError):
    """A configuration value is invalid or unsupported."""


class UnsupportedArchitectureError(ConfigError):
    """The Hugging Face architecture is not one phaseserve implements."""


class SequenceTooLongError(ValueError):
    """An input is longer than the model (or an unimplemented part of it) can handle."""


def canonical_dtype(name: str) -> str:
    """Return the canonical spelling of a dtype name (``"bf16"`` -> ``"bfloat16"``)."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES) + sorted(DTYPE_ALIASES)}")
    return name


def to_dtype(name: str) -> np.dtype:
    """The one place a dtype string becomes a numpy dtype (JAX accepts these directly)."""
    return np.dtype(DTYPES[canonical_dtype(name)])


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (HF ``rope_parameters`` / ``rope_scaling``)."""

    theta: float = 10000.0
    kind: str = "default"  # "default" | "yarn" | "llama3" | "linear"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek): also scales the softmax temperature
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    truncate: bool = True  # yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    partial_rotary_factor: float = 1.0  # fraction of the head dim that is rotated (GLM-4.x: 0.5)
    interleave: bool = False  # rotate (x0,x1),(x2,x3).. pairs (DeepSeek MLA) instead of halves


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only model. Field comments give the HF ``config.json`` key."""

    architecture: str  # HF architectures[0], e.g. "DeepseekV3ForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (GQA); equals num_heads for MLA
    head_dim: int  # GQA head dim; for MLA the qk head dim (nope + rope)
    intermediate_size: int  # dense MLP width
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention: str = "gqa"  # "gqa" | "mla"
    attention_bias: bool = False  # q/k/v biases (GQA, GLM-4.5)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, GLM-4.5 with use_qk_norm)
    # MLA (DeepSeek-V3 / Kimi K2 / GLM-5)
    q_lora_rank: int | None = None  # None: q is a single projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_norm_eps: float = 1e-6  # q_a / kv_a latent norms use 1e-6 regardless of rms_norm_eps (as HF and DeepSeek)
    # MoE
    num_experts: int = 0  # n_routed_experts / num_experts; 0 means a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # n_shared_experts
    scoring_func: str = "softmax"  # "softmax" (Qwen3-MoE) | "sigmoid" (DeepSeek-V3, GLM)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    use_correction_bias: bool = False  # e_score_correction_bias on the router
    moe_layers: tuple[bool, ...] = ()  # per layer: True where the MLP is the MoE block
    # GLM-5 DSA indexer (weights loaded; attention is dense while seq <= index_topk)
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    # Token ids
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.num_heads % max(self.num_kv_heads, 1):
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.num_experts and self.num_experts % self.n_group:
            raise ConfigError(f"num_experts={self.num_experts} not divisible by n_group={self.n_group}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """Number of rotated dimensions per head."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def kv_cache_width(self) -> int:
        """Values cached per token per layer and per KV head (MLA: the single latent kv_lora_rank + rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_cache_heads(self) -> int:
        """Cached heads per layer: MLA caches one latent 'head'; GQA caches K and V for each KV head."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def values_per_token(self) -> int:
        """Cached values per token across all layers (GQA counts K and V)."""
        per_layer = self.kv_cache_width if self.is_mla else 2 * self.num_kv_heads * self.head_dim
        return per_layer * self.num_layers

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    # ---- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelConfig:
        """Build a config from a Hugging Face ``config.json`` dict (see module docstring for the list)."""
        from phaseserve.model.hf_config import model_config_from_hf  # keeps the key mapping in one module

        return model_config_from_hf(hf)


@dataclass(frozen=True)
class QuantConfig:
    """Representations per phase. Weight kinds: "float32", "bfloat16", "fp8", "int4"."""

    prefill_weights: str = "bfloat16"
    decode_weights: str = "bfloat16"
    kv_dtype: str = "bfloat16"  # decode cache storage: "float32" | "bfloat16" | "float8_e4m3fn"
    prefill_kv_dtype: str = "bfloat16"  # dtype prefill computes KV in
    int4_group_size: int = 128
    fp8_block: tuple[int, int] | None = (128, 128)  # None: per-channel scales

    def __post_init__(self):
        for name in ("prefill_weights", "decode_weights"):
            _check(isinstance(getattr(self, name), str) and getattr(self, name) != "",
                   f"QuantConfig.{name} must be a non-empty str, got {getattr(self, name)!r}")
        for name in ("kv_dtype", "prefill_kv_dtype"):
            _check(isinstance(getattr(self, name), str), f"QuantConfig.{name} must be a dtype name (str)")
            canonical_dtype(getattr(self, name))
        _positive_int("QuantConfig.int4_group_size", self.int4_group_size)
        if self.fp8_block is not None:
            _check(len(tuple(self.fp8_block)) == 2, f"QuantConfig.fp8_block must be (rows, cols), got {self.fp8_block}")
            for b in self.fp8_block:
                _positive_int("QuantConfig.fp8_block entry", b)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive_int(name: str, v: Any, lo: int = 1) -> None:
    _check(isinstance(v, int | np.integer) and not isinstance(v, bool) and v >= lo,
           f"{name} must be an integer >= {lo}, got {v!r}")


DEFAULT_CPU_KV_BYTES = 64 * 2**20  # KV budget when neither num_pages nor kv_budget_bytes is set and there is no
# accelerator memory to take a fraction of (CPU): a fixed, modest 64 MiB


@dataclass(frozen=True)
class CacheConfig:
    """The paged decode cache."""

    page_size: int = 16
    num_pages: int | None = None  # explicit page count (including the reserved null page) ...
    kv_budget_bytes: int | None = None  # ... or a byte budget turned into pages for the chosen KV dtype
    max_pages_per_seq: int = 64
    integrity: bool = True  # page-tag check before every decode step
    admission: str = "reserve"  # "reserve" (prompt + max_tokens at admission) | "on_demand" (grow, preempt)
    preemption: str = "recompute"  # on_demand victims: "recompute" (re-prefill) | "swap" (pages to host and back)
    memory_fraction: float = 0.9  # no num_pages/kv_budget_bytes: this fraction of the free accelerator memory
    # goes to the KV cache (as vLLM's gpu_memory_utilization); on the CPU, DEFAULT_CPU_KV_BYTES

    def __post_init__(self):
        _positive_int("CacheConfig.page_size", self.page_size)
        if self.num_pages is not None:
            _positive_int("CacheConfig.num_pages", self.num_pages, 2)  # page 0 is the reserved null page
        if self.kv_budget_bytes is not None:
            _positive_int("CacheConfig.kv_budget_bytes", self.kv_budget_bytes)
        _positive_int("CacheConfig.max_pages_per_seq", self.max_pages_per_seq)
        _check(isinstance(self.integrity, bool), f"CacheConfig.integrity must be a bool, got {self.integrity!r}")
        _check(self.admission in ("reserve", "on_demand"),
               f"CacheConfig.admission must be 'reserve' or 'on_demand', got {self.admission!r}")
        _check(self.preemption in ("recompute", "swap"),
               f"CacheConfig.preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        _check(isinstance(self.memory_fraction, float | int) and 0 < self.memory_fraction <= 1,
               f"CacheConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}")


@dataclass(frozen=True)
class MeshConfig:
    """Device sets. Indices refer to ``jax.devices()``; ``None`` means 'all' (colocated) or 'split in half'."""

    prefill_devices: tuple[int, ...] | None = None
    decode_devices: tuple[int, ...] | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    decode_ep: int = 1


@dataclass(frozen=True)
class ServeConfig:
    """Everything the engine needs besides the model config and params."""

    mode: str = "disaggregated"  # "disaggregated" | "colocated"
    quant: QuantConfig = field(default_factory=QuantConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    max_batch: int = 32  # concurrency cap (decode rows)
    max_prefill_tokens: int = 2048  # tokens per prefill batch
    max_context: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0

    def __post_init__(self):
        _check(self.mode in ("disaggregated", "colocated"),
               f"ServeConfig.mode must be 'disaggregated' or 'colocated', got {self.mode!r}")
        for name, typ in (("quant", QuantConfig), ("cache", CacheConfig), ("mesh", MeshConfig)):
            _check(isinstance(getattr(self, name), typ), f"ServeConfig.{name} must be a {typ.__name__}")
        _positive_int("ServeConfig.max_batch", self.max_batch)
        _positive_int("ServeConfig.max_prefill_tokens", self.max_prefill_tokens)
        if self.max_context is not None:
            _positive_int("ServeConfig.max_context", self.max_context, 2)
        _positive_int("ServeConfig.seed", self.seed, 0)
        for name in ("prefill_tp", "decode_tp", "decode_ep"):
            if hasattr(self.mesh, name):
                _positive_int(f"MeshConfig.{name}", getattr(self.mesh, name))
