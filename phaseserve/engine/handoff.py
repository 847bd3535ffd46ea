"""Prefill -> decode KV handoff, in whole pages.

When a prompt's last chunk is done, its KV sits in the prefill pool's pages (prefill KV dtype, BF16 in the design).
:func:`export_pages` reads those pages on the prefill mesh and quantizes them to the decode cache's storage dtype
(FP8 with per-token scales, as the decode pool stores them); only the pages the request computed cross (pages of a
shared prefix are already in the decode pool), and nothing but whole pages crosses -- no padded ``[B, T]`` arrays::

    payload, per layer: [(values [1, n * page_size, ...], scale [1, n * page_size, ...] | None), ...]
                        (pages concatenated, several requests' pages in one payload; in process, a list of
                        such payloads, one per chunk of :func:`page_chunks`)

A :class:`Handoff` moves the payload to the decode devices; :func:`import_pages` writes it, without re-quantizing,
into the destination pages (page ids of 0 -- padding -- write nothing). The same two functions run the other way
for a prefix hit (decode pool pages -> the request's first prefill pages, dequantized to the prefill KV dtype), and
the Ray actors (``phaseserve.distributed``) ship the same payload over ``jax.experimental.transfer``.

:func:`page_chunks` keeps the jitted shapes to a handful without padding what crosses: ``n`` pages are exported and
imported as power-of-two chunks (``n = 11`` -> 8 + 2 + 1 pages), so export and import compile once per chunk size
(at most ``log2(max pages) + 1`` sizes, all compiled by the engine's warm-up) rather than once per page count, and
the bytes that cross are exactly the pages. An in-process payload is the list of its chunks' payloads. Across
processes a payload crosses as one ``[T, ...]`` array per leaf (:func:`join_chunks` / :func:`split_chunks` convert;
those shapes follow the page count).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.cache.paged import PagePool, gather_layer, quantize_kv, write_prequantized


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


def quantize_layer_kv(kv: Any, kv_dtype, compute_dtype) -> list[tuple[jax.Array, jax.Array | None]]:
    """One layer's KV (as the model returns it), rounded to ``compute_dtype`` -> [(values, scale | None)] in
    ``kv_dtype`` (per-token scales for FP8)."""
    parts = list(kv) if isinstance(kv, tuple) else [kv]
    return [quantize_kv(x.astype(compute_dtype), kv_dtype) for x in parts]


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


def page_chunks(n: int) -> list[int]:
    """``n`` pages as power-of-two chunk sizes, largest first: 11 -> [8, 2, 1]; 0 -> []."""
    return [1 << i for i in reversed(range(n.bit_length())) if n >> i & 1]


def join_chunks(chunks: list[list]) -> list:
    """Chunk payloads -> one payload of all their tokens (per leaf, concatenated along the token axis)."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *chunks)


def split_chunks(payload: list, page_size: int) -> list[list]:
    """One payload of ``n * page_size`` tokens -> the chunk payloads of :func:`page_chunks` (inverse of
    :func:`join_chunks`)."""
    n = jax.tree.leaves(payload)[0].shape[1] // page_size
    out, start = [], 0
    for size in page_chunks(n):
        out.append(jax.tree.map(lambda x, a=start * page_size, b=(start + size) * page_size: x[:, a:b], payload))
        start += size
    return out


def kv_nbytes(kvq: Any) -> int:
    """Bytes of a handoff payload (every array leaf, scales included)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kvq))


def export_paged(fn: Any, pool: Any, pages: list[int], dtype: str) -> list[list]:
    """``fn`` (jitted :func:`export_pages`) once per power-of-two chunk of ``pages``: the chunk payloads."""
    out, start = [], 0
    for size in page_chunks(len(pages)):
        out.append(fn(pool, np.asarray(pages[start:start + size], np.int32), dtype))
        start += size
    return out


def import_paged(fn: Any, pool: Any, pages: list[int], chunks: list[list]) -> Any:
    """``fn`` (jitted :func:`import_pages`, pool donated) once per chunk payload of :func:`export_paged`."""
    sizes = page_chunks(len(pages))
    if len(sizes) != len(chunks):
        raise ValueError(f"{len(pages)} pages come in {len(sizes)} chunks, got {len(chunks)}")
    start = 0
    for size, payload in zip(sizes, chunks, strict=True):
        pool = fn(pool, payload, np.asarray(pages[start:start + size], np.int32))
        start += size
    return pool
