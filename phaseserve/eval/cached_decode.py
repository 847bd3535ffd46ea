"""A fast reference generator for MLA models: greedy decoding with a contiguous (unpaged) latent KV cache.

Full recompute (:func:`phaseserve.eval.generation.greedy_generate_fn`) is the obvious oracle but costs a
whole forward pass per generated token; on a loaded two-core CPU that is minutes for a few dozen tool calls.
This generator runs ``ps.prefill`` once over the padded prompt buffer (its per-layer MLA latents become the
cache) and then one token per step through the model's own weight-absorbed MLA pieces
(``attention_mla.absorbed_queries`` / ``absorbed_output``), all inside one jitted ``while_loop``.

Layout::

    buf    i32[B, L]          prompts left-aligned, then generated tokens, then <pad>
    cache  f32[B, L, r + rope] per layer: [norm(c_kv), rope(k_rope)] per position (prefill fills all L;
                               position p is rewritten when token p is decoded, keys > p are masked)

It is a *reference* (no paging, no batching across arrivals): the serving engine is judged against it and
against full recompute, which it matches token for token in float32 (tests/e2e/test_default_model.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from phaseserve.config import ModelConfig
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.eval.generation import batched_generate_fn
from phaseserve.model import attention_mla
from phaseserve.model.layers import rms_norm, softmax_scale
from phaseserve.model.transformer import embed, ffn, logits_from_hidden, prefill


def decode_step(params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, caches: list[jax.Array]):
    """One token per row. tokens i32[B], positions i32[B], caches per layer f32[B, L, r + rope]
    -> (logits f32[B, V], updated caches)."""
    rows = jnp.arange(tokens.shape[0])
    r = cfg.kv_lora_rank
    x = embed(params, tokens)  # [B, D]
    mask = jnp.arange(caches[0].shape[1])[None, :] <= positions[:, None]  # bool[B, L]
    new = []
    for layer, cache in zip(params.layers, caches, strict=True):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q_lat, q_rope, lat = attention_mla.absorbed_queries(layer.attn, cfg, h, positions)
        cache = cache.at[rows, positions].set(lat.astype(cache.dtype))
        c, k_rope = cache[..., :r], cache[..., r:]
        s = (jnp.einsum("bhr,blr->bhl", q_lat, c, preferred_element_type=jnp.float32)
             + jnp.einsum("bhe,ble->bhl", q_rope, k_rope, preferred_element_type=jnp.float32)) * softmax_scale(cfg)
        p = jax.nn.softmax(jnp.where(mask[:, None, :], s, -jnp.inf), axis=-1)
        o_lat = jnp.einsum("bhl,blr->bhr", p.astype(c.dtype), c, preferred_element_type=jnp.float32).astype(x.dtype)
        x = ffn(layer, cfg, x + attention_mla.absorbed_output(layer.attn, cfg, o_lat))
        new.append(cache)
    return logits_from_hidden(params, cfg, x), new


def cached_greedy_generate_fn(params, cfg: ModelConfig, *, stop_ids: Sequence[int] | None = None,
                              batch_size: int = 32, pad_id: int | None = None, bucket: int = 32):
    """``GenerateFn`` (see :mod:`phaseserve.eval.generation`): greedy, cached, MLA models only."""
    if not cfg.is_mla:
        raise NotImplementedError("the cached reference decoder handles MLA models; use greedy_generate_fn")
    stops = jnp.asarray(list(stop_ids if stop_ids is not None else cfg.eos_token_ids) or [-1], jnp.int32)
    pad = ByteTokenizer().pad_id if pad_id is None else pad_id

    @jax.jit
    def run(params, buf, lengths, active, max_new):
        """buf i32[B, L], lengths i32[B] (>= 1), active bool[B], max_new i32[] -> (buf, lengths)."""
        rows = jnp.arange(buf.shape[0])
        width = buf.shape[1]
        logits, caches = prefill(params, cfg, buf, lengths)
        first = jnp.argmax(logits[rows, lengths - 1], axis=-1).astype(jnp.int32)

        def cond(state):
            return (state[4] < max_new) & ~jnp.all(state[3])

        def body(state):
            buf, lengths, tok, done, i, caches = state
            at = jnp.minimum(lengths, width - 1)
            buf = buf.at[rows, at].set(jnp.where(done, buf[rows, at], tok))
            lengths = lengths + (~done).astype(jnp.int32)
            done = done | jnp.isin(tok, stops) | (lengths >= width)
            logits, caches = decode_step(params, cfg, tok, jnp.minimum(lengths - 1, width - 1), caches)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return buf, lengths, nxt, done, i + 1, caches

        state = (buf, lengths, first, ~active, jnp.int32(0), caches)
        buf, lengths = jax.lax.while_loop(cond, body, state)[:2]
        return buf, lengths

    return batched_generate_fn(run, params, cfg, pad=pad, bucket=bucket, batch_size=batch_size)
