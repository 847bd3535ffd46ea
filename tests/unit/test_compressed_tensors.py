"""Checkpoints written by the ``compressed-tensors`` library's own compressor load to the library's own values.

A tiny random transformers DeepSeek-V3 gets a compressed-tensors scheme (``apply_quantization_config``), scales
from the library's ``calculate_qparams``, and is compressed and saved by ``ModelCompressor`` (``pack-quantized``
INT4 groups of 32, or ``float-quantized`` FP8 per channel). ``ps.load_checkpoint`` must give every quantized
linear exactly the weights the library's ``decompress_model`` restores, and logits that match transformers
running the decompressed model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor  # in the test extra (pulls only loguru beyond it)
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams

import phaseserve as ps
from phaseserve.qarrays import Fp8Weight, Int4Weight, dequantize
from tests.unit.quant_writers import tiny_deepseek

SCHEMES = {
    "pack-quantized": QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    "float-quantized": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
}


def compressed_checkpoint(fmt: str, directory) -> torch.nn.Module:
    """Save a compressed-tensors checkpoint of a tiny model in ``directory``; returns the model decompressed by
    the library (its weights are what the checkpoint means)."""
    model = tiny_deepseek(seed=1)
    args = SCHEMES[fmt]
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for _, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.data
            w = w.reshape(w.shape[0], -1, args.group_size) if args.group_size else w[:, None, :]
            scale, zp = calculate_qparams(w.amin(-1), w.amax(-1), args)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    compressor.decompress_model(model)
    return model


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_library_written_checkpoint_loads_to_the_library_values(fmt, tmp_path):
    model = compressed_checkpoint(fmt, tmp_path)
    cfg, params = ps.load_checkpoint(tmp_path, "float32")
    kind = Int4Weight if fmt == "pack-quantized" else Fp8Weight
    sd = model.state_dict()
    checked = 0
    for i in range(cfg.num_layers):
        attn, mlp = params.layers[i].attn, params.layers[i].mlp
        pairs = {"self_attn.o_proj": attn.wo, "self_attn.kv_b_proj": attn.wkv_b, "self_attn.q_b_proj": attn.wq_b,
                 "mlp.shared_experts.down_proj" if i else "mlp.down_proj": (mlp.shared.w_down if i else mlp.w_down)}
        for hf_name, leaf in pairs.items():
            assert isinstance(leaf, kind), hf_name
            want = sd[f"model.layers.{i}.{hf_name}.weight"].float().numpy()
            assert np.array_equal(np.asarray(dequantize(leaf, jnp.float32)).T, want), hf_name
            checked += 1
    assert checked == 8
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(ps.forward(params, cfg, jnp.asarray(tokens, jnp.int32)))
    assert np.abs(got - want).max() < 2e-6 * np.abs(want).max()  # measured 8e-7 (int4) and 8e-7 (fp8)
