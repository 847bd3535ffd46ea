"""Expert-aligned row tiles for the grouped (MoE) kernels: every M tile holds rows of exactly one expert.

Rows of ``x [M, K]`` arrive sorted by expert (``group_sizes i32[E]``). Instead of tiling M blindly (a tile
then straddles several experts and each must be computed with the other experts' rows masked out), the
wrapper gathers each expert's rows into its own ``bm``-row tiles (vLLM's ``moe_align_block_size``):

::

    x rows:  | e0 e0 e0 | e2 | e3 e3 e3 e3 e3 |          (e1 empty)          bm = 4
    tiles:   [e0 e0 e0 -][e2 - - -][e3 e3 e3 e3][e3 - - -][unused][unused]  ("-": zero row, never stored back)

so a kernel program computes one tile of one expert: it reads that expert's weight tile and no other, and
computes no row of another expert. The number of tiles is at most ``cdiv(M, bm) + min(E, M)`` (each
non-empty expert wastes less than one tile), a static bound; unused tiles are flagged invalid and repeat the
last used tile's expert so that a pipelined kernel (TPU) fetches no new weight block for them. The gather of
x and of the output rows runs in XLA; it moves activation-sized data (``T * bm * K``), not weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import cdiv


def num_tiles(m: int, num_experts: int, bm: int) -> int:
    """Static upper bound on the expert-aligned tiles of M rows over E experts."""
    return cdiv(m, bm) + min(num_experts, m)


def group_boundaries(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """i32[E] -> (starts, ends) row ranges, clipped to [0, m] (rows past sum(group_sizes) belong to no group)."""
    ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def align_rows(group_sizes: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Expert-aligned tiling of M sorted rows.

    Returns ``(tile_expert, tile_valid, src, dest)``: ``tile_expert i32[T]`` (the expert of each tile; unused
    tiles repeat the last used one), ``tile_valid i32[T]`` (1 for used tiles), ``src i32[T * bm]`` (the x row
    feeding each tile row, ``m`` for a padding row: callers append one zero row to x), ``dest i32[M]`` (the
    tile row holding each x row's output, ``T * bm`` for rows of no expert: callers append one zero row).
    """
    num_experts = group_sizes.shape[0]
    t = num_tiles(m, num_experts, bm)
    starts, ends = group_boundaries(group_sizes, m)
    tiles = (ends - starts + bm - 1) // bm  # i32[E]
    cum = jnp.cumsum(tiles)
    first = cum - tiles  # first tile of each expert
    used = cum[-1]
    tid = jnp.arange(t, dtype=jnp.int32)
    e = jnp.minimum(jnp.searchsorted(cum, tid, side="right"), num_experts - 1).astype(jnp.int32)
    last = jnp.minimum(jnp.searchsorted(cum, jnp.maximum(used - 1, 0), side="right"), num_experts - 1)
    valid = tid < used
    tile_expert = jnp.where(valid, e, last).astype(jnp.int32)
    rows = starts[e][:, None] + (tid - first[e])[:, None] * bm + jnp.arange(bm, dtype=jnp.int32)[None, :]
    src = jnp.where(valid[:, None] & (rows < ends[e][:, None]), rows, m).reshape(-1)
    row = jnp.arange(m, dtype=jnp.int32)
    re = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_experts - 1)
    dest = jnp.where(row < ends[-1], first[re] * bm + row - starts[re], t * bm)
    return tile_expert, valid.astype(jnp.int32), src.astype(jnp.int32), dest.astype(jnp.int32)


def gather_tiles(x: jax.Array, src: jax.Array) -> jax.Array:
    """x [M, K] -> [T * bm, K]: the tile rows (zeros for padding rows)."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[src]


def scatter_back(out_tiles: jax.Array, dest: jax.Array) -> jax.Array:
    """[T * bm, N] -> [M, N]: each x row's output (zeros for rows of no expert, as ``lax.ragged_dot``)."""
    return jnp.concatenate([out_tiles, jnp.zeros((1, out_tiles.shape[1]), out_tiles.dtype)])[dest]
