"""The prefill worker's step: one *chunk* of each of a batch of prompts, over the prefill mesh's own page pool.

A long prompt is prefilled in chunks (``ServeConfig.max_prefill_tokens`` is the per-step token budget the scheduler
shares among the prompts in progress). A chunk step runs the prefill weight representation over each row's next
chunk of tokens at their absolute positions; every layer writes the chunk's KV into the request's pages of the
**prefill pool** (held in the prefill KV dtype, ``QuantConfig.prefill_kv_dtype``: BF16 in the design) and attends,
with the memory-linear flash prefill, over every key the request has written so far plus the chunk's own::

    row b:  pages of the prefill pool  [ p0 | p1 | p2 | ... ]   keys 0 .. start_b - 1 already written
            chunk tokens at positions   start_b .. start_b + n_b - 1   (written, then attended over with the rest)

    step(params, pool, batch) -> (sampled token i32[B] at each row's last chunk token, pool',
                                  its logprobs (rows with want_logprobs), every position's (rows with want_prompt))

A row whose chunk ends its prompt samples its first output token here. Log-probabilities
(:func:`~phaseserve.engine.sampling.token_logprobs`) are computed only when a row of the batch asks: the sampled
token's (``want_logprobs``) and, for prompt scoring (``want_prompt``), every chunk position's logprob of the token
that follows it (``targets``), the lm head then run over every position. The unchunked prefill is the one-chunk
case of the same step; prefix hits start at ``start_b > 0`` with the cached prefix copied into the row's first
pages. The finished prompt's pages leave the prefill mesh through :mod:`phaseserve.engine.handoff` (quantized
there to the decode cache's storage dtype, e.g. FP8).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from phaseserve.cache.paged import PagePool, gather_layer, write_layer
from phaseserve.config import ModelConfig
from phaseserve.engine.sampling import sample, token_logprobs
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model.params import Params
from phaseserve.model.transformer import logits_from_hidden, prefill_hidden


@struct.dataclass
class ChunkBatch:
    """B rows, each one chunk of one prompt (padding rows: ``lengths == 0``, nothing valid)."""

    tokens: jax.Array  # i32[B, C] the chunk's tokens, right-padded
    positions: jax.Array  # i32[B, C] their absolute positions (start_b + j)
    valid: jax.Array  # bool[B, C] real chunk tokens
    lengths: jax.Array  # i32[B] keys the chunk sees: start_b + n_b
    last: jax.Array  # i32[B] index in the chunk of the row's last token (n_b - 1)
    page_table: jax.Array  # i32[B, P] the rows' prefill-pool pages (P * page_size >= start_b + n_b)
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seeds: jax.Array  # u32[B]
    steps: jax.Array  # i32[B] index of the sampled token in the request's output
    targets: jax.Array  # i32[B, C] the token after each chunk position (prompt scoring; -1 where none)
    want_logprobs: jax.Array  # bool[B] the row wants its sampled token's logprobs
    want_prompt: jax.Array  # bool[B] the row wants every position's logprob of its target


class PoolContext:
    """The ``transformer.prefill`` context of one chunk step: layer ``i``'s chunk KV is written into the rows'
    prefill pages, and every key of the rows' pages comes back densely (``[B, P * page_size, ...]``, dequantized to
    ``dtype``), key s at position s. Generic over the layer's KV parts (the pool's per-layer pytree)."""

    def __init__(self, pool: PagePool, batch: ChunkBatch, dtype: Any):
        self.layers = list(pool.layers)
        self.batch, self.dtype = batch, dtype

    def __call__(self, i: int, kv: Any) -> Any:
        b = self.batch
        with jax.named_scope("page_write"):
            self.layers[i] = write_layer(self.layers[i], kv, b.page_table, b.positions, b.valid)
        with jax.named_scope("attention"):  # the keys read back for the chunk's attention, as decode's gather
            return gather_layer(self.layers[i], b.page_table, self.dtype)


def chunk_step(params: Params, cfg: ModelConfig, pool: PagePool, batch: ChunkBatch, top: int = 1, *,
               kd: KernelDispatch = DIRECT) -> tuple[jax.Array, PagePool, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """One chunk per row (see the module docstring): (sampled i32[B], the prefill pool with the chunks written,
    the sampled tokens' logprobs ``(f32[B], f32[B, top], i32[B, top])``, every position's logprob of its target
    ``(f32[B, C], f32[B, C, top], i32[B, C, top])``); logprobs read zeros where no row asked. ``kd``: the step's
    kernel dispatch (``phaseserve.kernel_mesh``)."""
    ctx = PoolContext(pool, batch, params.embed.dtype)
    x, _ = prefill_hidden(params, cfg, batch.tokens, batch.lengths, batch.positions, context=ctx, kd=kd)
    logits = logits_from_hidden(params, cfg, jnp.take_along_axis(x, batch.last[:, None, None], axis=1)[:, 0], kd=kd)
    with jax.named_scope("sampling"):
        first = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps)
        gen = token_logprobs(logits, first, batch.want_logprobs, top)
    with jax.named_scope("prompt_logprobs"):
        scored = batch.want_prompt[:, None] & batch.valid
        prompt = token_logprobs(lambda: logits_from_hidden(params, cfg, x, kd=kd), batch.targets, scored, top)
    return first, pool.replace(layers=tuple(ctx.layers)), gen, prompt
