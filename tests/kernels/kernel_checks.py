"""Shared helpers for the kernel tests: random paged pools poisoned outside the valid tokens, error norms.

Interpret mode fills every pallas_call output and scratch buffer with NaN before the kernel runs
(``test_interpret_mode_poisons_unwritten_outputs`` pins that), so an element a kernel forgets to write
fails ``assert_close``, which requires finite outputs. The pools built here are poisoned too: every
page slot that no row may read (slots past a row's length, pages no row owns) holds NaN, and page-table
entries past a row's length point at poisoned or out-of-range pages.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

TOL = {"float32": 1e-5, "bfloat16": 1e-2}  # relative Frobenius-norm error vs the f32 reference


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), f"{np.size(out) - np.isfinite(out).sum()} non-finite (unwritten/poisoned) elements"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(out, ref, tol: float):
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e} >= {tol:.1e}"


@dataclasses.dataclass
class Pool:
    pages: list  # one [P, S, *row] array per tensor (K and V share one layout)
    scales: list  # f32[P, S, *row[:-1]] per tensor, or None entries (non-FP8)
    page_table: jnp.ndarray  # i32[B, max_pages]
    lengths: jnp.ndarray  # i32[B]


def build_pool(rng: np.random.Generator, lengths, page_size: int, max_pages: int, row: tuple[int, ...], dtype,
               count: int = 1, spare: int = 3) -> Pool:
    """``count`` tensors on one page layout: each row's tokens on distinct random pages, NaN where no row reads."""
    need = [cdiv(n, page_size) for n in lengths]
    assert max(need) <= max_pages
    num_pages = sum(need) + spare
    perm = rng.permutation(num_pages)
    readable = np.zeros((num_pages, page_size), bool)
    table = np.empty((len(lengths), max_pages), np.int64)
    start = 0
    for b, n in enumerate(lengths):
        ids = perm[start:start + need[b]]
        start += need[b]
        table[b, :need[b]] = ids
        for t in range(n):
            readable[ids[t // page_size], t % page_size] = True
        # past the length: any page (including spare poisoned ones) or an out-of-range id
        table[b, need[b]:] = rng.integers(-2, num_pages + 3, size=max_pages - need[b])
    pages, scales = [], []
    for _ in range(count):
        vals = rng.standard_normal((num_pages, page_size, *row)).astype(np.float32)
        sc = None
        if jnp.dtype(dtype) == jnp.float8_e4m3fn:
            amax = np.abs(vals).max(axis=-1)
            sc = (amax / 448.0 * rng.uniform(1.0, 1.5, amax.shape)).astype(np.float32)
            vals = np.asarray(jnp.asarray(vals / sc[..., None]).astype(dtype)).astype(np.float32)
            sc[~readable] = np.nan
            sc = jnp.asarray(sc)
        vals[~readable] = np.nan
        pages.append(jnp.asarray(vals).astype(dtype))
        scales.append(sc)
    return Pool(pages, scales, jnp.asarray(table, jnp.int32), jnp.asarray(np.asarray(lengths), jnp.int32))


def gather_dense(pool: Pool, b: int, which: int = 0) -> np.ndarray:
    """f64[length, *row]: row b's tokens of tensor ``which``, dequantized, read token by token from the pool."""
    s = pool.pages[which].shape[1]
    pages = np.asarray(pool.pages[which].astype(jnp.float32), np.float64)
    scales = None if pool.scales[which] is None else np.asarray(pool.scales[which], np.float64)
    table = np.asarray(pool.page_table)
    rows = []
    for t in range(int(pool.lengths[b])):
        page, slot = table[b, t // s], t % s
        x = pages[page, slot]
        rows.append(x if scales is None else x * scales[page, slot][..., None])
    return np.stack(rows) if rows else np.zeros((0, *pages.shape[2:]))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
