"""Training the default model: a small DeepSeek-V3-architecture model (MLA attention, sigmoid-routed MoE with a
shared expert and a dense first layer) on the byte-level mixture of :mod:`phaseserve.data`.

- :class:`TrainConfig` / :class:`ModelShape` — every knob (Hydra's ``configs/train.yaml`` mirrors them);
- :func:`hf_config` — the Hugging Face ``config.json`` dict of the model; ``ModelConfig.from_hf_config`` of it is
  the config trained, so the exported checkpoint describes exactly what was trained;
- :func:`train_forward` — the model's own forward (``transformer.forward_with_moe_stats``) with an expert dispatch
  that trains fast on a CPU (where ``ragged_dot`` is slow, see ``model.moe``): capacity-limited expert buffers
  (factor 2: an assignment is dropped only when its expert gets more than twice its share of the batch), or
  every expert densely (exact); it also returns each MoE layer's expert load and dropped fraction;
- auxiliary-loss-free balancing (DeepSeek-V3): after each step every MoE layer's ``e_score_correction_bias``
  moves by ``bias_update_rate`` against the sign of its experts' over-/under-load (it gets no gradient);
- :func:`train` — AdamW with linear warmup and cosine decay, orbax checkpoints every ``ckpt_every`` steps
  (resumable: batch ``s`` depends only on ``(seed, s)``), held-out evaluation every ``eval_every`` steps;
- :func:`export_hf` — the HF-format directory (config.json, model.safetensors in the hub's DeepSeek-V3
  tensor naming, tokenizer.json) that ``ps.load_checkpoint`` and transformers read.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lab.data.corpus import Mixture, eval_windows
from phaseserve.config import ModelConfig, to_dtype
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import MAX_PROMPT_TOKENS, examples
from phaseserve.model.loader import hf_sources, leaf_path
from phaseserve.model.moe import capacity_experts, dense_experts
from phaseserve.model.params import MoEParams, Params, abstract_params, is_info
from phaseserve.model.transformer import forward, forward_with_moe_stats


@dataclass
class ModelShape:
    """Architecture of the default model (HF DeepSeek-V3 config keys in comments)."""

    hidden_size: int = 256
    num_layers: int = 4  # num_hidden_layers
    first_k_dense: int = 1  # first_k_dense_replace: leading layers with a dense MLP
    num_heads: int = 4
    intermediate_size: int = 768  # dense MLP width
    moe_intermediate_size: int = 128  # per routed / shared expert
    num_experts: int = 8  # n_routed_experts
    experts_per_tok: int = 2  # num_experts_per_tok
    shared_experts: int = 1  # n_shared_experts
    routed_scaling_factor: float = 1.0
    q_lora_rank: int | None = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


@dataclass
class Phase:
    """One stretch of the curriculum: from step ``from_step`` until the next phase, batches of this shape and mix."""

    from_step: int = 0
    seq_len: int = 256
    batch_size: int = 12
    tool_fraction: float = 0.5  # share of batch rows that are packed tool-call examples
    tool_mix: str = "single"  # phaseserve.data.toolcalls.MIXES ("full" holds multi-turn prompts of ~600-840 tokens)
    lr: float | None = None  # set: a new warmup + cosine cycle to this peak starts here (see lr_schedule)


@dataclass
class TrainConfig:
    """One training run. Paths are relative to the working directory (the repository root)."""

    model: ModelShape = field(default_factory=ModelShape)
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    tool_fraction: float = 0.3  # share of batch rows that are packed tool-call examples
    tool_mix: str = "basic"  # phaseserve.data.toolcalls.MIXES
    curriculum: list[Phase] = field(default_factory=list)  # empty: batch_size x seq_len throughout
    answer_weight: float = 1.0  # loss weight of answer tokens (<tool_call> .. <eos>) in tool rows
    prompt_weight: float = 1.0  # loss weight of request tokens in tool rows (text rows: 1)
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1  # on matrices only
    b2: float = 0.95
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-2  # DeepSeek-V3's gamma for e_score_correction_bias (1e-3 there, over far more steps)
    capacity_factor: float | None = 2.0  # training-time expert capacity (None: all experts densely, exact)
    log_every: int = 10
    eval_every: int = 100
    ckpt_every: int = 100
    ckpt_dir: str = "outputs/train_ckpt"
    resume: bool = True
    export_dir: str = "models/default"
    export_dtype: str = "bfloat16"  # matrices; routers and correction biases stay float32
    results_dir: str = "benchmarks/training"
    final_tool_eval: int = 200  # held-out requests generated at the end (0: skip)
    eval_tool_calls: int = 0  # held-out requests generated at every eval (a quarter multi-turn when they fit)
    eval_max_tokens: int = 160  # generation budget of those requests
    stop_after: int | None = None  # stop (checkpoint, export) after this step; the schedule still spans ``steps``
    keep_checkpoints: int = 3
    progress_only: bool = False  # train nothing: write a snapshot of the run in ``ckpt_dir`` to ``results_dir``


def hf_config(m: ModelShape, tok: ByteTokenizer | None = None, dtype: str = "bfloat16") -> dict:
    """The HF ``config.json`` of the model (DeepseekV3ForCausalLM)."""
    tok = tok or ByteTokenizer()
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": tok.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "moe_intermediate_size": m.moe_intermediate_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "n_routed_experts": m.num_experts, "num_experts_per_tok": m.experts_per_tok,
        "n_shared_experts": m.shared_experts, "routed_scaling_factor": m.routed_scaling_factor,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "first_k_dense_replace": m.first_k_dense, "moe_layer_freq": 1,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "hidden_act": "silu", "max_position_embeddings": m.max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": m.rope_theta, "rope_scaling": None, "rope_interleave": True,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
        "initializer_range": 0.02, "use_cache": True, "dtype": dtype,
    }


def model_config(m: ModelShape) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_config(m))


def init_train_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Float32 training init: fan-in-scaled normal matrices, embeddings std 0.02, norms 1, biases 0."""
    tree = abstract_params(cfg, "float32")
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_info)
    keys = jax.random.split(key, len(leaves))
    out = []
    for info, k in zip(leaves, keys, strict=True):
        if info.init in ("ones", "zeros"):
            out.append((jnp.ones if info.init == "ones" else jnp.zeros)(info.shape, jnp.float32))
        else:
            std = 0.02 if info.init == "embed" else 1.0 / np.sqrt(info.shape[-2])
            out.append(std * jax.random.normal(k, info.shape, jnp.float32))
    return jax.tree.unflatten(treedef, out)


# ---- forward and loss ------------------------------------------------------------------------------------
def train_forward(params: Params, cfg: ModelConfig, tokens: jax.Array, capacity_factor: float | None = None,
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The model's forward with a training-time expert dispatch: tokens i32[B, T] -> (logits f32[B, T, V],
    {"load": f32[num_moe_layers, E], "dropped": f32[num_moe_layers]}). ``capacity_factor`` None runs every
    expert densely (exact, ``moe.dense_experts``); else ``moe.capacity_experts`` with that factor."""
    dispatch = dense_experts if capacity_factor is None else partial(capacity_experts, factor=capacity_factor)
    return forward_with_moe_stats(params, cfg, tokens, dispatch)


def masked_nll(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean NLL over masked positions. logits f32[B, T, V], targets i32[B, T], mask f32[B, T]."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def update_correction_bias(params: Params, loads: jax.Array, rate: float) -> Params:
    """bias_e -= rate * sign(load_e - mean load) in every MoE layer. loads f32[num_moe_layers, E]."""
    layers, j = [], 0
    for layer in params.layers:
        if isinstance(layer.mlp, MoEParams) and layer.mlp.correction_bias is not None:
            bias = layer.mlp.correction_bias - rate * jnp.sign(loads[j] - jnp.mean(loads[j]))
            layer = layer.replace(mlp=layer.mlp.replace(correction_bias=bias))
        j += isinstance(layer.mlp, MoEParams)
        layers.append(layer)
    return params.replace(layers=layers)


def lr_cycles(c: TrainConfig) -> list[tuple[int, int, float]]:
    """(first step, end step, peak) of each learning-rate cycle: the first from step 0 at ``c.lr``, then one from
    each curriculum phase that sets ``lr``; a cycle ends where the next begins, the last at ``c.steps``. So a run
    continued by appending a phase with its own ``lr`` (and raising ``steps``) keeps the schedule of its earlier
    steps, and a fresh run reproduces it."""
    starts = [(0, c.lr)] + [(p.from_step, p.lr) for p in c.curriculum if p.lr is not None]
    if any(s <= 0 for s, _ in starts[1:]):
        raise ValueError("a phase at step 0 cannot set lr: the first cycle's peak is the run's lr")
    ends = [s for s, _ in starts[1:]] + [c.steps]
    cycles = [(s, e, peak) for (s, peak), e in zip(starts, ends, strict=True)]
    if any(e - s <= c.warmup_steps for s, e, _ in cycles):
        raise ValueError(f"every learning-rate cycle must be longer than warmup_steps={c.warmup_steps}: {cycles}")
    return cycles


def lr_schedule(c: TrainConfig) -> optax.Schedule:
    """Linear warmup then cosine decay to ``peak * min_lr_ratio`` within each of :func:`lr_cycles`."""
    cycles = lr_cycles(c)
    parts = [optax.warmup_cosine_decay_schedule(0.0, peak, c.warmup_steps, e - s, peak * c.min_lr_ratio)
             for s, e, peak in cycles]
    return optax.join_schedules(parts, [s for s, _, _ in cycles[1:]]) if len(parts) > 1 else parts[0]


def make_optimizer(c: TrainConfig) -> optax.GradientTransformation:
    schedule = lr_schedule(c)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    return optax.chain(optax.clip_by_global_norm(c.grad_clip),
                       optax.adamw(schedule, b2=c.b2, weight_decay=c.weight_decay, mask=decay_mask))


def make_step(cfg: ModelConfig, c: TrainConfig, opt: optax.GradientTransformation):
    """The jitted step: (params, opt_state, tokens i32[B, T+1], mask f32[B, T]) -> (params, opt_state, stats)."""

    def loss_fn(params, tokens, mask):
        logits, aux = train_forward(params, cfg, tokens[:, :-1], c.capacity_factor)
        return masked_nll(logits, tokens[:, 1:], mask), aux

    @jax.jit
    def step(params, opt_state, tokens, mask):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = update_correction_bias(params, aux["load"], c.bias_update_rate)
        stats = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                 "max_load": jnp.max(aux["load"]) * cfg.num_experts,  # 1.0 = perfectly balanced
                 "dropped": jnp.mean(aux["dropped"])}
        return params, opt_state, stats

    return step


# ---- evaluation during training ---------------------------------------------------------------------------
def tool_completion_batch(n: int, seq_len: int, seed: int = 0, split: str = "heldout",
                          mix: str = "single") -> tuple[np.ndarray, np.ndarray]:
    """(tokens i32[n, seq_len + 1], mask f32[n, seq_len]): one example per row; only the completion
    (``<tool_call>..<eos>``) counts, so the loss measures how well the model answers held-out requests."""
    tok = ByteTokenizer()
    tokens = np.full((n, seq_len + 1), tok.pad_id, np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for r, ex in enumerate(examples(n, split, seed, mix=mix)):
        p, c = ex.prompt_ids(tok), ex.completion_ids(tok)
        ids = (p + c)[: seq_len + 1]
        tokens[r, : len(ids)] = ids
        mask[r, len(p) - 1: len(ids) - 1] = 1.0
    return tokens, mask


def tool_eval_examples(cfg: ModelConfig, n: int, max_tokens: int, seed: int = 0) -> list:
    """``n`` held-out requests: single requests of every kind, and a quarter conversations (``multi_turn``) when
    the model's context holds them (``MAX_PROMPT_TOKENS + max_tokens``)."""
    multi = n // 4 if cfg.max_position_embeddings >= MAX_PROMPT_TOKENS + max_tokens else 0
    return (examples(n - multi, "heldout", seed, mix="single")
            + (examples(multi, "heldout", seed, mix="multi_turn") if multi else []))


_STEP_FIELDS = ("lr", "warmup_steps", "steps", "min_lr_ratio", "weight_decay", "b2", "grad_clip", "bias_update_rate",
                "capacity_factor")


def _step_key(c: TrainConfig) -> tuple:
    phase_lrs = tuple((p.from_step, p.lr) for p in c.curriculum if p.lr is not None)
    return tuple((f, getattr(c, f)) for f in _STEP_FIELDS) + (("curriculum", phase_lrs),)


@lru_cache(maxsize=4)
def _optimizer_and_step(cfg: ModelConfig, key: tuple):
    """One optimizer and compiled step per (model, hyper-parameters) in a process (a resumed run reuses them)."""
    fields = dict(key)
    c = TrainConfig(**fields | {"curriculum": [Phase(from_step=s, lr=lr) for s, lr in fields["curriculum"]]})
    opt = make_optimizer(c)
    return opt, make_step(cfg, c, opt)


@lru_cache(maxsize=4)
def make_eval(cfg: ModelConfig, tool_calls: int = 0, max_tokens: int = 160):
    """Returns eval(params) -> held-out losses (nats/token) on fixed data: ``heldout_text_loss`` (windows of
    ``min(256, positions)`` bytes, the length the shipped perplexity is quoted at) and ``heldout_tool_loss``
    (completions of single requests); with ``tool_calls`` > 0 also greedy generation on that many held-out
    requests (:func:`tool_eval_examples`): ``tool_exact``, ``tool_validity``, ``tool_args`` (argument accuracy)
    and ``tool_exact_<kind>``."""
    from lab.eval.cached_decode import cached_greedy_generate_fn
    from lab.eval.generation import evaluate_tool_calls

    seq_len = min(256, cfg.max_position_embeddings)
    text = eval_windows("heldout", seq_len, num=32)
    text_mask = np.ones((text.shape[0], seq_len), np.float32)
    tool, tool_mask = tool_completion_batch(32, min(320, cfg.max_position_embeddings))
    loss = jax.jit(lambda p, t, m: masked_nll(train_forward(p, cfg, t[:, :-1])[0], t[:, 1:], m))  # exact, no drops
    requests = tool_eval_examples(cfg, tool_calls, max_tokens) if tool_calls else []

    def evaluate(params) -> dict[str, float]:
        out = {"heldout_text_loss": float(loss(params, text, text_mask)),
               "heldout_tool_loss": float(loss(params, tool, tool_mask))}
        if requests:
            gen = cached_greedy_generate_fn(params, cfg, batch_size=len(requests))
            rep = evaluate_tool_calls(gen, requests, max_tokens=max_tokens)
            out.update({"tool_exact": rep.exact_match, "tool_validity": rep.validity,
                        "tool_args": rep.argument_accuracy,
                        **{f"tool_exact_{k}": v for k, v in rep.exact_by_kind.items()}})
        return out

    return evaluate


# ---- export ---------------------------------------------------------------------------------------------
def export_hf(params: Params, m: ModelShape, out_dir: str | Path, dtype: str = "bfloat16",
              extra_files: dict[str, str] | None = None) -> Path:
    """Write an HF-format checkpoint directory (see module docstring). Routers and correction biases are
    stored in float32 (as DeepSeek-V3 does), every other tensor in ``dtype``."""
    from safetensors.flax import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteTokenizer()
    cfg = model_config(m)
    abstract = abstract_params(cfg, dtype)
    flat_info = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_info)[0]
    flat_vals = jax.tree.leaves(params)
    tensors: dict[str, jax.Array] = {}
    for (kp, info), value in zip(flat_info, flat_vals, strict=True):
        names, transpose = hf_sources(leaf_path(kp), info)
        value = np.asarray(value, np.float32).astype(to_dtype(info.dtype))
        parts = list(value) if len(names) > 1 else [value]
        for name, part in zip(names, parts, strict=True):
            tensors[name] = jnp.asarray(np.ascontiguousarray(part.T if transpose else part))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(m, tok, dtype), indent=2) + "\n")
    tok.save(out, model_max_length=cfg.max_position_embeddings)
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out


# ---- the loop ---------------------------------------------------------------------------------------------
def _checkpointer(c: TrainConfig):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=c.keep_checkpoints, save_interval_steps=c.ckpt_every)
    return ocp.CheckpointManager(Path(c.ckpt_dir).absolute(), options=opts)


def train(c: TrainConfig, log=print) -> dict:
    """:func:`fit`, then :func:`finish`: export, evaluate the exported model, write results and the plot.

    Returns the run summary (also written to ``<results_dir>/results.json``); the per-step history goes to
    ``history.json`` and the loss curve to ``loss_curve.png`` in ``results_dir``.
    """
    if c.progress_only:
        return progress(c, log)
    params, history = fit(c, log)
    return finish(c, params, history, log)


PROGRESS_KEYS = ("heldout_text_loss", "heldout_tool_loss", "tool_exact", "tool_validity", "tool_args")


def eval_table(history: dict) -> list[str]:
    """Markdown rows of the held-out evaluations every 500 steps and the last one."""
    evals = history["eval"]
    shown = [e for e in evals if e["step"] % 500 == 0 or e is evals[-1]]
    rows = ["| step | " + " | ".join(PROGRESS_KEYS) + " |", "|---:|" + "---:|" * len(PROGRESS_KEYS)]
    return rows + ["| " + " | ".join([str(e["step"])] + [f"{e[k]:.3f}" if k in e else "" for k in PROGRESS_KEYS])
                   + " |" for e in shown]


def _run_readme(c: TrainConfig, history: dict, title: str, lead: str, final: list[str]) -> str:
    return "\n".join([
        f"# {title}", "", lead + f" `history.json` has the training loss every {c.log_every} steps and the held-out "
        f"evaluation every {c.eval_every} ({c.eval_tool_calls} generated requests, a quarter multi-turn when the "
        "context holds them); `loss_curve.png` plots them.", "",
        "Curriculum: " + _curriculum_text(asdict(c)) + ".", "", *final,
        "Held-out evaluation during training (losses in nats/byte; exact match, validity and argument accuracy of "
        "generated calls):", "", *eval_table(history), ""])


def progress(c: TrainConfig, log=print) -> dict:
    """A snapshot of a run still going: the history ``ckpt_dir`` holds (as of its last checkpoint) written to
    ``results_dir`` as ``history.json``, ``loss_curve.png`` and a README with the held-out evaluations every 500
    steps and the last one. Trains, exports and evaluates nothing. Returns ``{"step", "eval"}`` (the last eval)."""
    history = json.loads((Path(c.ckpt_dir) / "history.json").read_text())
    res = Path(c.results_dir)
    res.mkdir(parents=True, exist_ok=True)
    (res / "history.json").write_text(json.dumps(history) + "\n")
    plot_history(history, res / "loss_curve.png")
    step = history["train"][-1]["step"] if history["train"] else 0
    evals = history["eval"]
    (res / "README.md").write_text(_run_readme(
        c, history, "Default-model training in progress (not the shipped model)",
        f"A snapshot of the run checkpointed in `{c.ckpt_dir}` (`python experiments/train.py progress_only=true "
        f"results_dir={c.results_dir}`): step {step:,} of {c.steps:,}, {history['wall_s'] / 60:.1f} min of wall "
        "time so far (the CPU shared with other work).", []))
    log(f"progress at step {step}: " + ", ".join(f"{k} {evals[-1][k]:.3f}" for k in PROGRESS_KEYS
                                                  if evals and k in evals[-1]))
    return {"step": step, "eval": evals[-1] if evals else None}


def phases(c: TrainConfig) -> list[tuple[int, Mixture]]:
    """(first step, batch source) of each curriculum phase, in step order (one phase without a curriculum)."""
    plan = c.curriculum or [Phase(0, c.seq_len, c.batch_size, c.tool_fraction, c.tool_mix)]
    if plan[0].from_step != 0 or any(b.from_step <= a.from_step for a, b in zip(plan, plan[1:], strict=False)):
        raise ValueError(f"curriculum phases must start at step 0 and increase: {[p.from_step for p in plan]}")
    return [(p.from_step, Mixture(batch_size=p.batch_size, seq_len=p.seq_len, tool_fraction=p.tool_fraction,
                                  seed=c.seed, tool_mix=p.tool_mix, answer_weight=c.answer_weight,
                                  prompt_weight=c.prompt_weight)) for p in plan]


def batch_at(plan: list[tuple[int, Mixture]], step: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``step`` of the phase it falls in (a function of the seed and the step only)."""
    return [m for first, m in plan if first <= step][-1].batch(step)


def fit(c: TrainConfig, log=print) -> tuple[Params, dict]:
    """The training loop, resuming from ``c.ckpt_dir`` when it holds a checkpoint; it stops after ``c.stop_after``
    steps when set (else ``c.steps``). Returns the final float32 params and the history
    ``{"train": [...], "eval": [...], "wall_s"}``."""
    import orbax.checkpoint as ocp

    cfg = model_config(c.model)
    opt, step_fn = _optimizer_and_step(cfg, _step_key(c))
    evaluate = make_eval(cfg, c.eval_tool_calls, c.eval_max_tokens)
    plan = phases(c)
    if max(m.seq_len for _, m in plan) > cfg.max_position_embeddings:
        raise ValueError(f"a phase's seq_len exceeds max_position_embeddings={cfg.max_position_embeddings}")
    params = init_train_params(cfg, jax.random.key(c.seed))
    opt_state = opt.init(params)
    history: dict = {"train": [], "eval": [], "wall_s": 0.0}
    mngr = _checkpointer(c)
    start = 0
    if c.resume and mngr.latest_step() is not None:
        start = mngr.latest_step()
        target = {"params": params, "opt_state": opt_state}
        restored = mngr.restore(start, args=ocp.args.StandardRestore(target))
        params, opt_state = restored["params"], restored["opt_state"]
        history = json.loads((Path(c.ckpt_dir) / "history.json").read_text())
        history["train"] = [h for h in history["train"] if h["step"] <= start]
        history["eval"] = [h for h in history["eval"] if h["step"] <= start]
        log(f"resumed from step {start}")
    end = min(c.steps, c.stop_after) if c.stop_after is not None else c.steps
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    log(f"model: {n_params / 1e6:.2f}M parameters; steps {start}..{end} of {c.steps}; curriculum "
        + ", ".join(f"from {first}: {m.batch_size}x{m.seq_len} {m.tool_mix}" for first, m in plan))
    t0, wall0 = time.time(), history["wall_s"]
    for s in range(start, end):
        tokens, mask = batch_at(plan, s)
        params, opt_state, stats = step_fn(params, opt_state, tokens, mask)
        done = s + 1
        if done % c.log_every == 0 or done == end:
            rec = {"step": done, **{k: float(v) for k, v in stats.items()}, "wall_s": wall0 + time.time() - t0}
            history["train"].append(rec)
            log(f"step {done:5d}  loss {rec['loss']:.4f}  |g| {rec['grad_norm']:.3f}  "
                f"max load {rec['max_load']:.2f}  dropped {rec['dropped']:.3f}  {rec['wall_s']:.0f}s")
        if done % c.eval_every == 0 or done == end:
            ev = {"step": done, **evaluate(params)}
            history["eval"].append(ev)
            log(f"eval  {done:5d}  " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items() if k != "step"))
        if done % c.ckpt_every == 0 or done == end:
            history["wall_s"] = wall0 + time.time() - t0
            mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)
            mngr.wait_until_finished()
            (Path(c.ckpt_dir) / "history.json").write_text(json.dumps(history))
    history["wall_s"] = wall0 + time.time() - t0
    return params, history


def plot_history(history: dict, path: str | Path) -> Path:
    """Loss curve PNG: training loss (raw and smoothed) and the held-out text / tool-call losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr, ev = history["train"], history["eval"]
    steps = np.array([h["step"] for h in tr])
    loss = np.array([h["loss"] for h in tr])
    smooth = np.array([loss[max(0, i - 9): i + 1].mean() for i in range(len(loss))])
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(steps, loss, color="0.75", lw=0.8, label="train (mixture)")
    ax.plot(steps, smooth, color="C0", lw=1.6, label="train, 10-point mean")
    ax.plot([h["step"] for h in ev], [h["heldout_text_loss"] for h in ev], "o-", color="C1", ms=3,
            label="held-out stdlib text")
    ax.plot([h["step"] for h in ev], [h["heldout_tool_loss"] for h in ev], "s-", color="C2", ms=3,
            label="held-out tool-call completions")
    ax.axhline(np.log(256), color="0.5", ls=":", lw=1, label="uniform over bytes (ln 256)")
    gen = [h for h in ev if "tool_exact" in h]
    if gen:
        ax2 = ax.twinx()
        ax2.plot([h["step"] for h in gen], [h["tool_exact"] for h in gen], "^-", color="C3", ms=3,
                 label="held-out tool calls: exact match (right axis)")
        ax2.plot([h["step"] for h in gen], [h["tool_args"] for h in gen], "v--", color="C4", ms=3,
                 label="held-out tool calls: argument accuracy (right axis)")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("fraction of held-out requests / arguments")
        ax2.legend(fontsize=8, loc="upper left")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_ylim(0, max(6.0, float(loss[:3].max()) if len(loss) else 6.0))
    ax.set_title(f"default model training ({history['wall_s'] / 60:.1f} min on CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _curriculum_text(c: dict) -> str:
    plan = c.get("curriculum") or [{"from_step": 0, "batch_size": c["batch_size"], "seq_len": c["seq_len"],
                                    "tool_mix": c.get("tool_mix", "basic")}]
    return "; ".join(f"from step {p['from_step']}: {p['batch_size']}x{p['seq_len']} tokens, {p['tool_mix']} tool mix"
                     + (f", a new learning-rate cycle to {p['lr']}" if p.get("lr") is not None else "")
                     for p in plan)


def model_card(summary: dict) -> str:
    """The README.md written next to the exported checkpoint."""
    c, m = summary["config"], summary["config"]["model"]
    tool = summary.get("tool_calls")
    kinds = ", ".join(f"{k} {v:.1%}" for k, v in (tool or {}).get("exact_by_kind", {}).items())
    tool_line = (f"- tool calls on {tool['n']} held-out requests (greedy): valid JSON matching the schema "
                 f"{tool['validity']:.1%}, exact match {tool['exact_match']:.1%} ({kinds}), argument accuracy "
                 f"{tool.get('argument_accuracy', float('nan')):.1%}\n") if tool else ""
    if tool and tool["exact_match"] < 0.5:
        tool_line += ("- limitation: the model picks the right tool and writes schema-valid JSON, but it has not "
                      "learned to copy\n  argument values out of the request at this training budget; its arguments "
                      "are plausible values of the right kind\n")
    return f"""# phaseserve default model

A {summary['parameters'] / 1e6:.2f}M-parameter DeepSeek-V3-architecture model (`DeepseekV3ForCausalLM`) trained
from scratch by `experiments/train.py` (configs/train.yaml) on a CPU: byte-level tokens (Hugging Face tokenizer files),
standard-library Python source mixed with synthetic tool-call requests (`phaseserve.data`).

- {m['num_layers']} layers (first {m['first_k_dense']} dense), hidden {m['hidden_size']}, {m['num_heads']} heads; \
MLA with q_lora {m['q_lora_rank']}, kv_lora {m['kv_lora_rank']}, qk_nope {m['qk_nope_head_dim']}, \
qk_rope {m['qk_rope_head_dim']}, v {m['v_head_dim']}; {m['num_experts']} routed experts \
(top-{m['experts_per_tok']}, sigmoid routing with correction bias) + {m['shared_experts']} shared, \
expert width {m['moe_intermediate_size']}; context \
{m['max_position_embeddings']}
- {summary['steps_done']} steps ({_curriculum_text(c)}), AdamW (peak lr {c['lr']}), seed {c['seed']}; \
{summary['wall_s'] / 60:.0f} min wall time
- held-out text: {summary['heldout_text']['nll']:.3f} nats/byte, perplexity {summary['heldout_text']['ppl']:.2f} \
(uniform over bytes: 256)
{tool_line}
Prompt format: `<bos>{{request}}\\n`; the model answers `<tool_call>{{json}}</tool_call><eos>`. Earlier turns of a
conversation come before the request: each message and a newline, an answered one followed by its
`<tool_call>{{json}}</tool_call><eos>` (the server's chat rendering).
Weights are bfloat16 (routers and correction biases float32). Load with `phaseserve.load_checkpoint(path)` or
`transformers.AutoModelForCausalLM.from_pretrained(path)`.
"""


def final_summary(summary: dict) -> list[str]:
    """Markdown lines of the exported checkpoint's final evaluation (``results.json``)."""
    lines = [f"Final evaluation of the exported checkpoint: held-out text perplexity "
             f"{summary['heldout_text']['ppl']:.2f} ({summary['heldout_text']['nll']:.3f} nats/byte)."]
    tool = summary.get("tool_calls")
    if tool:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in tool["exact_by_kind"].items())
        lines[0] += (f" On {tool['n']} held-out tool requests (greedy): exact match **{tool['exact_match']:.3f}**, "
                     f"validity {tool['validity']:.3f}, argument accuracy {tool['argument_accuracy']:.3f}; exact "
                     f"match by kind: {kinds}.")
    return [*lines, ""]


def finish(c: TrainConfig, params: Params, history: dict, log=print) -> dict:
    """Export the trained model, reload it the way users do and evaluate the shipped (exported) weights."""
    from lab.eval.cached_decode import cached_greedy_generate_fn
    from lab.eval.generation import evaluate_tool_calls, heldout_perplexity
    from phaseserve.quant.loader import load_checkpoint

    out = export_hf(params, c.model, c.export_dir, c.export_dtype)
    cfg, shipped = load_checkpoint(out, "float32")
    logits_fn = jax.jit(lambda p, t: forward(p, cfg, t))
    res = Path(c.results_dir)
    res.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "config": asdict(c),
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shipped)),
        "wall_s": history["wall_s"],
        "steps_done": history["train"][-1]["step"] if history["train"] else 0,
        "final_train_loss_10step_mean": float(np.mean([h["loss"] for h in history["train"][-10:]])),
        "heldout_text": heldout_perplexity(shipped, cfg, logits_fn=logits_fn),
        "train_text": heldout_perplexity(shipped, cfg, eval_windows("train", min(256, cfg.max_position_embeddings),
                                                                    num=64), logits_fn=logits_fn),
        "checkpoint_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
    }
    if c.final_tool_eval:
        gen = cached_greedy_generate_fn(shipped, cfg, batch_size=50)
        t0 = time.time()
        report = evaluate_tool_calls(gen, tool_eval_examples(cfg, c.final_tool_eval, c.eval_max_tokens, seed=1),
                                     max_tokens=c.eval_max_tokens)
        summary["tool_calls"] = {**report.as_dict(), "failures": report.failures, "eval_s": time.time() - t0}
    log(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    (out / "README.md").write_text(model_card(summary))
    (res / "README.md").write_text(_run_readme(
        c, history, f"Default-model training: the run exported to `{c.export_dir}`",
        f"`python experiments/train.py`: {summary['steps_done']:,} steps, {history['wall_s'] / 60:.0f} min of wall "
        "time in all (summed over resumed runs). `results.json` has the final evaluation of the exported checkpoint, "
        "reloaded in float32.", final_summary(summary)))
    (res / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (res / "history.json").write_text(json.dumps(history) + "\n")
    plot_history(history, res / "loss_curve.png")
    return summary
