"""Drawn model shapes for the parity tests: hypothesis strategies that build a tiny transformers config of each
supported architecture with head counts, LoRA ranks, head dims, index dims and heads, hidden and MoE sizes drawn
independently (not one fixed family), so a bug that shows only at some shapes cannot hide behind the fixed variants
of :mod:`tests.parity.hf_models`.

Every strategy returns a ``transformers.PretrainedConfig``; :data:`SETTINGS` fixes the number of examples and
derandomizes them (the same shapes in every run, so CI time is stable); ``PHASESERVE_PARITY_EXAMPLES=N`` draws N
per test instead, and ``PHASESERVE_PARITY_RANDOM=1`` draws a fresh set each run (a longer hunt for shape bugs).
"""

from __future__ import annotations

import os

import transformers as T
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_EXAMPLES = int(os.environ.get("PHASESERVE_PARITY_EXAMPLES", "0"))
_RANDOM = os.environ.get("PHASESERVE_PARITY_RANDOM") == "1"


def parity_settings(examples: int):
    """``examples`` drawn shapes per test (or ``PHASESERVE_PARITY_EXAMPLES``), the same ones every run unless
    ``PHASESERVE_PARITY_RANDOM=1``; no deadline (each example builds and compiles a model)."""
    return settings(max_examples=_EXAMPLES or examples, deadline=None, derandomize=not _RANDOM,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], database=None,
                    print_blob=True)


def _even(lo: int, hi: int):
    """An even integer in [lo, hi] (lo even)."""
    return st.integers(lo // 2, hi // 2).map(lambda x: 2 * x)


@st.composite
def _base(draw, heads_max: int = 6) -> dict:
    heads = draw(st.integers(1, heads_max))
    return dict(vocab_size=draw(st.integers(64, 160)), hidden_size=draw(st.sampled_from([16, 24, 32, 48, 64, 80])),
                intermediate_size=draw(st.integers(8, 96)), num_hidden_layers=draw(st.integers(1, 4)),
                num_attention_heads=heads, max_position_embeddings=512,
                rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])))


@st.composite
def _moe(draw, layers: int) -> dict:
    """DeepSeek-style routed experts: group-limited sigmoid routing with shared experts (at least one: transformers
    writes zero-size tensors for none). Expert widths are multiples of 4: transformers' grouped matmul needs rows of
    16-byte multiples in float32."""
    n_group = draw(st.sampled_from([1, 2, 4]))
    experts = n_group * draw(st.integers(2 if n_group > 1 else 4, 4))
    topk_group = draw(st.integers(1, n_group))
    per_tok = draw(st.integers(1, min(4, topk_group * experts // n_group)))
    return dict(n_routed_experts=experts, num_experts_per_tok=per_tok, n_group=n_group, topk_group=topk_group,
                moe_intermediate_size=4 * draw(st.integers(1, 8)), n_shared_experts=draw(st.integers(1, 2)),
                first_k_dense_replace=draw(st.integers(0, layers)), norm_topk_prob=draw(st.booleans()),
                routed_scaling_factor=draw(st.sampled_from([1.0, 1.5, 2.5])))


@st.composite
def _mla(draw, heads: int, q_lora: bool = True) -> dict:
    return dict(num_key_value_heads=heads, kv_lora_rank=draw(st.integers(4, 40)),
                q_lora_rank=draw(st.integers(4, 48)) if q_lora else None,
                qk_nope_head_dim=draw(_even(2, 32)), qk_rope_head_dim=draw(_even(2, 16)),
                v_head_dim=draw(st.integers(2, 24)))


@st.composite
def glm5(draw, topk_max: int = 20, kv_lora_rank: int | None = None, rope: int | None = None) -> T.GlmMoeDsaConfig:
    """A GLM-5 (``GlmMoeDsaConfig``) with DSA: index dims, heads, top-k and per-layer ``indexer_types`` drawn (the
    first layer always runs its own indexer, as a "shared" layer needs one before it); ``kv_lora_rank`` and ``rope``
    fix the latent's widths (the Pallas sparse MLA kernels take a kv_lora_rank multiple of 128 and a power-of-two
    rope >= 16)."""
    base = draw(_base())
    mla = draw(_mla(base["num_attention_heads"]))
    if kv_lora_rank is not None:
        mla["kv_lora_rank"] = kv_lora_rank
    if rope is not None:
        mla["qk_rope_head_dim"] = rope
    layers = base["num_hidden_layers"]
    types = ["full"] + [draw(st.sampled_from(["full", "shared"])) for _ in range(layers - 1)]
    return T.GlmMoeDsaConfig(**base, **mla, **draw(_moe(layers)),
                             index_head_dim=draw(_even(mla["qk_rope_head_dim"], 48)),
                             index_n_heads=draw(st.integers(1, 8)), index_topk=draw(st.integers(4, topk_max)),
                             indexer_types=types)


@st.composite
def deepseek_v3(draw) -> T.DeepseekV3Config:
    """DeepSeek-V3 / Kimi K2: MLA with or without q LoRA, default or YaRN rope."""
    base = draw(_base())
    yarn = draw(st.booleans())
    factor = draw(st.sampled_from([2.0, 8.0]))
    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
             "original_max_position_embeddings": int(512 / factor), "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
             "mscale_all_dim": draw(st.sampled_from([0.0, 1.0]))} if yarn else None)
    return T.DeepseekV3Config(**base, **draw(_mla(base["num_attention_heads"], q_lora=draw(st.booleans()))),
                              **draw(_moe(base["num_hidden_layers"])), rope_parameters=rope)


@st.composite
def _gqa(draw) -> dict:
    base = draw(_base(heads_max=8))
    heads = base["num_attention_heads"]
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    base["hidden_size"] = heads * draw(st.sampled_from([4, 8, 12, 16]))  # transformers wants hidden % heads == 0
    return dict(base, num_key_value_heads=kv, head_dim=draw(st.sampled_from([4, 8, 12, 16, 24, 32])),
                tie_word_embeddings=draw(st.booleans()))


@st.composite
def llama(draw) -> T.LlamaConfig:
    kw = draw(_gqa())
    if draw(st.booleans()):
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return T.LlamaConfig(**kw)


@st.composite
def qwen3(draw) -> T.Qwen3Config:
    return T.Qwen3Config(**draw(_gqa()))


@st.composite
def qwen3_moe(draw) -> T.Qwen3MoeConfig:
    kw = draw(_gqa())
    layers = kw["num_hidden_layers"]
    experts = draw(st.integers(2, 8))
    return T.Qwen3MoeConfig(**kw, num_experts=experts, num_experts_per_tok=draw(st.integers(1, min(4, experts))),
                            moe_intermediate_size=4 * draw(st.integers(1, 8)), norm_topk_prob=draw(st.booleans()),
                            decoder_sparse_step=draw(st.integers(1, 2)),
                            mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=1)))


@st.composite
def glm4_moe(draw) -> T.Glm4MoeConfig:
    kw = draw(_gqa())
    moe = draw(_moe(kw["num_hidden_layers"]))
    partial = draw(st.sampled_from([0.5, 1.0]))
    return T.Glm4MoeConfig(**kw, **moe, attention_bias=draw(st.booleans()), use_qk_norm=draw(st.booleans()),
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": partial})


ARCHITECTURES = {"llama": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3,
                 "glm4_moe": glm4_moe, "glm_moe_dsa": glm5}
