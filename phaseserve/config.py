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
keys each query attends to (:mod:`phaseserve.model.indexer`; while a sequence is no longer than ``index_topk`` it
selects every causal key, so attention is exactly dense attention). ``forward``, ``prefill`` and the engine's
decode (over FP8 index keys cached beside the latent) run it at any length up to :attr:`ModelConfig.context_length`.
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
# The names each enum-like field accepts (checked when its dataclass is built; tests/unit/test_config_choices.py).
ROPE_KINDS = ("default", "yarn", "llama3", "linear")
ATTENTION_KINDS = ("gqa", "mla")
SCORING_FUNCS = ("softmax", "sigmoid")
INDEXER_TYPES = ("full", "shared")
KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")  # what a decode page pool can hold (after alias resolution)
PREFILL_KV_DTYPES = ("float32", "bfloat16")  # what prefill computes KV in
ADMISSIONS = ("reserve", "on_demand")
PREEMPTIONS = ("recompute", "swap")
SERVE_MODES = ("disaggregated", "colocated")
REPLICA_DEVICES = ("blocks", "shared")  # MeshConfig.replica_devices

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

    def __post_init__(self):
        _choice("RopeConfig.kind", self.kind, ROPE_KINDS)


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
    # GLM-5 DSA indexer (phaseserve.model.indexer): each query attends to the index_topk keys it scores highest
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()  # per layer "full" (runs the indexer) | "shared" (reuses the last selection)
    # Token ids
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _choice("ModelConfig.attention", self.attention, ATTENTION_KINDS)
        if self.num_heads % max(self.num_kv_heads, 1):
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.num_experts and self.num_experts % self.n_group:
            raise ConfigError(f"num_experts={self.num_experts} not divisible by n_group={self.n_group}")
        _choice("ModelConfig.scoring_func", self.scoring_func, SCORING_FUNCS)
        if self.index_topk is not None:
            if not self.indexer_types:
                object.__setattr__(self, "indexer_types", ("full",) * self.num_layers)
            types = self.indexer_types
            if len(types) != self.num_layers or set(types) - set(INDEXER_TYPES) or types[0] != "full":
                raise ConfigError(f"indexer_types must give 'full' or 'shared' for each of the {self.num_layers} "
                                  f"layers, the first 'full'; got {list(types)}")

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

    @property
    def context_length(self) -> int:
        """Positions the model can attend over: ``max_position_embeddings``, or ``factor x
        original_max_position_embeddings`` where a RoPE scaling (yarn / linear / llama3) extends the original context
        further (e.g. a Qwen3 config with ``rope_scaling`` added). GLM-5's DSA attention is sparse past ``index_topk``
        keys (prefill and decode), so ``index_topk`` does not limit it."""
        n = self.max_position_embeddings
        r = self.rope
        if r.kind != "default" and r.original_max_position_embeddings and r.factor > 1:
            n = max(n, int(r.factor * r.original_max_position_embeddings))
        return n

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    # ---- Hugging Face -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelConfig:
        """Build a config from a Hugging Face ``config.json`` dict (see module docstring for the list)."""
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
        for name, choices in (("kv_dtype", KV_DTYPES), ("prefill_kv_dtype", PREFILL_KV_DTYPES)):
            _check(isinstance(getattr(self, name), str), f"QuantConfig.{name} must be a dtype name (str)")
            _choice(f"QuantConfig.{name}", DTYPE_ALIASES.get(getattr(self, name), getattr(self, name)), choices)
        _positive_int("QuantConfig.int4_group_size", self.int4_group_size)
        if self.fp8_block is not None:
            _check(len(tuple(self.fp8_block)) == 2, f"QuantConfig.fp8_block must be (rows, cols), got {self.fp8_block}")
            for b in self.fp8_block:
                _positive_int("QuantConfig.fp8_block entry", b)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _positive_int(name: str, v: Any, lo: int = 1) -> None:
    _check(isinstance(v, int | np.integer) and not isinstance(v, bool) and v >= lo,
           f"{name} must be an integer >= {lo}, got {v!r}")


DEFAULT_MAX_PAGES_PER_SEQ = 64  # per-request page cap when neither it nor ServeConfig.max_context is given
DEFAULT_CPU_KV_BYTES = 64 * 2**20  # KV budget when neither num_pages nor kv_budget_bytes is set and there is no
# accelerator memory to take a fraction of (CPU): a fixed, modest 64 MiB


@dataclass(frozen=True)
class CacheConfig:
    """The paged decode cache."""

    page_size: int = 16
    num_pages: int | None = None  # explicit page count (including the reserved null page) ...
    kv_budget_bytes: int | None = None  # ... or a byte budget turned into pages for the chosen KV dtype
    max_pages_per_seq: int | None = None  # pages one request may hold; None: enough for ServeConfig.max_context
    # (DEFAULT_MAX_PAGES_PER_SEQ when that is None too)
    integrity: bool = True  # page-tag check before every decode step
    admission: str = "reserve"  # "reserve" (prompt + max_tokens at admission) | "on_demand" (grow, preempt)
    preemption: str = "recompute"  # on_demand victims: "recompute" (re-prefill) | "swap" (pages to host and back)
    prefix_caching: bool = True  # full prompt pages shared by hash between requests
    retain_prefixes: bool = False  # ... and kept after their requests end until reissued (vLLM's APC); off by
    # default: a detected integrity fault does not yet make the pages it touched unfit for later hits
    memory_fraction: float = 0.9  # no num_pages/kv_budget_bytes: this fraction of the free accelerator memory
    # goes to the KV cache (as vLLM's gpu_memory_utilization); on the CPU, DEFAULT_CPU_KV_BYTES

    def __post_init__(self):
        _positive_int("CacheConfig.page_size", self.page_size)
        if self.num_pages is not None:
            _positive_int("CacheConfig.num_pages", self.num_pages, 2)  # page 0 is the reserved null page
        if self.kv_budget_bytes is not None:
            _positive_int("CacheConfig.kv_budget_bytes", self.kv_budget_bytes)
        if self.max_pages_per_seq is not None:
            _positive_int("CacheConfig.max_pages_per_seq", self.max_pages_per_seq)
        _check(isinstance(self.integrity, bool), f"CacheConfig.integrity must be a bool, got {self.integrity!r}")
        _choice("CacheConfig.admission", self.admission, ADMISSIONS)
        _choice("CacheConfig.preemption", self.preemption, PREEMPTIONS)
        for name in ("prefix_caching", "retain_prefixes"):
            _check(isinstance(getattr(self, name), bool), f"CacheConfig.{name} must be a bool, got "
                                                          f"{getattr(self, name)!r}")
        _check(isinstance(self.memory_fraction, float | int) and 0 < self.memory_fraction <= 1,
               f"CacheConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}")


@dataclass(frozen=True)
class MeshConfig:
    """Device sets. Indices refer to ``jax.devices()``. The defaults fit any machine: ``None`` takes the first
    ``prefill_tp`` devices for prefill and the next ``decode_tp * decode_ep`` for decode (disaggregated; both phases
    share the only device of a one-device machine), or the first ``decode_tp * decode_ep`` (colocated). A set the
    machine does not have is a ``ConfigError`` when the engine is built, naming the device count and how to simulate
    more on a CPU (``phaseserve.sharding``).

    ``replicas``: data-parallel engine replicas (:class:`~phaseserve.engine.replicas.ReplicatedEngine`), each an
    engine of its own over the next consecutive block of devices, laid out as above within its block; explicit
    device indices cannot be combined with it (unless shared, below). A plain :class:`~phaseserve.engine.Engine`
    takes ``replicas=1``.
    ``replica_devices``: ``"blocks"`` (as above) or ``"shared"``: every replica laid out over all the devices as
    one engine would be (explicit indices allowed), the replicas sharing their compiled steps (one executable per
    shape for all) and running at once from their own threads -- for a CPU, whose simulated devices share one pool
    of cores and where each compiled shape holds hundreds of the process's memory maps
    (``phaseserve.engine.compiled``)."""

    prefill_devices: tuple[int, ...] | None = None
    decode_devices: tuple[int, ...] | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    decode_ep: int = 1
    replicas: int = 1
    replica_devices: str = "blocks"  # "blocks" | "shared"

    def __post_init__(self):
        for name in ("prefill_tp", "decode_tp", "decode_ep", "replicas"):
            _positive_int(f"MeshConfig.{name}", getattr(self, name))
        _check(self.replicas == 1 or self.replica_devices == "shared"
               or (self.prefill_devices is None and self.decode_devices is None),
               f"MeshConfig.replicas={self.replicas} lays out each replica's devices itself; leave prefill_devices "
               f"and decode_devices unset (got {self.prefill_devices!r}, {self.decode_devices!r})")
        _check(self.replica_devices in REPLICA_DEVICES,
               f"MeshConfig.replica_devices must be one of {REPLICA_DEVICES}, got {self.replica_devices!r}")
        for name in ("prefill_devices", "decode_devices"):
            ids = getattr(self, name)
            _check(ids is None or (len(ids) > 0 and all(isinstance(i, int | np.integer) and i >= 0 for i in ids)),
                   f"MeshConfig.{name} must be None or a non-empty tuple of device indices >= 0, got {ids!r}")


@dataclass(frozen=True)
class ServeConfig:
    """Everything the engine needs besides the model config and params."""

    mode: str = "disaggregated"  # "disaggregated" | "colocated"
    quant: QuantConfig = field(default_factory=QuantConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    max_batch: int = 32  # concurrency cap (decode rows)
    max_prefill_tokens: int = 2048  # prompt tokens prefilled per engine step (chunked prefill budget)
    max_context: int | None = None  # prompt + output tokens; None: the model's context_length (within the budget)
    seed: int = 0
    overlap_prefill: bool = True  # decode steps run while a launched prefill computes (False: each step waits for it)
    # prompt tokens per prefill launch while requests are decoding (whole prompts unless one alone is longer); None:
    # max_prefill_tokens. Small launches spread the first tokens of a burst of arrivals over the decode steps.
    decoding_prefill_tokens: int | None = 256
    prefill_in_flight: int = 1  # prefill launches queued on the prefill mesh at once (overlap_prefill)
    # the decode worker launches the next step before reading this one's tokens (fed on the device), used when the
    # next step's inputs turn out the same, so the host's work between steps overlaps the device's
    decode_lookahead: bool = True
    # a fresh prompt whose prefix hit leaves one token to compute, or whose whole pages are cached (the last one copied
    # into its own page), runs its last token as a row of the decode step (its KV written and its first output token
    # sampled there, with the decode weights): no prefill launch, prefix copy to the prefill pool or handoff
    decode_hit_suffix: bool = True

    def __post_init__(self):
        _choice("ServeConfig.mode", self.mode, SERVE_MODES)
        for name, typ in (("quant", QuantConfig), ("cache", CacheConfig), ("mesh", MeshConfig)):
            _check(isinstance(getattr(self, name), typ), f"ServeConfig.{name} must be a {typ.__name__}")
        _positive_int("ServeConfig.max_batch", self.max_batch)
        _positive_int("ServeConfig.max_prefill_tokens", self.max_prefill_tokens)
        if self.max_context is not None:
            _positive_int("ServeConfig.max_context", self.max_context, 2)
        c = self.cache
        if c.max_pages_per_seq is None:  # the page cap follows the context asked for, not a small fixed default
            pages = DEFAULT_MAX_PAGES_PER_SEQ if self.max_context is None else -(-self.max_context // c.page_size)
            object.__setattr__(self, "cache", dataclasses.replace(c, max_pages_per_seq=pages))
        elif self.max_context is not None:
            _check(self.max_context <= c.max_pages_per_seq * c.page_size,
                   f"ServeConfig.max_context={self.max_context} needs {-(-self.max_context // c.page_size)} pages per "
                   f"request but CacheConfig.max_pages_per_seq={c.max_pages_per_seq} x page_size={c.page_size} holds "
                   f"{c.max_pages_per_seq * c.page_size} tokens (leave max_pages_per_seq unset to derive it)")
        _positive_int("ServeConfig.seed", self.seed, 0)
        _positive_int("ServeConfig.prefill_in_flight", self.prefill_in_flight)
        if self.decoding_prefill_tokens is not None:
            _positive_int("ServeConfig.decoding_prefill_tokens", self.decoding_prefill_tokens)
        _check(isinstance(self.overlap_prefill, bool), f"ServeConfig.overlap_prefill must be a bool, got "
                                                       f"{self.overlap_prefill!r}")
        _check(isinstance(self.decode_lookahead, bool), f"ServeConfig.decode_lookahead must be a bool, got "
                                                        f"{self.decode_lookahead!r}")
        _check(isinstance(self.decode_hit_suffix, bool), f"ServeConfig.decode_hit_suffix must be a bool, got "
                                                         f"{self.decode_hit_suffix!r}")
        for name in ("prefill_tp", "decode_tp", "decode_ep"):
            if hasattr(self.mesh, name):
                _positive_int(f"MeshConfig.{name}", getattr(self.mesh, name))


# ---- Hugging Face config.json -> ModelConfig ------------------------------------------------------------
# Mapping from Hugging Face ``config.json`` dicts to :class:`phaseserve.config.ModelConfig`.
#
# Supported architectures (``architectures[0]`` or ``model_type``):
#
# ==========================  ==============  =====================================================
# architecture                attention       MLP
# ==========================  ==============  =====================================================
# LlamaForCausalLM            GQA             dense SwiGLU
# Qwen3ForCausalLM            GQA + q/k norm  dense SwiGLU
# Qwen3MoeForCausalLM         GQA + q/k norm  softmax top-k MoE (``decoder_sparse_step``, ``mlp_only_layers``)
# DeepseekV3ForCausalLM       MLA             sigmoid grouped top-k MoE + shared experts (also ``kimi_k2``)
# Glm4MoeForCausalLM          GQA, partial    sigmoid grouped top-k MoE + shared experts
#                             rotary, biases
# GlmMoeDsaForCausalLM        MLA (+ DSA      as DeepSeek-V3; per-layer ``indexer_types`` full/shared
#                             indexer)
# ==========================  ==============  =====================================================
#
# Both the transformers-5 ``rope_parameters`` dict and the hub's older ``rope_theta`` + ``rope_scaling`` keys
# are read. Multimodal wrappers that carry the language model in ``text_config`` (Kimi K2.5/K2.6) are unwrapped.

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
MODEL_TYPES = {"llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "glm_moe_dsa"}
_FAMILY_ARCH = {"kimi_k2": "DeepseekV3ForCausalLM"} | {v: k for k, v in ARCHITECTURES.items()}


def _family(hf: dict) -> tuple[str, str]:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a, ARCHITECTURES[a]
    mt = hf.get("model_type")
    if mt in MODEL_TYPES:
        fam = "deepseek_v3" if mt == "kimi_k2" else mt
        return _FAMILY_ARCH[mt], fam
    raise UnsupportedArchitectureError(
        f"unsupported architecture {archs or None} / model_type {mt!r}; supported: {sorted(ARCHITECTURES)} "
        f"and model_type 'kimi_k2'"
    )


def _rope(hf: dict, family: str) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_KINDS:
        raise ConfigError(f"unsupported rope type {kind!r}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    interleave = family in ("deepseek_v3", "glm_moe_dsa") and hf.get("rope_interleave", True)
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(params.get("factor") or 1.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        partial_rotary_factor=float(partial),
        interleave=bool(interleave),
    )


def _eos(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _qwen_experts(hf: dict) -> int:
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _moe_layers(hf: dict, family: str, n_layers: int) -> tuple[bool, ...]:
    if family == "qwen3_moe":
        step = hf.get("decoder_sparse_step", 1) or 1
        only = set(hf.get("mlp_only_layers") or [])
        n_exp = _qwen_experts(hf)
        return tuple(i not in only and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers))
    if family in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        types = hf.get("mlp_layer_types")
        if types:
            return tuple(t == "sparse" for t in types)
        k = hf.get("first_k_dense_replace", 0)
        freq = hf.get("moe_layer_freq", 1) or 1
        return tuple(i >= k and i % freq == 0 for i in range(n_layers))
    return (False,) * n_layers


def _indexer_types(hf: dict, n_layers: int) -> tuple[str, ...]:
    """GLM-5's per-layer DSA indexer mode, as transformers' ``GlmMoeDsaConfig`` derives it: ``indexer_types``, else
    the ``index_topk_pattern`` ("FSSF..."), else every ``index_topk_freq``-th layer from ``index_skip_topk_offset``;
    a list longer than the layers (a config cut to fewer layers) is cut with them."""
    if hf.get("indexer_types"):
        return tuple(hf["indexer_types"])[:n_layers]
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern[:n_layers]) if isinstance(pattern, str) \
            else tuple(pattern)[:n_layers]
    freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))


def model_config_from_hf(hf: dict) -> ModelConfig:
    """Translate an HF config dict; raises :class:`UnsupportedArchitectureError` for anything else."""
    if "text_config" in hf and not hf.get("hidden_size"):
        inner = dict(hf["text_config"])
        inner.setdefault("architectures", hf.get("architectures"))
        try:
            _family(inner)
        except UnsupportedArchitectureError:
            inner["architectures"] = None
        hf = inner
    arch, family = _family(hf)
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    common = dict(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=n_layers,
        num_heads=n_heads,
        intermediate_size=int(hf.get("intermediate_size", 0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope(hf, family),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf),
        moe_layers=_moe_layers(hf, family, n_layers),
    )
    if family in ("llama", "qwen3", "qwen3_moe", "glm4_moe"):
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // n_heads
        common.update(
            attention="gqa",
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            attention_bias=bool(hf.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm", False)),
        )
    else:
        common.update(
            attention="mla",
            num_kv_heads=n_heads,
            head_dim=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
            attention_bias=bool(hf.get("attention_bias", False)),
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
        )
        if common["attention_bias"]:
            raise ConfigError("attention_bias=True is not supported for MLA models")
    if family == "qwen3_moe":
        common.update(
            num_experts=_qwen_experts(hf),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
            scoring_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    elif family in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        scoring = hf.get("scoring_func", "sigmoid")
        common.update(
            num_experts=int(hf.get("n_routed_experts", 0)),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
            num_shared_experts=int(hf.get("n_shared_experts") or 0),
            scoring_func=scoring,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            use_correction_bias=hf.get("topk_method", "noaux_tc") == "noaux_tc",
        )
    if family == "glm_moe_dsa":
        common.update(
            index_topk=int(hf.get("index_topk", 2048)),
            index_n_heads=int(hf.get("index_n_heads", 32)),
            index_head_dim=int(hf.get("index_head_dim", 128)),
            indexer_types=_indexer_types(hf, n_layers),
        )
    return ModelConfig(**common)
