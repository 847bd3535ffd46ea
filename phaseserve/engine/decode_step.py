"""The decode worker's step: one jitted function for the whole running batch.

For every row ``b`` it feeds ``tokens[b]`` at ``positions[b]``, writes that token's KV into the row's pages,
attends over the row's paged cache (FP8 pages dequantized inside the attention kernel), runs the decode weight
representation through the MoE layers, and samples the next token::

    step(params, pool, batch) -> (next_tokens i32[B], pool', logprobs)

It is the model's one decode step (``transformer.decode_step``) with the paged cache's per-layer attention
(:class:`~phaseserve.cache.attend.PagedAttend`), followed by sampling; the sampled tokens' logprobs and top
alternatives (:func:`~phaseserve.engine.sampling.token_logprobs`) are computed only when a row wants them.

Integrity: the step takes the tracker's ``ok bool[B]`` mask (computed by the tracker's separate jitted check
just before) and consumes it on device: failing rows' page tables point at the null page, they write nothing
and attend over nothing. The hooks come from the tracker object; with :class:`NoopTracker` they are identities
and the traced step is the same jaxpr as one built with ``tracker=None`` (tested).

Non-finite values: a row whose logits are NaN/inf samples :data:`~phaseserve.engine.sampling.NONFINITE_TOKEN`; with
the tracker on, a row whose attention output was NaN/inf in some layer (the guard zeroed it there, so the MoE
dispatch never mixes it into other rows) gets :data:`~phaseserve.engine.sampling.NONFINITE_ATTENTION`. Either ends
the request with :class:`~phaseserve.engine.request.NonFiniteLogitsError`, never a KV integrity abort: that is
reported only for rows whose page-tag check failed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from phaseserve.cache.attend import PagedAttend
from phaseserve.cache.paged import PagePool
from phaseserve.config import ModelConfig
from phaseserve.engine.sampling import NONFINITE_ATTENTION, sample, token_logprobs
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model import transformer
from phaseserve.model.layers import softmax_scale
from phaseserve.model.params import Params


@struct.dataclass
class DecodeBatch:
    """Per-row inputs of one decode step (B rows, padding rows have ``active=False``)."""

    tokens: jax.Array  # i32[B] input token
    positions: jax.Array  # i32[B] its position
    page_table: jax.Array  # i32[B, P]
    active: jax.Array  # bool[B] real rows
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seeds: jax.Array  # u32[B]
    steps: jax.Array  # i32[B] index of the token being sampled in the request's output
    want_logprobs: jax.Array  # bool[B] the row wants the sampled token's logprobs


def decode_logits(params: Params, cfg: ModelConfig, pool: PagePool, batch: DecodeBatch, ok: Any, *,
                  tracker: Any = None, kd: KernelDispatch = DIRECT) -> tuple[jax.Array, PagePool, Any]:
    """The model's decode step over the paged cache: (logits f32[B, V], pool', finite bool[B] | None).

    ``finite`` (None without a guarding tracker) is False for a row whose attention output was NaN/inf in some layer
    (zeroed there by the guard): the scores overflowed or it read NaN/inf from its pages. A row whose own new KV was
    non-finite overflowed before attention: its logits are NaN (the sampler's non-finite row) and it is not
    flagged. ``kd``: the step's kernel dispatch (``phaseserve.kernel_mesh``: attention and matmul implementations,
    mesh, provenance log)."""
    attend = PagedAttend(batch.page_table, batch.positions, batch.active, ok, tracker=tracker,
                         sm_scale=softmax_scale(cfg), kd=kd)
    logits, layers = transformer.decode_step(params, cfg, batch.tokens, batch.positions, pool.layers, attend, kd=kd)
    finite = attend.finite
    if attend.computed is not None:
        finite = finite | ~attend.computed
        logits = jnp.where(attend.computed[:, None], logits, jnp.nan)
    return logits, pool.replace(layers=tuple(layers)), finite


def decode_step(params: Params, cfg: ModelConfig, pool: PagePool, batch: DecodeBatch, ok: Any, *,
                tracker: Any = None, kd: KernelDispatch = DIRECT, top: int = 1
                ) -> tuple[jax.Array, PagePool, tuple[jax.Array, ...]]:
    """One decode step for the batch. ``ok`` bool[B] from the tracker's check (None when disabled). Returns (next
    i32[B] -- a non-finite sentinel for a row that overflowed, module docstring --, pool', the sampled tokens'
    logprobs ``(f32[B], f32[B, top], i32[B, top])``, zeros where no row asked)."""
    logits, pool, finite = decode_logits(params, cfg, pool, batch, ok, tracker=tracker, kd=kd)
    with jax.named_scope("sampling"):
        nxt = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps)
        lps = token_logprobs(logits, nxt, batch.want_logprobs, top)
    if finite is not None:
        nxt = jnp.where(finite, nxt, NONFINITE_ATTENTION)
    return nxt, pool, lps
