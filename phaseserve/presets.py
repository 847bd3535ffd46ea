"""Real model shapes as their public ``config.json`` values (plain dicts ``ModelConfig.from_hf_config`` accepts),
and the published checkpoint sizes the size report and the planner are checked against.

Nothing here is downloaded: the dicts are transcribed (abridged to the keys phaseserve reads, plus
``num_nextn_predict_layers``, which counts the multi-token-prediction layers a checkpoint ships beyond
``num_hidden_layers``). Sources, as found through public pages and code (the search tool of this project):

- ``kimi-k2.6``: moonshotai/Kimi-K2.6 ``config.json`` (``KimiK25ForConditionalGeneration``; the language model
  in ``text_config``, ``model_type: kimi_k2``), values as bound by a public Kimi-K2.6 adapter that validates
  the official file (revision 7eb5002f): hidden 7168, 61 layers (first dense), 384 routed experts + 1 shared,
  top-8, MLA q_lora 1536 / kv_lora 512, nope 128 / rope 64 / v 128, routed_scaling 2.827, rms eps 1e-5,
  rope_theta 50000 with YaRN x64 from 4096, vocab 163840, 262144 positions; int4 ``pack-quantized`` group 32,
  symmetric (compressed-tensors), routed experts only. The vision tower (MoonViT, ~0.4B) is not modelled.
- ``glm-5``: zai-org/GLM-5 ``config.json`` as mirrored by xLLM's ``glm5.h`` (example config link) and the
  transformers ``GlmMoeDsaConfig`` defaults: 78 layers (3 dense), hidden 6144, 64 heads, q_lora 2048,
  kv_lora 512, nope 192 / rope 64 / v 256, 256 experts + 1 shared, top-8, moe 2048, dense 12288, vocab 154880,
  DSA indexer 32 heads x 128, index_topk 2048, 1 MTP layer, rope_theta 1e6, rms eps 1e-5.
- ``glm-4.5``: zai-org/GLM-4.5 ``config.json`` (``Glm4MoeForCausalLM``): 92 layers (3 dense), hidden 5120,
  96 heads / 8 KV heads x 128, partial rotary 0.5, qkv bias, qk-norm, 160 experts + 1 shared, top-8, moe 1536.
- ``deepseek-v3``: deepseek-ai/DeepSeek-V3 ``config.json`` (and transformers ``DeepseekV3Config`` defaults).
- ``qwen3-30b-a3b``: Qwen/Qwen3-30B-A3B ``config.json``.
- ``moonlight-16b-a3b``: moonshotai/Moonlight-16B-A3B ``config.json`` (Kimi's architecture at one-GPU size).

The published checkpoint sizes these shapes are checked against (:data:`lab.planner.published.PUBLISHED`) and
their registry (:mod:`lab.figures`) live in the lab package, beside the reports that read them.
"""

from __future__ import annotations

import copy

from phaseserve.config import ModelConfig

_KIMI_TEXT = {
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "bos_token_id": 163584, "eos_token_id": 163586,
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    },
}

PRESETS: dict[str, dict] = {
    "kimi-k2.6": {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "text_config": _KIMI_TEXT},
    "glm-5": {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,
        "max_position_embeddings": 202752, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": [154820, 154827, 154829],
    },
    "glm-4.5": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
        "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1, "eos_token_id": [151329, 151336, 151338],
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 163840, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "moonlight-16b-a3b": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "bos_token_id": 163584, "eos_token_id": 163586,
    },
}

# Tiny shapes of the same families for CPU tests (every matmul input dim a multiple of 128, so INT4 groups of
# 32 and 128 and FP8 blocks of 128 all apply; several FP8 blocks per matrix where dims exceed 128).
TINY: dict[str, dict] = {
    "mla-moe": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "gqa-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [0], "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
}

# How each family's checkpoint stores its MTP layer(s): DeepSeek-V3 repeats embed_tokens and the output head
# inside the MTP layer (685B = 671B + 14B); GLM's MTP layer shares them (GLM-5-FP8's 753.9B = 744B + one
# layer + eh_proj + fp8 scales).
MTP_EMBEDDING_COPIES: dict[str, bool] = {"deepseek-v3": True, "glm-5": False, "glm-4.5": False}


def preset(name: str) -> dict:
    """A deep copy of the preset's config.json dict (``"tiny-<name>"`` selects a :data:`TINY` shape)."""
    key = name.lower()
    if key.startswith("tiny-") and key[5:] in TINY:
        return copy.deepcopy(TINY[key[5:]])
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)} and tiny-{sorted(TINY)}")
    return copy.deepcopy(PRESETS[key])


def text_config(name: str) -> dict:
    """The language-model part of a preset (unwraps Kimi K2.5/K2.6's ``text_config``)."""
    hf = preset(name)
    return hf.get("text_config", hf)


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(preset(name))


def mtp_layers(name: str) -> int:
    return int(text_config(name).get("num_nextn_predict_layers") or 0)
