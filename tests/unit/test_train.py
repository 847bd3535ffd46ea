"""The training pipeline of the default model: the training forward equals ``ps.forward``, capacity dispatch
drops exactly the overflow, balancing moves biases the right way, the HF export round-trips through
``ps.load_checkpoint``, and a resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import phaseserve as ps
from lab import train as T
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.model.moe import capacity_experts, dense_experts, route

TINY = T.ModelShape(hidden_size=32, num_layers=2, first_k_dense=1, num_heads=2, intermediate_size=48,
                    moe_intermediate_size=16, num_experts=4, experts_per_tok=2, shared_experts=1, q_lora_rank=16,
                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                    max_position_embeddings=256)


@pytest.fixture
def key():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    return jax.random.key(seed)


def test_hf_config_round_trips_through_model_config():
    cfg = T.model_config(T.ModelShape())
    assert cfg.is_mla and cfg.is_moe and cfg.moe_layers == (False, True, True, True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_shared_experts) == (8, 2, 1)
    assert cfg.scoring_func == "sigmoid" and cfg.use_correction_bias and cfg.rope.interleave
    assert cfg.vocab_size == 264 and cfg.eos_token_ids == (257,) and cfg.bos_token_id == 256


@pytest.mark.parametrize("capacity", [None, "no-overflow"])
def test_train_forward_equals_forward(key, capacity):
    cfg = T.model_config(TINY)
    params = ps.init_params(cfg, key)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (2, 24), 0, 264)
    factor = None if capacity is None else cfg.num_experts / cfg.num_experts_per_tok
    logits, aux = jax.jit(T.train_forward, static_argnums=(1, 3))(params, cfg, tokens, factor)
    np.testing.assert_allclose(logits, jax.jit(ps.forward, static_argnums=1)(params, cfg, tokens), atol=2e-5,
                               rtol=2e-5)
    assert aux["load"].shape == (1, 4) and float(aux["dropped"].sum()) == 0.0
    np.testing.assert_allclose(aux["load"].sum(-1), 1.0, rtol=1e-6)


def test_capacity_drops_exactly_the_overflow(key):
    cfg = T.model_config(TINY)
    params = ps.init_params(cfg, key)
    moe = params.layers[1].mlp
    x = jax.random.normal(jax.random.fold_in(key, 2), (40, cfg.hidden_size))
    w, idx = route(moe.replace(correction_bias=jnp.array([50.0, 50.0, 0.0, 0.0])), cfg, x)
    assert set(np.unique(idx).tolist()) == {0, 1}  # every token chose experts 0 and 1
    out, dropped = capacity_experts(moe, cfg, x, w, idx, factor=1.0)
    cap = int(np.ceil(1.0 * 40 * 2 / 4))  # 20 of each expert's 40 assignments fit
    assert float(dropped) == pytest.approx(1 - cap / 40)
    kept = np.arange(40) < cap  # in token order
    ref, _ = dense_experts(moe, cfg, x, w * kept[:, None], idx)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_bias_update_moves_against_load(key):
    cfg = T.model_config(TINY)
    params = ps.init_params(cfg, key)
    before = np.asarray(params.layers[1].mlp.correction_bias)
    load = jnp.array([[0.5, 0.3, 0.1, 0.1]])
    after = np.asarray(T.update_correction_bias(params, load, 0.01).layers[1].mlp.correction_bias)
    np.testing.assert_allclose(after - before, [-0.01, -0.01, 0.01, 0.01], atol=1e-7)


def test_export_round_trips_through_loader(tmp_path, key):
    cfg = T.model_config(TINY)
    params = T.init_train_params(cfg, key)
    params = jax.tree.map(lambda a: a + 0.01 * jax.random.normal(jax.random.fold_in(key, 3), a.shape), params)
    T.export_hf(params, TINY, tmp_path, "bfloat16")
    cfg2, loaded = ps.load_checkpoint(tmp_path)
    assert cfg2 == cfg
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded)
    for (path, a), b in zip(flat_a, flat_b, strict=True):
        keep_f32 = "router" in str(path) or "correction_bias" in str(path)
        expect = np.asarray(a) if keep_f32 else np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(b), expect, err_msg=str(path))
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["first_k_dense_replace"] == 1
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<eos>"
    assert ByteTokenizer.load(tmp_path).eos_id == 257


def _tiny_run(tmp_path, name: str, ckpt: str, **kw) -> T.TrainConfig:
    """A 4-step run whose curriculum changes shape and mix at step 3 (2x32 single requests, then 1x64 basic)."""
    curriculum = [T.Phase(0, 32, 2, 0.5, "single"), T.Phase(2, 64, 1, 1.0, "basic")]
    base = dict(model=TINY, steps=4, batch_size=2, seq_len=32, warmup_steps=1, log_every=1, eval_every=2,
                ckpt_every=2, ckpt_dir=str(tmp_path / ckpt), seed=3, export_dir=str(tmp_path / name / "model"),
                results_dir=str(tmp_path / name), final_tool_eval=0, curriculum=curriculum, answer_weight=2.0,
                prompt_weight=0.25)
    return T.TrainConfig(**{**base, **kw})


class _Interrupt(Exception):
    pass


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    """Interrupt a 4-step run during step 3 (last checkpoint: step 2, the curriculum's phase boundary), resume:
    same weights as one go."""
    def crash_at_3(line):
        if line.startswith("step     3"):
            raise _Interrupt

    with pytest.raises(_Interrupt):
        T.fit(_tiny_run(tmp_path, "a", "ck_a"), log=crash_at_3)
    lines = []
    a, hist = T.fit(_tiny_run(tmp_path, "a", "ck_a"), log=lines.append)
    assert any("resumed from step 2" in line for line in lines)
    b, _ = T.fit(_tiny_run(tmp_path, "b", "ck_b"), log=lambda s: None)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [h["step"] for h in hist["train"]] == [1, 2, 3, 4]
    assert [h["step"] for h in hist["eval"]] == [2, 4]


def test_curriculum_batches_and_stop_after(tmp_path):
    c = _tiny_run(tmp_path, "c", "ck_c")
    plan = T.phases(c)
    assert [T.batch_at(plan, s)[0].shape for s in (0, 1, 2, 3)] == [(2, 33), (2, 33), (1, 65), (1, 65)]
    np.testing.assert_array_equal(T.batch_at(plan, 3)[0], T.batch_at(T.phases(c), 3)[0])
    with pytest.raises(ValueError, match="increase"):
        T.phases(T.TrainConfig(curriculum=[T.Phase(0), T.Phase(0)]))
    _, hist = T.fit(_tiny_run(tmp_path, "c", "ck_c", stop_after=3), log=lambda s: None)
    assert hist["train"][-1]["step"] == 3 and hist["eval"][-1]["step"] == 3
    lines = []
    _, hist = T.fit(_tiny_run(tmp_path, "c", "ck_c", stop_after=3), log=lines.append)  # nothing left to run
    assert any("resumed from step 3" in line for line in lines) and hist["train"][-1]["step"] == 3


def test_a_phase_with_lr_starts_a_new_cycle_and_keeps_the_earlier_schedule():
    """Appending a phase that sets lr (and raising steps) leaves the schedule of the earlier steps as it was."""
    before = T.TrainConfig(steps=100, lr=3e-3, warmup_steps=10, curriculum=[T.Phase(0), T.Phase(60)])
    after = T.TrainConfig(steps=160, lr=3e-3, warmup_steps=10,
                          curriculum=[T.Phase(0), T.Phase(60), T.Phase(100, lr=1e-3)])
    old, new = T.lr_schedule(before), T.lr_schedule(after)
    assert T.lr_cycles(after) == [(0, 100, 3e-3), (100, 160, 1e-3)]
    np.testing.assert_array_equal([float(old(s)) for s in range(100)], [float(new(s)) for s in range(100)])
    assert 3e-4 < float(new(99)) < 3.01e-4  # the first cycle's last step: just above its floor lr * 0.1
    assert float(new(100)) == 0.0 and float(new(110)) == pytest.approx(1e-3)  # warmup to the new peak
    assert float(new(160)) == pytest.approx(1e-4, rel=1e-3) and float(new(130)) < 1e-3
    with pytest.raises(ValueError, match="step 0"):
        T.lr_cycles(T.TrainConfig(curriculum=[T.Phase(0, lr=1e-3)]))
    with pytest.raises(ValueError, match="longer than warmup"):
        T.lr_cycles(T.TrainConfig(steps=105, warmup_steps=10, curriculum=[T.Phase(0), T.Phase(100, lr=1e-3)]))


def test_a_run_continued_with_a_new_cycle_equals_a_fresh_run_of_the_longer_plan(tmp_path):
    """Train 4 steps, then append a phase with its own lr and resume to 6: bit-identical to 6 steps in one go."""
    longer = dict(steps=6, curriculum=[T.Phase(0, 32, 2, 0.5, "single"), T.Phase(2, 64, 1, 1.0, "basic"),
                                       T.Phase(4, 32, 2, 1.0, "single", lr=1e-3)])
    T.fit(_tiny_run(tmp_path, "a", "ck_a"), log=lambda s: None)
    lines = []
    a, hist = T.fit(_tiny_run(tmp_path, "a", "ck_a", **longer), log=lines.append)
    assert any("resumed from step 4" in line for line in lines) and hist["train"][-1]["step"] == 6
    b, _ = T.fit(_tiny_run(tmp_path, "b", "ck_b", **longer), log=lambda s: None)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eval_history_reports_generated_tool_calls(tmp_path):
    """With eval_tool_calls, every eval generates held-out calls: exact match, validity, argument accuracy."""
    _, hist = T.fit(_tiny_run(tmp_path, "g", "ck_g", eval_tool_calls=4, eval_max_tokens=32, steps=2),
                    log=lambda s: None)
    ev = hist["eval"][-1]
    for k in ("tool_exact", "tool_validity", "tool_args", "heldout_text_loss", "heldout_tool_loss"):
        assert 0.0 <= ev[k] and np.isfinite(ev[k]), k
    assert ev["tool_exact"] <= ev["tool_validity"] and ev["tool_exact"] <= ev["tool_args"] <= 1.0
    assert any(k.startswith("tool_exact_") for k in ev)


def test_finish_writes_checkpoint_results_and_plot(tmp_path, key):
    c = _tiny_run(tmp_path, "r", "ck")
    params = T.init_train_params(T.model_config(TINY), key)
    history = {"train": [{"step": i, "loss": 5.0 - i} for i in (1, 2)],
               "eval": [{"step": 2, "heldout_text_loss": 4.0, "heldout_tool_loss": 3.0}], "wall_s": 1.0}
    res = T.finish(c, params, history, log=lambda s: None)
    assert res["heldout_text"]["ppl"] > 100  # untrained: close to uniform over 264 ids
    assert json.loads((tmp_path / "r" / "results.json").read_text())["parameters"] == res["parameters"]
    assert (tmp_path / "r" / "loss_curve.png").stat().st_size > 1000
    assert ps.load_checkpoint(tmp_path / "r" / "model")[0] == T.model_config(TINY)
    readme = (tmp_path / "r" / "README.md").read_text()
    assert f"perplexity {res['heldout_text']['ppl']:.2f}" in readme and "| 2 | 4.000 | 3.000 |" in readme


def test_progress_snapshot_of_a_run_in_progress(tmp_path):
    """progress_only writes the checkpointed history, the curve and a table ending at the last eval; trains nothing."""
    _, hist = T.fit(_tiny_run(tmp_path, "p", "ck_p", stop_after=2), log=lambda s: None)
    c = _tiny_run(tmp_path, "snap", "ck_p", progress_only=True)
    out = T.train(c, log=lambda s: None)
    assert out["step"] == 2 and out["eval"] == hist["eval"][-1]
    md = (tmp_path / "snap" / "README.md").read_text()
    last = hist["eval"][-1]
    assert f"| 2 | {last['heldout_text_loss']:.3f} | {last['heldout_tool_loss']:.3f} |" in md
    assert "step 2 of 4" in md
    assert json.loads((tmp_path / "snap" / "history.json").read_text())["eval"] == hist["eval"]
    assert (tmp_path / "snap" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "snap" / "model").exists()  # nothing exported
