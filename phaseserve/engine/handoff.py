"""Prefill -> decode KV handoff, in whole pages.

When a prompt's last chunk is done, its KV sits in the prefill pool's pages (prefill KV dtype, BF16 in the design).
:func:`export_pages` reads those pages on the prefill mesh and quantizes them to the decode cache's storage dtype
(FP8 with per-token scales, as the decode pool stores them); only the pages the request computed cross (pages of a
shared prefix are already in the decode pool), and nothing but whole pages crosses -- no padded ``[B, T]`` arrays::

    payload, per layer: [(values [1, n * page_size, ...], scale [1, n * page_size, ...] | None), ...]
                        (pages concatenated, several requests' pages in one payload)

A :class:`Handoff` moves the payload to the decode devices; :func:`import_pages` writes it, without re-quantizing,
into the destination pages (page ids of 0 -- padding -- write nothing). The same two functions run the other way
for a prefix hit (decode pool pages -> the request's first prefill pages, dequantized to the prefill KV dtype), and
the multi-process servers ship the same payload over ``jax.experimental.transfer`` (``phaseserve.serving``).

:func:`page_bucket` / :func:`trim` / :func:`pad` keep the jitted shapes to a handful while the bytes that cross are
exactly the pages: export runs at a bucketed page count and the payload is trimmed to the real pages before the
transfer, then padded back on the receiving side.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from phaseserve.cache.paged import PagePool, gather_layer, write_prequantized
from phaseserve.engine.prefill import quantize_layer_kv


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


def export_pages(pool: PagePool, pages: jax.Array, dtype: Any) -> list:
    """The KV of ``pages`` i32[n] (every layer), quantized to ``dtype``: the payload of the module docstring with
    ``n * page_size`` tokens. Page 0 (padding) reads the null page's zeros."""
    pt = pages[None]
    return [quantize_layer_kv(gather_layer(layer, pt, jnp.float32), dtype, jnp.float32) for layer in pool.layers]


def import_pages(pool: PagePool, payload: list, pages: jax.Array) -> PagePool:
    """Write a payload of ``n * page_size`` tokens (already in the pool's storage dtype) into ``pages`` i32[n]
    (ids outside ``[1, N)`` write nothing). Jitted with the pool donated."""
    n_tok = pages.shape[0] * pool.page_size
    pos = jnp.arange(n_tok, dtype=jnp.int32)[None]
    valid = jnp.ones((1, n_tok), bool)
    return pool.replace(layers=tuple(write_prequantized(layer, parts, pages[None], pos, valid)
                                     for layer, parts in zip(pool.layers, payload, strict=True)))


def page_bucket(n: int) -> int:
    """Padded page count for the jitted export/import: a power of two up to 16, then a multiple of 16."""
    return 1 << max(n - 1, 0).bit_length() if n <= 16 else -(-n // 16) * 16


def trim(payload: list, num_tokens: int) -> list:
    """The payload's first ``num_tokens`` tokens (the real pages; the rest is bucket padding)."""
    return jax.tree.map(lambda x: x[:, :num_tokens], payload)


def pad(payload: list, num_tokens: int) -> list:
    """The payload padded with zeros to ``num_tokens`` tokens (to a bucketed shape on the receiving side)."""
    return jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, num_tokens - x.shape[1])] + [(0, 0)] * (x.ndim - 2)),
                        payload)


def kv_nbytes(kvq: Any) -> int:
    """Bytes of a handoff payload (every array leaf, scales included)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kvq))
