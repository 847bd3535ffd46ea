"""Tiny random Hugging Face models for parity tests, one builder per architecture variant.

Every parameter (and the router's ``e_score_correction_bias`` buffer) is re-drawn from a seeded generator
so that no weight sits at its trivial initial value (norms at one, biases at zero).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import transformers as T

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, rms_norm_eps=1e-6)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
           q_lora_rank=24, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=2.5)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

VARIANTS = {
    "llama": lambda: T.LlamaConfig(**BASE, num_key_value_heads=2),
    "llama_tied_llama3rope": lambda: T.LlamaConfig(
        **BASE, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3_tied": lambda: T.Qwen3Config(**BASE, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen3_moe_norm": lambda: T.Qwen3MoeConfig(**BASE, **MOE, num_key_value_heads=2, head_dim=8, num_experts=8,
                                               norm_topk_prob=True),
    "qwen3_moe_nonorm_sparse_step": lambda: T.Qwen3MoeConfig(
        **BASE, **MOE, num_key_value_heads=4, head_dim=8, num_experts=4, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=[2]),
    "deepseek_v3_grouped": lambda: T.DeepseekV3Config(**BASE, **MOE, **MLA, n_group=4, topk_group=2),
    "deepseek_v3_yarn_noqlora": lambda: T.DeepseekV3Config(
        **{**BASE, "max_position_embeddings": 256}, **MOE, **{**MLA, "q_lora_rank": None, "norm_topk_prob": False},
        n_group=2, topk_group=1, rope_parameters=YARN),
    "glm4_moe_partial_bias": lambda: T.Glm4MoeConfig(
        **BASE, **MOE, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        first_k_dense_replace=1, attention_bias=True, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "glm4_moe_qknorm": lambda: T.Glm4MoeConfig(
        **BASE, **MOE, num_key_value_heads=4, head_dim=8, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=1, use_qk_norm=True, norm_topk_prob=False),
    "glm_moe_dsa": lambda: T.GlmMoeDsaConfig(**{**BASE, "rms_norm_eps": 1e-5}, **MOE, **MLA, index_head_dim=16,
                                              index_n_heads=2, index_topk=32),
}


def dsa_config(index_topk: int, indexer_types: list[str] | None = None, index_n_heads: int = 16):
    """A tiny GLM-5 (``GlmMoeDsaConfig``) whose DSA indexer selects ``index_topk`` keys per query."""
    return T.GlmMoeDsaConfig(**{**BASE, "rms_norm_eps": 1e-5, "max_position_embeddings": 512}, **MOE, **MLA,
                             index_head_dim=16, index_n_heads=index_n_heads, index_topk=index_topk,
                             indexer_types=indexer_types)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter and router bias: matrices ~ N(0, 1/fan_in), vectors ~ 1 + N(0, 0.1) or N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build(variant: str | T.PretrainedConfig, directory: Path, seed: int = 0, **kw) -> T.PreTrainedModel:
    """Create, randomize and ``save_pretrained`` a tiny model (a variant name or a config); returns it in float32
    eval mode. ``kw`` goes to ``from_config`` (e.g. ``attn_implementation="eager"``)."""
    torch.manual_seed(seed)
    config = VARIANTS[variant]() if isinstance(variant, str) else variant
    model = T.AutoModelForCausalLM.from_config(config, **kw).float().eval()
    randomize_(model, seed)
    model.save_pretrained(directory)
    return model


@contextlib.contextmanager
def dsa_topk(tie_order: bool = True):
    """Within the block, every top-k that transformers' GLM-5 indexers take (``GlmMoeDsaIndexer.forward``'s
    ``Tensor.topk``) is recorded as ``(index scores f32[B, T, S], indices i64[B, T, k])`` in the yielded list, and with
    ``tie_order`` it returns the earliest keys among equal scores, phaseserve's order (``phaseserve.model.indexer``,
    ties), instead of ``torch.topk``'s unspecified one. Other top-k calls (the MoE router's) are left alone."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    calls, depth = [], [0]
    orig_topk, orig_forward = torch.Tensor.topk, m.GlmMoeDsaIndexer.forward

    def topk(self, k, dim=-1, largest=True, sorted=True):
        if not depth[0]:
            return orig_topk(self, k, dim, largest, sorted)
        if tie_order:  # a stable descending sort: equal scores keep their key order (and -0.0 == +0.0)
            values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
            out = torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))
        else:
            out = orig_topk(self, k, dim, largest, sorted)
        calls.append((self.numpy().copy(), out.indices.numpy().copy()))
        return out

    def forward(self, *a, **kw):
        depth[0] += 1
        try:
            return orig_forward(self, *a, **kw)
        finally:
            depth[0] -= 1

    torch.Tensor.topk, m.GlmMoeDsaIndexer.forward = topk, forward
    try:
        yield calls
    finally:
        torch.Tensor.topk, m.GlmMoeDsaIndexer.forward = orig_topk, orig_forward
