"""The device page pool of the decode cache: a pytree of per-layer pages, quantized writes, dequantized gathers.

Layout (one page id addresses the same ``page_size`` token slots in every layer; ``N = num_pages``)::

    PagePool.layers[l]                                   GQA (K and V separately)            MLA (one latent)
      data     [N, page_size, ...]   storage dtype       k, v    [N, S, num_kv_heads, hd]     latent [N, S, W]
      scale    f32[N, page_size, ...] (FP8 only)         k_scale, v_scale [N, S, num_kv_heads] scale [N, S]
                                                                                  W = kv_lora_rank + qk_rope_head_dim
    page_table row of a request:  [ 7 | 3 | 12 | 0 | 0 ]      (0 = reserved null page, padding)
    token t  ->  page_table[t // S], slot t % S;  the whole request is  concat(pages[7], pages[3], pages[12])[:len]

The pool is a list of layers rather than one array with a stacked layer axis because the decode step walks the
layers in a Python loop (as the model does): each layer's pages are separate buffers, donated and updated in
place, and the attention kernel of layer ``l`` receives exactly its own ``[N, S, ...]`` arrays.

Storage dtype is ``"float32"``, ``"bfloat16"`` or ``"float8_e4m3fn"``. FP8 is quantized on write with one f32 scale
per token and head (per token for the MLA latent): ``scale = max(absmax / 448, 1e-12)`` -- never zero, even for an
all-zero token -- and dequantized on read as ``q * scale``. Finite input never produces NaN: values are clipped to
+-448 before the cast. Writes drop (write nothing) for masked rows, positions past the page table, and page ids
outside ``[1, N)``: the null page is never written, so padding rows always read finite zeros.
On XLA:CPU the BF16 and FP8 arrays hold their raw bits (uint16, uint8; :func:`storage_dtype`) so that a write
updates the pool in place; :func:`take_pages`, :func:`gather_layer` and :func:`as_values` give values back.

Memory accounting for the planner and the benchmarks: :func:`kv_bytes_per_token`, :func:`kv_bytes_per_page`,
:func:`pages_for_budget` (scale bytes included). On GLM-5 every layer with its own DSA indexer also keeps one
index key per token (``MLAPages.index`` [N, S, index_head_dim], FP8 with one f32 scale per token in an FP8 pool)
under the same page ids, so the page table, the tags, the writes, the handoff and the clears cover it like the
latent; :func:`indexer_bytes_per_token` counts it (``include_indexer=False``: the latent alone).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from phaseserve.config import ModelConfig, canonical_dtype, to_dtype

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # scale floor: all-zero tokens still get a positive scale
SCALE_BYTES = 4  # f32


def is_scaled(kv_dtype: str) -> bool:
    """True for storage dtypes that carry per-token scales (FP8)."""
    return canonical_dtype(kv_dtype) == "float8_e4m3fn"


@struct.dataclass
class GQAPages:
    """One layer of GQA pages."""

    k: jax.Array  # [N, S, KV, hd]
    v: jax.Array  # [N, S, KV, hd]
    k_scale: jax.Array | None = None  # f32[N, S, KV] (FP8 only)
    v_scale: jax.Array | None = None  # f32[N, S, KV]


@struct.dataclass
class MLAPages:
    """One layer of MLA latent pages."""

    latent: jax.Array  # [N, S, kv_lora_rank + qk_rope_head_dim]
    scale: jax.Array | None = None  # f32[N, S] (FP8 only)
    index: jax.Array | None = None  # [N, S, index_head_dim] GLM-5 DSA index keys (layers with their own indexer)
    index_scale: jax.Array | None = None  # f32[N, S] (FP8 only)


@struct.dataclass
class PagePool:
    """The whole decode cache: one page set per layer; ``page_size`` and ``kv_dtype`` are static."""

    layers: tuple[GQAPages | MLAPages, ...]
    page_size: int = struct.field(pytree_node=False)
    kv_dtype: str = struct.field(pytree_node=False)

    @property
    def num_pages(self) -> int:
        first = self.layers[0]
        return (first.latent if isinstance(first, MLAPages) else first.k).shape[0]


# ---- quantization -----------------------------------------------------------------------------------------
def quantize_kv(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array | None]:
    """x [..., D] -> (stored [..., D] in ``dtype``, f32 scale [...] or None). Scales over the last axis."""
    dtype = jnp.dtype(dtype)
    if dtype != jnp.float8_e4m3fn:
        return x.astype(dtype), None
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / FP8_MAX, MIN_SCALE)
    q = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(dtype)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array | None, dtype: Any = jnp.float32) -> jax.Array:
    """stored [..., D], scale f32[...] | None -> [..., D] in ``dtype``."""
    if scale is None:
        return q.astype(dtype)
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


# ---- construction -----------------------------------------------------------------------------------------
def init_pool(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype: str = "float8_e4m3fn") -> PagePool:
    """A zeroed pool (scales 1) of ``num_pages`` pages, page 0 being the null page."""
    kv_dtype = canonical_dtype(kv_dtype)
    dt = storage_dtype(kv_dtype)
    scaled = is_scaled(kv_dtype)
    n, s = num_pages, page_size
    layers = []
    for layer in range(cfg.num_layers):
        if cfg.is_mla:
            index = has_index_keys(cfg, layer)
            layers.append(MLAPages(latent=jnp.zeros((n, s, cfg.kv_cache_width), dt),
                                   scale=jnp.ones((n, s), jnp.float32) if scaled else None,
                                   index=jnp.zeros((n, s, cfg.index_head_dim), dt) if index else None,
                                   index_scale=jnp.ones((n, s), jnp.float32) if index and scaled else None))
        else:
            shape = (n, s, cfg.num_kv_heads, cfg.head_dim)
            ks = jnp.ones(shape[:3], jnp.float32) if scaled else None
            vs = jnp.ones(shape[:3], jnp.float32) if scaled else None
            layers.append(GQAPages(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), k_scale=ks, v_scale=vs))
    return PagePool(layers=tuple(layers), page_size=page_size, kv_dtype=kv_dtype)


def has_index_keys(cfg: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` caches GLM-5 DSA index keys (a layer that runs its own indexer)."""
    return cfg.index_topk is not None and cfg.indexer_types[layer] == "full"


def _pairs(layer: GQAPages | MLAPages) -> list[tuple[jax.Array, jax.Array | None]]:
    if isinstance(layer, MLAPages):
        index = [] if layer.index is None else [(layer.index, layer.index_scale)]
        return [(layer.latent, layer.scale)] + index
    return [(layer.k, layer.k_scale), (layer.v, layer.v_scale)]


def _rebuild(layer: GQAPages | MLAPages, pairs: list[tuple[jax.Array, jax.Array | None]]):
    if isinstance(layer, MLAPages):
        index = pairs[1] if len(pairs) > 1 else (None, None)
        return layer.replace(latent=pairs[0][0], scale=pairs[0][1], index=index[0], index_scale=index[1])
    (k, ks), (v, vs) = pairs
    return layer.replace(k=k, k_scale=ks, v=v, v_scale=vs)


def _values(layer: GQAPages | MLAPages, kv: Any) -> list[jax.Array]:
    """kv as the layer stores it: GQA ``(k, v)``; MLA the latent, or ``(latent, index keys)`` with DSA keys."""
    return list(kv) if isinstance(kv, tuple) else [kv]


# ---- writes -----------------------------------------------------------------------------------------------
def slot_indices(page_table: jax.Array, positions: jax.Array, valid: jax.Array, num_pages: int,
                 page_size: int) -> jax.Array:
    """Flat slot index ``page * S + pos % S`` per token, or ``N * S`` (out of bounds: dropped) where invalid.

    page_table i32[B, P], positions i32[B, T], valid bool[B, T] -> i32[B, T]. Invalid also covers positions past
    the page table and page ids outside ``[1, N)`` (the null page and corrupt entries are never written).
    """
    p = page_table.shape[1]
    idx = positions // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(idx, 0, p - 1), axis=1)
    ok = valid & (positions >= 0) & (idx < p) & (page > 0) & (page < num_pages)
    return jnp.where(ok, page * page_size + positions % page_size, num_pages * page_size)


def storage_dtype(kv_dtype: str, backend: str | None = None) -> jnp.dtype:
    """The dtype of a pool's value arrays for ``kv_dtype``: the dtype itself, except BF16 and FP8 on XLA:CPU
    (``backend``, default JAX's), which are held as their raw bits (uint16, uint8). XLA:CPU has no BF16/FP8 scatter
    (it converts the whole array to f16/f32 and back) and materializes every bitcast-convert, so a write into such
    a pool cost two pool-sized copies per array and layer; a raw-bit array is scattered in place. Readers get
    values back with :func:`as_values` on the rows they gathered."""
    dt = jnp.dtype(to_dtype(kv_dtype))
    if dt.itemsize >= 4 or (backend or jax.default_backend()) != "cpu":
        return dt
    return jnp.dtype(f"uint{8 * dt.itemsize}")


_RAW_VALUES = {1: jnp.dtype(jnp.float8_e4m3fn), 2: jnp.dtype(jnp.bfloat16)}  # raw-bit itemsize -> values


def value_dtype(dtype: Any) -> jnp.dtype:
    """The dtype of the values a pool array of ``dtype`` holds (raw uint8 / uint16 bits: FP8 / BF16)."""
    dtype = jnp.dtype(dtype)
    return _RAW_VALUES[dtype.itemsize] if jnp.issubdtype(dtype, jnp.unsignedinteger) else dtype


def as_values(a: jax.Array) -> jax.Array:
    """A pool array (or rows gathered from one) as values: raw bits reinterpreted, others unchanged. On a whole
    pool array this is a pool-sized copy on XLA:CPU: gather the rows first (:func:`take_pages`)."""
    vd = value_dtype(a.dtype)
    return a if vd == a.dtype else jax.lax.bitcast_convert_type(a, vd)


def as_stored(x: jax.Array, dtype: Any) -> jax.Array:
    """Values ``x`` in a pool array's ``dtype``: cast to its value dtype, then to raw bits where it holds them."""
    dtype = jnp.dtype(dtype)
    x = x.astype(value_dtype(dtype))
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _scatter_bits(data: jax.Array, flat: jax.Array, values: jax.Array) -> jax.Array:
    """``data.at[flat].set(values, mode="drop")`` in place (raw-bit arrays: see :func:`storage_dtype`). One row
    (n == 1) gets a second, dropped row: XLA turns a one-index scatter into a dynamic-update-slice that copies the
    whole array. data [M, ...], flat i32[n], values [n, ...] (values, cast to data's value dtype)."""
    if flat.shape[0] == 1:
        flat = jnp.concatenate([flat, jnp.full((1,), data.shape[0], flat.dtype)])
        values = jnp.concatenate([values, values])
    return data.at[flat].set(as_stored(values, data.dtype), mode="drop")


def take_pages(data: jax.Array, page_table: jax.Array) -> jax.Array:
    """``data[clip(page_table)]`` as values (raw bits reinterpreted after the gather, never the whole pool):
    data [N, S, ...], page_table i32[B, P] -> [B, P, S, ...]."""
    return as_values(data[jnp.clip(page_table, 0, data.shape[0] - 1)])


def write_prequantized(layer: GQAPages | MLAPages, parts: list[tuple[jax.Array, jax.Array | None]],
                       page_table: jax.Array, positions: jax.Array, valid: jax.Array) -> GQAPages | MLAPages:
    """Scatter tokens already in the storage dtype into one layer's pages (no re-quantization).

    parts: ``[(values, scale | None)]`` -- MLA one pair ([B, T, W], [B, T]); GQA two pairs, K then V
    ([B, T, KV, hd], [B, T, KV]); page_table i32[B, P]; positions i32[B, T]; valid bool[B, T] (False: nothing).
    The prefill->decode handoff uses this directly: prompts are quantized on the prefill mesh.
    """
    data0 = _pairs(layer)[0][0]
    n, s = data0.shape[:2]
    flat = slot_indices(page_table, positions, valid, n, s).reshape(-1)
    out = []
    for (data, scale), (q, sc) in zip(_pairs(layer), parts, strict=True):
        tail = data.shape[2:]
        data = _scatter_bits(data.reshape(n * s, *tail), flat, q.reshape(-1, *tail)).reshape(data.shape)
        if scale is not None:
            scale = _scatter_bits(scale.reshape(n * s, *tail[:-1]), flat, sc.reshape(-1, *tail[:-1]))
            scale = scale.reshape(data.shape[:-1])
        out.append((data, scale))
    return _rebuild(layer, out)


def write_layer(layer: GQAPages | MLAPages, kv: Any, page_table: jax.Array, positions: jax.Array,
                valid: jax.Array) -> GQAPages | MLAPages:
    """Quantize and scatter tokens into one layer's pages.

    kv: GQA ``(k, v)`` each [B, T, KV, hd], or the MLA latent [B, T, W]; page_table i32[B, P];
    positions i32[B, T] (sequence position of each token); valid bool[B, T] (False: write nothing).
    """
    parts = [quantize_kv(x, value_dtype(data.dtype))
             for (data, _), x in zip(_pairs(layer), _values(layer, kv), strict=True)]
    return write_prequantized(layer, parts, page_table, positions, valid)


def write_prompt(pool: PagePool, kvs: list[Any], page_table: jax.Array, lengths: jax.Array,
                 start: jax.Array | None = None) -> PagePool:
    """Write whole prompts' KV (as ``prefill`` returns it) into the requests' pages, all layers.

    kvs: per layer ``(k, v)`` [B, T, KV, hd] or latent [B, T, W], token ``t`` being position ``t``;
    page_table i32[B, P]; lengths i32[B] (tokens to write); start i32[B] | None (skip positions below it, e.g. a
    shared prefix already in the cache). Jittable.
    """
    t = _values(pool.layers[0], kvs[0])[0].shape[1]
    b = page_table.shape[0]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = pos < lengths[:, None]
    if start is not None:
        valid &= pos >= start[:, None]
    return pool.replace(layers=tuple(write_layer(layer, kv, page_table, pos, valid)
                                     for layer, kv in zip(pool.layers, kvs, strict=True)))


def write_token_layer(layer: GQAPages | MLAPages, kv: Any, page_table: jax.Array, positions: jax.Array,
                      mask: jax.Array) -> GQAPages | MLAPages:
    """Decode write of one new token per row into one layer.

    kv: ``(k, v)`` each [B, KV, hd] or latent [B, W]; page_table i32[B, P]; positions i32[B]; mask bool[B]
    (False -- integrity-failed or padding rows -- writes nothing).
    """
    kv1 = jax.tree.map(lambda x: x[:, None], kv)
    return write_layer(layer, kv1, page_table, positions[:, None], mask[:, None])


def write_token(pool: PagePool, kvs: list[Any], page_table: jax.Array, positions: jax.Array,
                mask: jax.Array) -> PagePool:
    """:func:`write_token_layer` for every layer (kvs: per layer)."""
    return pool.replace(layers=tuple(write_token_layer(layer, kv, page_table, positions, mask)
                                     for layer, kv in zip(pool.layers, kvs, strict=True)))


def clear_pages(pool: PagePool, pages: jax.Array) -> PagePool:
    """Zero the data and reset scales to 1 of ``pages`` i32[n] in every layer (ids outside [1, N) are ignored).

    Used to scrub pages that held non-finite values before they go back to the free queue.
    """
    n = pool.num_pages
    idx = jnp.where((pages > 0) & (pages < n), pages, n)
    out = []
    for layer in pool.layers:
        pairs = [(d.at[idx].set(0, mode="drop"), None if sc is None else sc.at[idx].set(1.0, mode="drop"))
                 for d, sc in _pairs(layer)]
        out.append(_rebuild(layer, pairs))
    return pool.replace(layers=tuple(out))


# ---- reads ------------------------------------------------------------------------------------------------
def gather_layer(layer: GQAPages | MLAPages, page_table: jax.Array, dtype: Any = jnp.float32) -> Any:
    """Dense dequantized KV of every row's pages: page_table i32[B, P] -> ``(k, v)`` [B, P*S, KV, hd] or
    latent [B, P*S, W]. Entries are clipped into range (mask failing rows' tables first); callers mask by length.
    """
    out = []
    for data, scale in _pairs(layer):
        n, s = data.shape[:2]
        pt = jnp.clip(page_table, 0, n - 1)
        b, p = pt.shape
        d = as_values(data[pt]).reshape(b, p * s, *data.shape[2:])
        sc = None if scale is None else scale[pt].reshape(b, p * s, *scale.shape[2:])
        out.append(dequantize_kv(d, sc, dtype))
    return out[0] if len(out) == 1 else tuple(out)


def gather_request(pool: PagePool, page_row: np.ndarray, length: int, dtype: Any = jnp.float32) -> list[Any]:
    """One request's KV back, densely, per layer: ``(k, v)`` [length, KV, hd] or latent [length, W].

    page_row i32[P] (host or device). For tests and references; not meant for the hot path.
    """
    pt = jnp.asarray(page_row, jnp.int32)[None]
    return [jax.tree.map(lambda x: x[0, :length], gather_layer(layer, pt, dtype)) for layer in pool.layers]


# ---- memory accounting ------------------------------------------------------------------------------------
def _layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(values, scales) stored per token per layer."""
    if cfg.is_mla:
        return cfg.kv_cache_width, 1
    return 2 * cfg.num_kv_heads * cfg.head_dim, 2 * cfg.num_kv_heads


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, *, include_indexer: bool = True) -> int:
    """Bytes of decode cache per token over all layers, FP8 scale bytes included.

    MLA: ``layers * (kv_lora_rank + rope) * itemsize`` (+ 4 bytes per layer for FP8); GQA: K and V for every KV
    head (+ 4 bytes per head and per K/V for FP8). ``include_indexer`` adds :func:`indexer_bytes_per_token` (what the
    pool stores for GLM-5's DSA index keys).
    """
    values, scales = _layer_counts(cfg)
    item = to_dtype(kv_dtype).itemsize
    per_layer = values * item + (scales * SCALE_BYTES if is_scaled(kv_dtype) else 0)
    extra = indexer_bytes_per_token(cfg, kv_dtype) if include_indexer else 0
    return cfg.num_layers * per_layer + extra


def indexer_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """GLM-5 DSA index keys cached per token (0 for models without an indexer): ``index_head_dim`` values in
    ``kv_dtype`` plus one f32 scale for FP8 (as DeepSeek-V3.2's FP8 indexer cache), per layer with its own indexer."""
    layers = sum(has_index_keys(cfg, i) for i in range(cfg.num_layers)) if cfg.is_mla else 0
    item = to_dtype(kv_dtype).itemsize
    return layers * (cfg.index_head_dim * item + (SCALE_BYTES if is_scaled(kv_dtype) else 0))


def kv_bytes_per_page(cfg: ModelConfig, kv_dtype: str, page_size: int, *, include_indexer: bool = True) -> int:
    """Bytes of one page id across every layer (``page_size`` tokens)."""
    return page_size * kv_bytes_per_token(cfg, kv_dtype, include_indexer=include_indexer)


def pages_for_budget(cfg: ModelConfig, kv_dtype: str, page_size: int, budget_bytes: int, *,
                     include_indexer: bool = True) -> int:
    """How many pages (the null page included, as ``CacheConfig.num_pages``) fit in ``budget_bytes``."""
    return int(budget_bytes) // kv_bytes_per_page(cfg, kv_dtype, page_size, include_indexer=include_indexer)


def pool_nbytes(pool: PagePool) -> int:
    """Actual bytes held by a pool's arrays (equals ``num_pages * kv_bytes_per_page``)."""
    return sum(x.nbytes for x in jax.tree.leaves(pool))
