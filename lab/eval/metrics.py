"""Quality metrics on logits and generations: the numbers every weight / KV representation is judged by.

- :func:`token_nll`, :func:`mean_nll`, :func:`perplexity` — next-token likelihood of a model on fixed text;
- :func:`kl_divergence`, :func:`top1_agreement` — how far a representation's next-token distribution moved
  from the full-precision model's at the same positions (``ref`` is always the full-precision side);
- :func:`token_match_rate`, :func:`sequence_match_rate` — agreement of two greedy generations.

All logits are ``f32[B, T, V]`` (or any ``[..., V]``); masks are ``[B, T]`` with 1 where a position counts.
Every function returns a Python float (averages over the counted positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _mask(mask, shape) -> jax.Array:
    return jnp.ones(shape, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)


def _masked_mean(values: jax.Array, mask) -> float:
    m = _mask(mask, values.shape)
    denom = jnp.sum(m)
    if float(denom) == 0:
        raise ValueError("the mask selects no positions")
    return float(jnp.sum(values * m) / denom)


def token_nll(logits, targets) -> jax.Array:
    """Negative log-likelihood per position: logits f32[B, T, V], targets i32[B, T] -> f32[B, T] (nats)."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]


def mean_nll(logits, targets, mask=None) -> float:
    """Mean NLL in nats over masked positions. logits f32[B, T, V], targets i32[B, T], mask [B, T] or None."""
    return _masked_mean(token_nll(logits, targets), mask)


def perplexity(logits, targets, mask=None) -> float:
    """``exp(mean_nll)``. logits f32[B, T, V], targets i32[B, T], mask [B, T] or None."""
    return float(np.exp(mean_nll(logits, targets, mask)))


def kl_divergence(ref_logits, test_logits, mask=None) -> float:
    """Mean over positions of KL(P_ref || P_test) in nats. ref_logits, test_logits f32[B, T, V], mask [B, T]."""
    ref = jax.nn.log_softmax(jnp.asarray(ref_logits, jnp.float32), axis=-1)
    test = jax.nn.log_softmax(jnp.asarray(test_logits, jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(ref) * (ref - test), axis=-1)
    return _masked_mean(kl, mask)


def top1_agreement(ref_logits, test_logits, mask=None) -> float:
    """Fraction of positions whose argmax token is the same. ref_logits, test_logits f32[B, T, V], mask [B, T]."""
    same = jnp.argmax(jnp.asarray(ref_logits), axis=-1) == jnp.argmax(jnp.asarray(test_logits), axis=-1)
    return _masked_mean(same.astype(jnp.float32), mask)


def token_match_rate(ref: Sequence[Sequence[int]], test: Sequence[Sequence[int]]) -> float:
    """Position-wise agreement of paired generations: matches / positions, where each pair contributes
    ``max(len(a), len(b))`` positions (a missing token on one side is a mismatch)."""
    if len(ref) != len(test):
        raise ValueError(f"{len(ref)} reference generations vs {len(test)} test generations")
    matches = positions = 0
    for a, b in zip(ref, test, strict=True):
        positions += max(len(a), len(b))
        matches += sum(int(x) == int(y) for x, y in zip(a, b, strict=False))
    if positions == 0:
        raise ValueError("all generations are empty")
    return matches / positions


def sequence_match_rate(ref: Sequence[Sequence[int]], test: Sequence[Sequence[int]]) -> float:
    """Fraction of pairs of generations that are identical token for token."""
    if len(ref) != len(test) or not ref:
        raise ValueError(f"need equally many (>0) generations, got {len(ref)} and {len(test)}")
    return sum(list(map(int, a)) == list(map(int, b)) for a, b in zip(ref, test, strict=True)) / len(ref)


def first_divergence(ref: Sequence[int], test: Sequence[int]) -> int:
    """Index of the first differing token of two generations (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(ref, test, strict=False)):
        if int(x) != int(y):
            return i
    return min(len(ref), len(test))
