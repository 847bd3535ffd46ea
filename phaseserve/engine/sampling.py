"""Batched token sampling inside the jitted steps: greedy, temperature, top-k and top-p per row.

Each row carries its own parameters (arrays of shape [B]) and its own PRNG key derived from
``(request seed, token index)``, so a request's samples do not depend on which other requests share its batch.
When every row is greedy (``temperature == 0``) the step runs only the argmax: the sort, the top-k/top-p masks and
the draws sit behind a ``lax.cond`` that is not taken.

A row whose logits are not all finite (an overflow in the model: NaN or inf) samples :data:`NONFINITE_TOKEN` instead
of a token (``argmax`` of NaN logits is token 0, which used to go out as a real token); a decode row whose attention
output the integrity guard found non-finite (and zeroed, so that it cannot spread through the batch) gets
:data:`NONFINITE_ATTENTION` from the decode step. The host ends either request with
:class:`~phaseserve.engine.request.NonFiniteLogitsError` and emits nothing for it (:func:`is_nonfinite`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

NONFINITE_TOKEN = -1  # sampled for a row whose logits are not all finite: never a token id
NONFINITE_ATTENTION = -2  # a decode row whose attention output was NaN/inf (the integrity guard zeroed it)


def is_nonfinite(token: int) -> bool:
    """Whether a step's token for a row is one of the non-finite sentinels (never a token id)."""
    return token < 0


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array,
           steps: jax.Array) -> jax.Array:
    """logits f32[B, V]; temperature f32[B] (0 = greedy); top_k i32[B] (0 = off); top_p f32[B];
    seeds u32[B]; steps i32[B] (index of the token being sampled) -> i32[B] (:data:`NONFINITE_TOKEN` for a row
    whose logits are not all finite)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = lambda: jnp.where(temperature > 0, _draw(logits, temperature, top_k, top_p, seeds, steps), greedy)
    out = jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: greedy)
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), out, NONFINITE_TOKEN)


def _draw(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array,
          steps: jax.Array) -> jax.Array:
    """Temperature / top-k / top-p draw for every row (greedy rows are replaced by the caller) -> i32[B]."""
    v = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs_sorted = jax.nn.softmax(jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits), axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    cutoff_idx = jnp.sum(cum < top_p[:, None], axis=-1)
    cutoff = jnp.take_along_axis(sorted_logits, jnp.minimum(cutoff_idx, v - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def token_logprobs(logits: jax.Array | Callable[[], jax.Array], tokens: jax.Array, want: jax.Array, k: int
                   ) -> tuple[jax.Array, ...]:
    """Log-probabilities under the model (``log_softmax`` of the raw logits) for rows that ``want`` them, computed
    only when one does (a ``lax.cond``: no cost otherwise; rows that do not want them read zeros).

    logits f32[..., V], or a function that computes them (called inside the branch: e.g. the lm head over every
    prompt position, run only when asked); tokens i32[...] (the token whose logprob is asked; a negative id reads
    0); want bool[...] -> (logprob f32[...], top logprobs f32[..., k], top ids i32[..., k]), most likely first."""
    shape = tokens.shape

    def compute():
        lsm = jax.nn.log_softmax((logits() if callable(logits) else logits).astype(jnp.float32), axis=-1)
        lp = jnp.take_along_axis(lsm, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(lsm, k)
        return jnp.where(tokens >= 0, lp, 0.0), top_lp, top_ids.astype(jnp.int32)

    def zeros():
        return (jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, k), jnp.float32), jnp.zeros((*shape, k), jnp.int32))

    return jax.lax.cond(jnp.any(want), compute, zeros)
