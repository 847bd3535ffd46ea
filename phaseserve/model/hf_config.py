"""Mapping from Hugging Face ``config.json`` dicts to :class:`phaseserve.config.ModelConfig`.

Supported architectures (``architectures[0]`` or ``model_type``):

==========================  ==============  =====================================================
architecture                attention       MLP
==========================  ==============  =====================================================
LlamaForCausalLM            GQA             dense SwiGLU
Qwen3ForCausalLM            GQA + q/k norm  dense SwiGLU
Qwen3MoeForCausalLM         GQA + q/k norm  softmax top-k MoE (``decoder_sparse_step``, ``mlp_only_layers``)
DeepseekV3ForCausalLM       MLA             sigmoid grouped top-k MoE + shared experts (also ``kimi_k2``)
Glm4MoeForCausalLM          GQA, partial    sigmoid grouped top-k MoE + shared experts
                            rotary, biases
GlmMoeDsaForCausalLM        MLA (+ DSA      as DeepSeek-V3; dense attention while seq <= ``index_topk``
                            indexer)
==========================  ==============  =====================================================

Both the transformers-5 ``rope_parameters`` dict and the hub's older ``rope_theta`` + ``rope_scaling`` keys
are read. Multimodal wrappers that carry the language model in ``text_config`` (Kimi K2.5/K2.6) are unwrapped.
"""

from __future__ import annotations

from phaseserve.config import ConfigError, ModelConfig, RopeConfig, UnsupportedArchitectureError

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
    if kind not in ("default", "yarn", "llama3", "linear"):
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
        )
    return ModelConfig(**common)
