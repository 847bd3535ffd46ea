"""Parameter containers and their abstract description.

Params are ``flax.struct.dataclass`` pytrees. Every leaf is first described by an :class:`ArrayInfo`
(shape, dtype, logical axes, initializer), so shapes, logical axes and shardings have one source of
truth: :func:`abstract_params` builds the tree of ``ArrayInfo``; :func:`init_params` materialises it with
random values; :func:`logical_axes` maps it to the logical axis names ``sharding.py`` turns into
``PartitionSpec``s; the loader checks every HF tensor against it.

Weight layout is ``[in, out]`` (``y = x @ w``); routed experts are ``[experts, in, out]``. Absent
optional parts (biases, q/k norms, shared experts, q LoRA) are ``None``.

Logical axis names: ``vocab``, ``embed`` (hidden), ``q_heads`` (num_heads * head width, flattened),
``kv_heads`` (num_kv_heads * head_dim, flattened), ``head_dim``, ``mlp``, ``experts``, ``expert_mlp``,
``q_lora``, ``kv_lora`` (MLA latent, replicated under tensor parallelism), ``norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from phaseserve.config import ModelConfig, to_dtype


@dataclass(frozen=True)
class ArrayInfo:
    """Abstract description of one parameter leaf (a pytree leaf itself: not registered)."""

    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (fan-in scaled) | "ones" | "zeros" | "embed" (std 0.02)

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


@struct.dataclass
class MLPParams:
    w_gate: Any  # [D, F]
    w_up: Any  # [D, F]
    w_down: Any  # [F, D]


@struct.dataclass
class MoEParams:
    router: Any  # f32[D, E]
    w_gate: Any  # [E, D, F]
    w_up: Any  # [E, D, F]
    w_down: Any  # [E, F, D]
    correction_bias: Any = None  # f32[E] (sigmoid routing with e_score_correction_bias)
    shared: MLPParams | None = None


@struct.dataclass
class GQAParams:
    wq: Any  # [D, H*hd]
    wk: Any  # [D, KV*hd]
    wv: Any  # [D, KV*hd]
    wo: Any  # [H*hd, D]
    bq: Any = None  # [H*hd]
    bk: Any = None  # [KV*hd]
    bv: Any = None  # [KV*hd]
    q_norm: Any = None  # [hd]
    k_norm: Any = None  # [hd]


@struct.dataclass
class IndexerParams:
    """GLM-5 DSA indexer weights (``phaseserve.model.indexer``); only on ``indexer_types`` "full" layers."""

    wq_b: Any  # [q_lora, index_heads*index_hd]
    wk: Any  # [D, index_hd]
    k_norm_w: Any  # [index_hd]
    k_norm_b: Any  # [index_hd]
    weights_proj: Any  # [D, index_heads]


@struct.dataclass
class MLAParams:
    wkv_a: Any  # [D, kv_lora + rope]
    kv_a_norm: Any  # [kv_lora]
    wkv_b: Any  # [kv_lora, H*(nope + v)]
    wo: Any  # [H*v, D]
    wq: Any = None  # [D, H*(nope+rope)] when q_lora_rank is None
    wq_a: Any = None  # [D, q_lora]
    q_a_norm: Any = None  # [q_lora]
    wq_b: Any = None  # [q_lora, H*(nope+rope)]
    indexer: IndexerParams | None = None
    # (W_uk [H, nope, kv_lora], W_uv [H, kv_lora, v]): wkv_b's halves laid out head-major for the weight-absorbed
    # products, set on the engine workers' float weights (model.attention_mla.with_head_major_kv_b); None: sliced
    # from wkv_b in every step
    kv_b_heads: tuple[Any, Any] | None = None


@struct.dataclass
class LayerParams:
    attn_norm: Any  # [D]
    attn: GQAParams | MLAParams
    mlp_norm: Any  # [D]
    mlp: MLPParams | MoEParams


@struct.dataclass
class Params:
    embed: Any  # [V, D]
    layers: list[LayerParams]
    final_norm: Any  # [D]
    lm_head: Any = None  # [D, V]; None when tied to embed


def stored_params(params: Params) -> Params:
    """``params`` without the layouts derived from its weights for one phase (``MLAParams.kv_b_heads``): the tree
    :func:`logical_axes` describes."""
    def one(layer: LayerParams) -> LayerParams:
        a = layer.attn
        return layer.replace(attn=a.replace(kv_b_heads=None)) if getattr(a, "kv_b_heads", None) is not None else layer

    return params.replace(layers=[one(layer) for layer in params.layers])


def _mlp(d: int, f: int, dt: str, expert: bool = False) -> MLPParams:
    ax = "expert_mlp" if expert else "mlp"
    return MLPParams(
        w_gate=ArrayInfo((d, f), dt, ("embed", ax)),
        w_up=ArrayInfo((d, f), dt, ("embed", ax)),
        w_down=ArrayInfo((f, d), dt, (ax, "embed")),
    )


def _moe(cfg: ModelConfig, dt: str) -> MoEParams:
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shared = _mlp(d, f * cfg.num_shared_experts, dt, expert=True) if cfg.num_shared_experts else None
    return MoEParams(
        router=ArrayInfo((d, e), "float32", ("embed", None)),
        w_gate=ArrayInfo((e, d, f), dt, ("experts", "embed", "expert_mlp")),
        w_up=ArrayInfo((e, d, f), dt, ("experts", "embed", "expert_mlp")),
        w_down=ArrayInfo((e, f, d), dt, ("experts", "expert_mlp", "embed")),
        correction_bias=ArrayInfo((e,), "float32", (None,), "zeros") if cfg.use_correction_bias else None,
        shared=shared,
    )


def _gqa(cfg: ModelConfig, dt: str) -> GQAParams:
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.attention_bias
    return GQAParams(
        wq=ArrayInfo((d, h * hd), dt, ("embed", "q_heads")),
        wk=ArrayInfo((d, kv * hd), dt, ("embed", "kv_heads")),
        wv=ArrayInfo((d, kv * hd), dt, ("embed", "kv_heads")),
        wo=ArrayInfo((h * hd, d), dt, ("q_heads", "embed")),
        bq=ArrayInfo((h * hd,), dt, ("q_heads",), "normal") if bias else None,
        bk=ArrayInfo((kv * hd,), dt, ("kv_heads",), "normal") if bias else None,
        bv=ArrayInfo((kv * hd,), dt, ("kv_heads",), "normal") if bias else None,
        q_norm=ArrayInfo((hd,), dt, ("norm",), "ones") if cfg.qk_norm else None,
        k_norm=ArrayInfo((hd,), dt, ("norm",), "ones") if cfg.qk_norm else None,
    )


def _mla(cfg: ModelConfig, dt: str, layer: int) -> MLAParams:
    d, h = cfg.hidden_size, cfg.num_heads
    nope, rope, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_out = h * (nope + rope)
    ql = cfg.q_lora_rank
    indexer = None
    if cfg.index_topk is not None and cfg.indexer_types[layer] == "full":
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        indexer = IndexerParams(
            wq_b=ArrayInfo((ql or d, ih * ihd), dt, ("q_lora", None)),
            wk=ArrayInfo((d, ihd), dt, ("embed", None)),
            k_norm_w=ArrayInfo((ihd,), dt, ("norm",), "ones"),
            k_norm_b=ArrayInfo((ihd,), dt, ("norm",), "zeros"),
            weights_proj=ArrayInfo((d, ih), dt, ("embed", None)),
        )
    return MLAParams(
        wkv_a=ArrayInfo((d, r + rope), dt, ("embed", "kv_lora")),
        kv_a_norm=ArrayInfo((r,), dt, ("norm",), "ones"),
        wkv_b=ArrayInfo((r, h * (nope + v)), dt, ("kv_lora", "q_heads")),
        wo=ArrayInfo((h * v, d), dt, ("q_heads", "embed")),
        wq=ArrayInfo((d, q_out), dt, ("embed", "q_heads")) if ql is None else None,
        wq_a=ArrayInfo((d, ql), dt, ("embed", "q_lora")) if ql else None,
        q_a_norm=ArrayInfo((ql,), dt, ("norm",), "ones") if ql else None,
        wq_b=ArrayInfo((ql, q_out), dt, ("q_lora", "q_heads")) if ql else None,
        indexer=indexer,
    )


def abstract_params(cfg: ModelConfig, dtype: str = "float32") -> Params:
    """The tree of :class:`ArrayInfo` describing every parameter of ``cfg`` (nothing allocated)."""
    d = cfg.hidden_size
    layers = []
    for i in range(cfg.num_layers):
        attn = _mla(cfg, dtype, i) if cfg.is_mla else _gqa(cfg, dtype)
        mlp = _moe(cfg, dtype) if cfg.moe_layers[i] else _mlp(d, cfg.intermediate_size, dtype)
        layers.append(LayerParams(
            attn_norm=ArrayInfo((d,), dtype, ("norm",), "ones"), attn=attn,
            mlp_norm=ArrayInfo((d,), dtype, ("norm",), "ones"), mlp=mlp,
        ))
    return Params(
        embed=ArrayInfo((cfg.vocab_size, d), dtype, ("vocab", "embed"), "embed"),
        layers=layers,
        final_norm=ArrayInfo((d,), dtype, ("norm",), "ones"),
        lm_head=None if cfg.tie_word_embeddings else ArrayInfo((d, cfg.vocab_size), dtype, ("embed", "vocab")),
    )


def is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def map_infos(fn: Callable[[ArrayInfo], Any], tree: Any) -> Any:
    """``jax.tree.map`` over a tree whose leaves are :class:`ArrayInfo`."""
    return jax.tree.map(fn, tree, is_leaf=is_info)


def logical_axes(cfg: ModelConfig) -> Params:
    """Same tree as the params, each leaf a tuple of logical axis names."""
    return map_infos(lambda i: i.axes, abstract_params(cfg))


def shape_dtype_structs(cfg: ModelConfig, dtype: str = "float32") -> Params:
    """``jax.ShapeDtypeStruct`` leaves, for ``jax.eval_shape``-style planning and orbax restore targets."""
    return map_infos(lambda i: jax.ShapeDtypeStruct(i.shape, to_dtype(i.dtype)), abstract_params(cfg, dtype))


def _init_leaf(info: ArrayInfo, key: jax.Array) -> jax.Array:
    dt = to_dtype(info.dtype)
    if info.init == "ones":
        return jnp.ones(info.shape, dt)
    if info.init == "zeros":
        return jnp.zeros(info.shape, dt)
    if info.init == "embed":
        return (0.02 * jax.random.normal(key, info.shape, jnp.float32)).astype(dt)
    fan_in = info.shape[-2] if len(info.shape) >= 2 else info.shape[-1]
    return (jax.random.normal(key, info.shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dt)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: str = "float32") -> Params:
    """Random weights for any config (benchmarks at real shapes need no download).

    Norm weights are perturbed around one and router biases are random so that tests never run on
    trivially symmetric values.
    """
    tree = abstract_params(cfg, dtype)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_info)
    keys = jax.random.split(key, len(leaves))
    out = []
    for info, k in zip(leaves, keys, strict=True):
        x = _init_leaf(info, k)
        if info.init in ("ones", "zeros"):
            x = (x.astype(jnp.float32) + 0.1 * jax.random.normal(k, info.shape)).astype(x.dtype)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def param_count(tree: Params) -> int:
    """Number of parameters of a params or ArrayInfo tree."""
    leaves = jax.tree.leaves(tree, is_leaf=is_info)
    total = 0
    for x in leaves:
        shape = x.shape
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
