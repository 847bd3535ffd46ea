"""Quantized checkpoints served end to end through the documented entry points.

A tiny DeepSeek-V3 (MLA + MoE) is written by test code (torch + safetensors, not phaseserve's writer) in two
published layouts: Kimi-style INT4 pack-quantized routed experts (group 16, bf16 scales, everything else bf16)
and DeepSeek-style FP8 blocks (16x16 blocks, partial at the edges, f32 ``weight_scale_inv``). Each is also
written dequantized (``q * scale`` in float32) for transformers.

- ``ps.load_checkpoint(dir)`` returns the stored representation, and the engine on those params (float32
  weights and KV) generates exactly what transformers' ``generate`` does on the dequantized weights.
- ``python experiments/serve.py checkpoint=dir`` (FP8 prefill, INT4 decode, FP8 KV) serves both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import phaseserve as ps
from phaseserve.config_hydra import load_model
from phaseserve.distributed.protocol import ModelSource
from phaseserve.qarrays import Fp8Weight, Int4Weight
from tests.e2e.engine_utils import hf_greedy, random_requests, serve_config
from tests.parity.hf_models import build
from tests.unit.quant_writers import expand_blocks, fp8_blocks, int4_groups, pack_int32

ROOT = Path(__file__).resolve().parents[2]
_NOT_LINEAR = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")


def int4_layout(name: str, w: torch.Tensor, out: dict, group: int = 16) -> torch.Tensor:
    """Symmetric INT4 groups along ``in`` (scale amax / 7, bf16): writes the three tensors, returns q * scale."""
    q, scale = int4_groups(w, group)
    base = name[: -len(".weight")]
    out[base + ".weight_packed"], out[base + ".weight_scale"] = pack_int32(q), scale
    out[base + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
    return q.float() * scale.float().repeat_interleave(group, 1)


def fp8_layout(name: str, w: torch.Tensor, out: dict, block: int = 16) -> torch.Tensor:
    """DeepSeek block FP8 (amax / 448 per block, partial edge blocks): writes weight + scale_inv, returns q * s."""
    q, s = fp8_blocks(w, block)
    out[name], out[name + "_scale_inv"] = q, s
    return q.float() * expand_blocks(s, block, *w.shape)


LAYOUTS = {
    "int4": (lambda n: ".mlp.experts." in n, int4_layout, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}}}}),
    "fp8": (lambda n: n.endswith(".weight") and not any(s in n for s in _NOT_LINEAR), fp8_layout, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, T.PreTrainedModel]]:
    """layout -> (quantized checkpoint dir, transformers model with the dequantized weights)."""
    root = tmp_path_factory.mktemp("quantized")
    build("deepseek_v3_grouped", root / "float", seed=3)
    src = load_file(str(root / "float" / "model.safetensors"))
    out = {}
    for layout, (picked, write, qcfg) in LAYOUTS.items():
        stored, dequant = {}, {}
        for n, t in src.items():
            if t.ndim == 2 and picked(n):
                dequant[n] = write(n, t.float(), stored)
            else:
                stored[n] = t.to(torch.bfloat16) if t.is_floating_point() and "correction" not in n else t
                dequant[n] = stored[n].float() if t.is_floating_point() else t
        for d, tensors, q in ((root / layout, stored, qcfg), (root / f"{layout}-dequant", dequant, None)):
            shutil.copytree(root / "float", d, ignore=shutil.ignore_patterns("*.safetensors"))
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": q} if q else {})}))
            save_file(tensors, str(d / "model.safetensors"))
        out[layout] = (root / layout, T.AutoModelForCausalLM.from_pretrained(root / f"{layout}-dequant",
                                                                              dtype=torch.float32).eval())
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_checkpoint_serves_the_stored_weights(checkpoints, layout):
    d, hf = checkpoints[layout]
    cfg, params = ps.load_checkpoint(d)
    if layout == "int4":
        assert isinstance(params.layers[1].mlp.w_down, Int4Weight) and params.layers[1].mlp.w_down.group_size == 16
    else:
        assert isinstance(params.layers[1].attn.wkv_b, Fp8Weight) and params.layers[1].attn.wkv_b.block == (16, 16)
    reqs = random_requests(cfg.vocab_size, 4, seed=5)
    outs = ps.Engine(cfg, params, serve_config(max_batch=2)).generate(reqs)
    for r, o in zip(reqs, outs, strict=True):
        assert o.finish_reason == "length", (r.id, o.error)
        assert o.tokens == hf_greedy(hf, r), r.id


def test_every_entry_point_uses_the_one_loader(checkpoints):
    """Hydra configs (``model.checkpoint``, what ``Engine.from_hydra`` and the bench experiments load) and the
    serving processes' :class:`ModelSource` return the checkpoint's own INT4 words, as ``ps.load_checkpoint`` does."""
    d = checkpoints["int4"][0]
    _, direct = ps.load_checkpoint(d)
    _, hydra = load_model(OmegaConf.create({"model": {"name": "int4", "checkpoint": str(d), "preset": None,
                                                      "hf": None, "overrides": {}, "dtype": "float32"}}))
    _, served = ModelSource(checkpoint=str(d)).load()
    for params in (hydra, served):
        w = params.layers[2].mlp.w_gate
        assert isinstance(w, Int4Weight) and np.array_equal(np.asarray(w.packed),
                                                            np.asarray(direct.layers[2].mlp.w_gate.packed))


def test_serve_py_serves_int4_and_fp8_checkpoints(checkpoints, tmp_path):
    """One Hydra multirun of the main job over both checkpoints (FP8 prefill, INT4 g16 decode, FP8 KV)."""
    dirs = ",".join(str(checkpoints[k][0]) for k in LAYOUTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "serve.py"), "-m", f"checkpoint={dirs}",
                          "max_tokens=5", "quant.int4_group_size=16", f"hydra.sweep.dir={tmp_path}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    generated = re.findall(r"generated: \[([\d, ]+)\] \((\w+)\)", run.stdout)
    assert len(generated) == 2, run.stdout[-3000:]  # one measured run per checkpoint (the compile run is silent)
    assert all(len(toks.split(",")) == 5 and why == "length" for toks, why in generated), generated
