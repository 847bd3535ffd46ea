"""Independent writers of the published quantized layouts, for the checkpoint tests (torch, never phaseserve).

Each follows the published algorithm (compressed-tensors' ``pack_to_int32``, DeepSeek-V3's block FP8 with
``weight_scale_inv``), so a layout or packing-order mistake in ``phaseserve.quant`` cannot cancel out.
"""

from __future__ import annotations

import math

import torch
import transformers as T

from phaseserve import presets


def tiny_deepseek(seed: int = 0) -> T.PreTrainedModel:
    """A tiny random transformers DeepSeek-V3 (``presets.TINY["mla-moe"]``: MLA + MoE, dims of 128 and 144, so
    128x128 FP8 blocks are partial at the edges), weights ``randn / sqrt(fan_in)``, float32."""
    hf = {k: v for k, v in presets.TINY["mla-moe"].items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(T.DeepseekV3Config(**hf)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32(value, num_bits=4, packed_dim=1)``: q int8[R, C] in [-8, 7] ->
    int32[R, C/8], q + 8 of column 8j+i at bits 4i of word j."""
    u = (q.to(torch.int32) + 8).reshape(q.shape[0], -1, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=2, dtype=torch.int32)  # as compressed-tensors: int32 wraps, bits are exact


def int4_groups(w: torch.Tensor, group: int, rule: str = "phaseserve") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per group along ``in``: w f32[out, in] -> (q int8[out, in], scale bf16[out, in/G]).
    ``rule="phaseserve"``: scale = amax / 7; ``rule="ct"``: compressed-tensors' observer, amax / 7.5."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / (7.0 if rule == "phaseserve" else 7.5), 1.0).to(torch.bfloat16)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7).to(torch.int8)
    return q.reshape(out_f, in_f), scale


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block FP8: w f32[out, in] -> (f8e4m3[out, in], weight_scale_inv f32[ceil(out/b), ceil(in/b)])."""
    out_f, in_f = w.shape
    po, pi = math.ceil(out_f / block) * block, math.ceil(in_f / block) * block
    padded = torch.nn.functional.pad(w, (0, pi - in_f, 0, po - out_f))
    amax = padded.reshape(po // block, block, pi // block, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, 1.0)
    return (w / expand_blocks(scale, block, out_f, in_f)).to(torch.float8_e4m3fn), scale


def expand_blocks(scale: torch.Tensor, block: int, out_f: int, in_f: int) -> torch.Tensor:
    """Block scales [ceil(out/b), ceil(in/b)] -> one scale per weight f32[out, in]."""
    return scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
