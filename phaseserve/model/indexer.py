"""GLM-5 DeepSeek Sparse Attention (DSA): the lightning indexer and MLA attention over the keys it selects.

Per layer the indexer scores every (query, key) pair cheaply and each query then attends, in the weight-absorbed
MLA form, only to the ``index_topk`` causal keys with the highest scores (all of them while there are no more
than ``index_topk``, which is exactly dense attention). As transformers' ``GlmMoeDsaIndexer``::

    q_i   = rope(wq_b(q_resid))            [Hi, d]   q_resid = q_a_layernorm(q_a_proj(x)), the MLA query latent
    k     = rope(LayerNorm(wk(x)))         [d]       one key per token: the "index key" the decode cache keeps
    w     = weights_proj(x) * Hi^-0.5      [Hi]
    score(t, s) = sum_h w_h * relu(q_h(t) . k(s) * d^-0.5)

RoPE is interleaved on the first ``qk_rope_head_dim`` dims (the rest pass through). A ``"shared"`` layer of
``cfg.indexer_types`` reuses the previous layer's selection instead of running its own indexer.

**Ties.** A key whose ReLU is zero in every indexer head scores exactly 0 (with ``Hi`` heads about 2^-Hi of the keys
when queries and keys are unrelated: common with few heads), so several keys can tie at the k-th score. Among equal
scores the earlier token is selected (``lax.top_k`` is documented to prefer the lower index), and -0.0 and +0.0 are
one score. Prefill, chunked prefill and decode all select this way. transformers selects with ``torch.topk``, whose
order among equal values is unspecified (on the CPU neither the first nor the last of the tied keys in general), so
on tied inputs its own output is not determined by the model; the parity tests give its ``topk`` this same order.

Prefill (:func:`sparse_prefill`) walks query blocks of :data:`QUERY_BLOCK` rows: per block it scores the block
against every key, takes the top-k and attends over the gathered latents, so memory is
``O(block x (T + index_topk))`` per layer plus the ``[B, T, index_topk]`` selection itself, never ``T x T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from phaseserve.config import ModelConfig
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model.layers import apply_rope, rope_cos_sin
from phaseserve.model.params import IndexerParams
from phaseserve.qarrays import dense


@struct.dataclass
class DSAQuery:
    """One decode token's queries on a GLM-5 layer (``attention_mla.absorbed_queries``): the MLA queries and, on a
    layer with its own indexer, the index queries; ``index_q`` None means "reuse the previous layer's selection"."""

    q_latent: jax.Array  # [B, H, r]
    q_rope: jax.Array  # [B, H, rope]
    index_q: jax.Array | None  # [B, Hi, d]
    index_w: jax.Array | None  # f32[B, Hi]
    topk: int = struct.field(pytree_node=False)


QUERY_BLOCK = 64  # query rows per step of the blockwise prefill
LAYER_NORM_EPS = 1e-6  # the indexer's k_norm (nn.LayerNorm(index_head_dim, eps=1e-6))


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float = LAYER_NORM_EPS) -> jax.Array:
    """x [..., D], w [D], b [D] -> [..., D], computed in float32."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def index_queries(p: IndexerParams, cfg: ModelConfig, q_resid: jax.Array, x: jax.Array, positions: jax.Array, *,
                  kd: KernelDispatch = DIRECT) -> tuple[jax.Array, jax.Array]:
    """q_resid [B, T, q_lora], x [B, T, D], positions i32[B, T] -> (q [B, T, Hi, d] roped, w f32[B, T, Hi])."""
    b, t, _ = x.shape
    q = dense(q_resid, p.wq_b, kd).reshape(b, t, cfg.index_n_heads, cfg.index_head_dim)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    q = apply_rope(q, cos, sin, interleave=True)
    w = dense(x, p.weights_proj, kd).astype(jnp.float32) * (cfg.index_n_heads ** -0.5)
    return q, w


def index_keys(p: IndexerParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *,
               kd: KernelDispatch = DIRECT) -> jax.Array:
    """x [B, T, D], positions i32[B, T] -> index keys [B, T, d] (what the decode cache stores per token and layer)."""
    k = layer_norm(dense(x, p.wk, kd), p.k_norm_w, p.k_norm_b)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    return apply_rope(k[:, :, None, :], cos, sin, interleave=True)[:, :, 0]


def index_scores(q: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, T, Hi, d], w f32[B, T, Hi], k [B, S, d] -> f32[B, T, S] (float32 as transformers)."""
    s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), k.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    return jnp.einsum("bth,bths->bts", w, jax.nn.relu(s))


def visible(keys: jax.Array, q_positions: jax.Array, lengths: jax.Array | None) -> jax.Array:
    """Causal (and length) visibility: keys i32[B, T, K] key indices, q_positions i32[B, T] -> bool[B, T, K]."""
    ok = keys <= q_positions[..., None]
    if lengths is not None:
        ok &= keys < lengths[:, None, None]
    return ok


def select(scores: jax.Array, q_positions: jax.Array, lengths: jax.Array | None, topk: int) -> jax.Array:
    """scores f32[B, T, S], q_positions i32[B, T], lengths i32[B] | None -> key indices i32[B, T, min(topk, S)].

    The visible keys with the highest scores, the earlier key first among equal scores (module docstring: ties); a
    query with fewer visible keys than ``topk`` gets all of them, padded with invisible ones that :func:`visible`
    masks out (as transformers' masked top-k)."""
    s = scores.shape[-1]
    keys = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), scores.shape)
    scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 -> +0.0: top_k orders -0.0 below +0.0 (not a tie otherwise)
    masked = jnp.where(visible(keys, q_positions, lengths), scores, -jnp.inf)
    return jax.lax.top_k(masked, min(topk, s))[1].astype(jnp.int32)


def sparse_mla(q_latent: jax.Array, q_rope: jax.Array, latents: jax.Array, valid: jax.Array, scale: float,
               ) -> jax.Array:
    """Weight-absorbed MLA attention over a gathered token list (the reference the decode kernel is checked against).

    q_latent [B, T, H, r], q_rope [B, T, H, rope], latents [B, T, K, r + rope] (each query's selected tokens),
    valid bool[B, T, K] -> o_latent [B, T, H, r] (zeros for a query with no valid token)."""
    r = q_latent.shape[-1]
    c, kr = latents[..., :r], latents[..., r:]
    s = (jnp.einsum("bthr,btkr->bthk", q_latent, c, preferred_element_type=jnp.float32)
         + jnp.einsum("bthe,btke->bthk", q_rope, kr, preferred_element_type=jnp.float32)) * scale
    ok = valid[:, :, None, :]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bthk,btkr->bthr", p.astype(c.dtype), c, preferred_element_type=jnp.float32
                      ).astype(q_latent.dtype)


def _blocks(x: jax.Array, n: int, block: int) -> jax.Array:
    """[B, T, ...] -> [n, B, block, ...] (T zero-padded to n * block)."""
    pad = n * block - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array, t: int) -> jax.Array:
    """[n, B, block, ...] -> [B, T, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :t]


def sparse_prefill(cfg: ModelConfig, q_latent: jax.Array, q_rope: jax.Array, latents: jax.Array,
                   positions: jax.Array, lengths: jax.Array | None, scale: float, *,
                   index: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   selection: jax.Array | None = None, block: int = QUERY_BLOCK) -> tuple[jax.Array, jax.Array]:
    """DSA attention of a whole prompt, blockwise over queries.

    q_latent [B, T, H, r], q_rope [B, T, H, rope], latents [B, S, r + rope], positions i32[B, T] (query positions;
    key s sits at position s), lengths i32[B] | None. Either ``index = (q_idx [B, T, Hi, d], w f32[B, T, Hi],
    k_idx [B, S, d])`` (a "full" layer: select here) or ``selection`` i32[B, T, K] (a "shared" layer).
    Returns (o_latent [B, T, H, r], selection i32[B, T, min(index_topk, S)])."""
    b, t = q_latent.shape[:2]
    block = min(block, t)
    n = -(-t // block)
    xs = {"q_latent": q_latent, "q_rope": q_rope, "pos": positions}
    if index is not None:
        xs["q_idx"], xs["w"] = index[0], index[1]
    else:
        xs["sel"] = selection
    xs = {k: _blocks(v, n, block) for k, v in xs.items()}
    rows = jnp.arange(b)[:, None, None]

    def one(blk):
        sel = blk.get("sel")
        if sel is None:
            sel = select(index_scores(blk["q_idx"], blk["w"], index[2]), blk["pos"], lengths, cfg.index_topk)
        gathered = latents[rows, sel]  # [B, block, K, r + rope]
        o = sparse_mla(blk["q_latent"], blk["q_rope"], gathered, visible(sel, blk["pos"], lengths), scale)
        return o, sel

    o, sel = jax.lax.map(one, xs)
    return _unblocks(o, t), _unblocks(sel, t)
