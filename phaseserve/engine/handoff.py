"""Prefill -> decode KV handoff.

The prefill step hands over each prompt's KV already quantized to the decode cache's storage dtype
(``prefill.quantize_layer_kv``). A :class:`Handoff` moves it to the decode devices; the decode side then
scatters it, without re-quantizing, into the pages the decode allocator gave the request (positions below a
shared prefix are skipped: those pages already hold the same KV). One interface, so a transfer between
processes (``jax.experimental.transfer``) can replace the in-process ``device_put`` without touching the rest.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from phaseserve.cache.paged import PagePool, write_prequantized


class Handoff(Protocol):
    bytes_moved: int

    def transfer(self, kvq: list, dst: jax.sharding.Sharding) -> list: ...


class InProcessHandoff:
    """Same-process handoff: a cross-mesh ``jax.device_put`` (a no-op when both phases share devices)."""

    def __init__(self) -> None:
        self.bytes_moved = 0

    def transfer(self, kvq: list, dst: jax.sharding.Sharding) -> list:
        self.bytes_moved += kv_nbytes(kvq)
        return jax.device_put(kvq, dst)


def scatter_prompts(pool: PagePool, kvq: list, page_table: jax.Array, lengths: jax.Array,
                    start: jax.Array) -> PagePool:
    """Write pre-quantized prompt KV into the pages (decode side, jitted with the pool donated).

    kvq: per layer [(values [B, T, ...], scale [B, T, ...] | None)]; page_table i32[B, P]; lengths i32[B];
    start i32[B] (first position to write: past the shared prefix).
    """
    b, t = page_table.shape[0], jax.tree.leaves(kvq[0])[0].shape[1]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = (pos < lengths[:, None]) & (pos >= start[:, None])
    return pool.replace(layers=tuple(write_prequantized(layer, parts, page_table, pos, valid)
                                     for layer, parts in zip(pool.layers, kvq, strict=True)))


def kv_nbytes(kvq: Any) -> int:
    """Bytes of a handoff payload (every array leaf, scales included)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kvq))
