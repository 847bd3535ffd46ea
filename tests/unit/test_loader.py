"""Loader and config errors: missing, unexpected and mis-shaped tensors, unknown architectures; HF config
mapping details (kimi_k2 model_type, text_config wrappers, hub-style rope_scaling)."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import phaseserve as ps
from phaseserve.model.params import abstract_params, param_count
from tests.parity.hf_models import build


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv3")
    build("deepseek_v3_grouped", d)
    return d


def _edit(src, dst, fn):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_loads_and_matches_abstract_tree(ckpt):
    cfg, params = ps.load_checkpoint(ckpt)
    n_hf = sum(v.size for v in load_file(ckpt / "model.safetensors").values())
    assert param_count(params) == param_count(abstract_params(cfg)) == n_hf
    for leaf in jax.tree.leaves(params):
        assert np.isfinite(np.asarray(leaf, np.float32)).all()


def test_missing_tensor_is_named(ckpt, tmp_path):
    d = _edit(ckpt, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ps.MissingTensorError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        ps.load_checkpoint(d)


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    d = _edit(ckpt, tmp_path / "u", lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.ones((3, 3),
                                                                                                         np.float32)}))
    with pytest.raises(ps.UnexpectedTensorError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        ps.load_checkpoint(d)


def test_mtp_layers_beyond_num_layers_are_ignored(ckpt, tmp_path):
    d = _edit(ckpt, tmp_path / "mtp", lambda t: t.update({"model.layers.3.eh_proj.weight": np.ones((2, 2),
                                                                                                  np.float32)}))
    cfg, _ = ps.load_checkpoint(d)
    assert cfg.num_layers == 3


def test_shape_mismatch_is_named(ckpt, tmp_path):
    def shrink(t):
        t["model.layers.2.self_attn.kv_b_proj.weight"] = t["model.layers.2.self_attn.kv_b_proj.weight"][:-1]

    d = _edit(ckpt, tmp_path / "s", shrink)
    with pytest.raises(ps.ShapeMismatchError, match=r"kv_b_proj\.weight.*shape"):
        ps.load_checkpoint(d)


def test_unknown_architecture(ckpt, tmp_path):
    shutil.copytree(ckpt, tmp_path / "a")
    hf = json.loads((tmp_path / "a" / "config.json").read_text())
    hf.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (tmp_path / "a" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ps.UnsupportedArchitectureError, match="MambaForCausalLM"):
        ps.load_checkpoint(tmp_path / "a")


def test_missing_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                                      "hidden_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 2, "intermediate_size": 8}))
    with pytest.raises(ps.CheckpointError, match="safetensors"):
        ps.load_checkpoint(tmp_path)


def test_sharded_checkpoint(ckpt, tmp_path):
    """A hub-style sharded checkpoint (index.json + several files) loads to the same params."""
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(ckpt / "config.json", d / "config.json")
    weight_map = {}
    for i, chunk in enumerate([names[: len(names) // 2], names[len(names) // 2:]]):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in chunk}, d / fname)
        weight_map.update({k: fname for k in chunk})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, a = ps.load_checkpoint(ckpt)
    _, b = ps.load_checkpoint(d)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_kimi_k2_model_type_and_text_config_wrapper(ckpt):
    hf = json.loads((ckpt / "config.json").read_text())
    kimi = {**hf, "architectures": None, "model_type": "kimi_k2"}
    assert ps.ModelConfig.from_hf_config(kimi).architecture == "DeepseekV3ForCausalLM"
    wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": {**hf, "architectures": None, "model_type": "kimi_k2"}}
    a, b = ps.ModelConfig.from_hf_config(wrapped), ps.ModelConfig.from_hf_config(hf)
    assert a == b


def test_hub_style_rope_scaling_is_read():
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
          "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": None, "rope_theta": 50000.0,
          "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                           "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    cfg = ps.ModelConfig.from_hf_config(hf)
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.theta, cfg.rope.beta_fast) == ("yarn", 32.0, 50000.0, 1.0)
    assert cfg.rope.original_max_position_embeddings == 4096 and cfg.rope.interleave


def test_bad_dtype_name():
    with pytest.raises(ps.ConfigError, match="unknown dtype"):
        ps.load_checkpoint("/nonexistent", dtype="float7")
