"""A fast reference generator: greedy decoding with a contiguous (unpaged) KV cache per row.

Full recompute (:func:`lab.eval.generation.greedy_generate_fn`) is the obvious oracle but costs a
whole forward pass per generated token; on a loaded two-core CPU that is minutes for a few dozen tool calls.
This generator runs ``ps.prefill`` once over the padded prompt buffer (its per-layer KV becomes the cache) and
then one token per step through the model's own decode step (``transformer.decode_step``) with the reference
paged attention of :class:`~phaseserve.cache.attend.PagedAttend`, all inside one jitted ``while_loop``.

Layout: the cache of row ``b`` is one page of ``L`` slots, page ``b + 1`` (page 0 is the null page, never
written; page table ``[[1], [2], ...]``)::

    buf    i32[B, L]          prompts left-aligned, then generated tokens, then <pad>
    cache  per layer: MLA latent [B, L, r + rope] (``MLAPages``) or (k, v) [B, L, KV, hd] (``GQAPages``), in the
           params' dtype; prefill fills all L positions, position p is rewritten when token p is decoded and
           keys beyond p are masked by length

It is a *reference* (no page allocation, no batching across arrivals): the serving engine is judged against it and
against full recompute, which it matches token for token in float32 (tests/e2e/test_default_model.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache, partial

import jax
import jax.numpy as jnp

from lab.eval.generation import batched_generate_fn
from phaseserve.cache.attend import PagedAttend
from phaseserve.cache.paged import GQAPages, MLAPages, quantize_kv
from phaseserve.config import ModelConfig
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.kernel_mesh import KernelDispatch
from phaseserve.model import transformer
from phaseserve.model.layers import softmax_scale


def as_pages(kvs: list, kv_dtype: str | None = None) -> list[GQAPages | MLAPages]:
    """Prefill's per-layer KV ([B, L, ...]) as one page of L slots per row, after the null page 0; stored in
    ``kv_dtype`` (FP8 with per-token scales, as the serving cache stores it) or as computed when None."""
    def pad(x):
        return None if x is None else jnp.pad(x, [(1, 0)] + [(0, 0)] * (x.ndim - 1))

    def store(x):
        return (x, None) if kv_dtype is None else quantize_kv(x, kv_dtype)

    out = []
    for kv in kvs:
        if isinstance(kv, tuple):
            (k, ks), (v, vs) = store(kv[0]), store(kv[1])
            out.append(GQAPages(pad(k), pad(v), pad(ks), pad(vs)))
        else:
            lat, scale = store(kv)
            out.append(MLAPages(pad(lat), pad(scale)))
    return out


def decode_step(params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, caches: list):
    """One token per row. tokens i32[B], positions i32[B], caches from :func:`as_pages`
    -> (logits f32[B, V], updated caches)."""
    b = tokens.shape[0]
    attend = PagedAttend(jnp.arange(1, b + 1, dtype=jnp.int32)[:, None], positions, jnp.ones((b,), bool), None,
                         sm_scale=softmax_scale(cfg), kd=KernelDispatch(attn_impl="reference"))
    return transformer.decode_step(params, cfg, tokens, positions, caches, attend)


def cached_greedy_generate_fn(params, cfg: ModelConfig, *, stop_ids: Sequence[int] | None = None,
                              batch_size: int = 32, pad_id: int | None = None, bucket: int = 32):
    """``GenerateFn`` (see :mod:`lab.eval.generation`): greedy, cached. The jitted loop is shared by every
    generator of one (config, stop ids), so new params (e.g. evaluation during training) reuse its compilation."""
    stops = tuple(stop_ids if stop_ids is not None else cfg.eos_token_ids) or (-1,)
    pad = ByteTokenizer().pad_id if pad_id is None else pad_id
    return batched_generate_fn(_runner(cfg, stops), params, cfg, pad=pad, bucket=bucket, batch_size=batch_size)


@lru_cache(maxsize=8)
def _runner(cfg: ModelConfig, stop_ids: tuple[int, ...]):
    stops = jnp.asarray(stop_ids, jnp.int32)

    @jax.jit
    def run(params, buf, lengths, active, max_new):
        """buf i32[B, L], lengths i32[B] (>= 1), active bool[B], max_new i32[] -> (buf, lengths)."""
        rows = jnp.arange(buf.shape[0])
        width = buf.shape[1]
        logits, kvs = transformer.prefill(params, cfg, buf, lengths)
        caches = as_pages(kvs)
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

    return run


@partial(jax.jit, static_argnames=("cfg", "prefix", "kv_dtype"))
def served_logits(prefill_params, decode_params, cfg: ModelConfig, tokens: jax.Array, *, prefix: int,
                  kv_dtype: str) -> jax.Array:
    """Next-token distributions *as served*, teacher-forced: the first ``prefix`` tokens of each row are prefilled
    with ``prefill_params``, their KV is stored in ``kv_dtype`` (what the handoff to the decode cache does), and
    every later token goes through ``decode_params``' decode step over that cache, one position at a time.
    tokens i32[B, T] -> logits f32[B, T - prefix + 1, V], predicting tokens ``prefix .. T`` (the last one is the
    token after the row). With float32 params and KV this equals ``forward`` at those positions."""
    b, t = tokens.shape
    lengths = jnp.full((b,), prefix, jnp.int32)
    first, kvs = transformer.prefill(prefill_params, cfg, tokens, lengths, logits_at=lengths - 1)

    def body(caches, p):
        logits, caches = decode_step(decode_params, cfg, tokens[:, p], jnp.full((b,), p, jnp.int32), caches)
        return caches, logits

    _, rest = jax.lax.scan(body, as_pages(kvs, kv_dtype), jnp.arange(prefix, t))
    return jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
