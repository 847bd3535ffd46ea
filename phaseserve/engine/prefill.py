"""The prefill worker's step: a batched causal pass over right-padded prompts on the prefill mesh.

It runs the prefill weight representation, takes the logits only at each row's last prompt token, samples
the first output token, and quantizes the prompt's KV (computed in the activation dtype, BF16 in the design)
into the decode cache's storage dtype *before* it leaves the prefill mesh, so FP8 KV crosses the wire::

    step(params, batch) -> (first_tokens i32[B], kvq)
    kvq: per layer, a list of (values, scale | None) pairs -- GQA [(k, k_scale), (v, v_scale)], MLA [(latent, scale)]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from phaseserve.cache.paged import quantize_kv
from phaseserve.config import ModelConfig
from phaseserve.engine.sampling import sample
from phaseserve.model.params import Params
from phaseserve.model.transformer import prefill


@struct.dataclass
class PrefillBatch:
    tokens: jax.Array  # i32[B, T] right-padded
    lengths: jax.Array  # i32[B] valid tokens (0 for padding rows)
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seeds: jax.Array  # u32[B]
    steps: jax.Array  # i32[B] index of the sampled token in the request's output


def quantize_layer_kv(kv: Any, kv_dtype, compute_dtype) -> list[tuple[jax.Array, jax.Array | None]]:
    """One layer's prefill KV, rounded to the prefill KV dtype, -> [(values, scale)] in the decode storage dtype."""
    parts = list(kv) if isinstance(kv, tuple) else [kv]
    return [quantize_kv(x.astype(compute_dtype), kv_dtype) for x in parts]


def prefill_step(params: Params, cfg: ModelConfig, batch: PrefillBatch, *, kv_dtype,
                 prefill_kv_dtype) -> tuple[jax.Array, list]:
    """kv_dtype: the decode cache's storage dtype; prefill_kv_dtype: the dtype the prompt's KV is computed in
    (``QuantConfig.prefill_kv_dtype``, BF16 in the design) before it is quantized for the handoff."""
    last = jnp.maximum(batch.lengths - 1, 0)
    logits, kvs = prefill(params, cfg, batch.tokens, batch.lengths, logits_at=last)
    first = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps)
    return first, [quantize_layer_kv(kv, kv_dtype, prefill_kv_dtype) for kv in kvs]
