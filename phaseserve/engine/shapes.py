"""The sizes the workers allocate and compile for: page pools and padded step shapes (host code, no jax arrays).

- Pool sizes: :func:`cache_pages` sizes the decode pool from ``CacheConfig`` (pages, a byte budget, or the documented
  default); :func:`prefill_pages` the prefill pool.
- Bucketing: every step input is padded to one of a handful of shapes, so the jitted steps compile a handful of
  times, not once per size: prefill rows to powers of two (:func:`bucket`), decode rows to :func:`row_bucket`
  sizes, prompt chunks to :func:`chunk_bucket` lengths, page-table widths to :func:`width_bucket`;
  :func:`chunk_groups` splits a step's prompt chunks into batches within the token budget.
- Warm-up: :func:`prefill_shapes` and :func:`decode_shapes` list every padded shape a deployment can use.
"""

from __future__ import annotations

from typing import Any

import jax

from phaseserve.cache.allocator import PageTables
from phaseserve.cache.paged import pages_for_budget
from phaseserve.config import DEFAULT_CPU_KV_BYTES, CacheConfig, ModelConfig
from phaseserve.engine.scheduler import Chunk


def cache_pages(cfg: ModelConfig, cache: CacheConfig, kv_dtype: str, device: jax.Device) -> int:
    """Pages of the decode pool (the null page included): ``cache.num_pages``; else the pages of
    ``cache.kv_budget_bytes``; else ``cache.memory_fraction`` of ``device``'s free memory (call it after the weights
    are placed), or :data:`~phaseserve.config.DEFAULT_CPU_KV_BYTES` where the device reports no memory limit (CPU)."""
    if cache.num_pages is not None:
        return cache.num_pages
    budget = cache.kv_budget_bytes
    if budget is None:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            budget = int(cache.memory_fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
        else:
            budget = DEFAULT_CPU_KV_BYTES
    return pages_for_budget(cfg, kv_dtype, cache.page_size, budget)


def prefill_pages(limits: Any, max_prefill_tokens: int) -> int:
    """Pages of the prefill pool (the null page included): two of the longest prompts a request may bring (so one
    long prompt in progress never blocks the next from starting) plus one step's token budget of short prompts."""
    return 2 * limits.max_pages + -(-max_prefill_tokens // limits.page_size) + 1


def bucket(n: int, lo: int = 1) -> int:
    """Next power of two >= max(n, lo): padded shapes compile a handful of times, not once per size."""
    return max(lo, 1 << max(n - 1, 0).bit_length())


def width_bucket(n: int, lo: int = 4) -> int:
    """Page-table width for ``n`` live pages: the next of ``lo`` and 2^k, 3 * 2^(k-1) (4, 6, 8, 12, 16, 24, ...) at
    or above ``n``. Attention reads every listed page, so the table wastes at most a third of what it reads (a
    power of two wastes up to a half) at twice the compiled widths of :func:`bucket`."""
    w = bucket(n, lo)
    return max(lo, w * 3 // 4) if w * 3 // 4 >= n else w


def row_bucket(n: int) -> int:
    """Padded rows of a decode batch of ``n``: a power of two up to 8 rows, then also 3 * 2^(k-1) (12, 24, 48, ..).
    A decode step's time grows with its padded rows, and past 8 rows a power of two pads up to half the batch (17
    rows of 32); this pads at most a third, at 2 compiled row counts per octave above 8 (1 below, where the step's
    fixed cost dominates)."""
    return bucket(n) if n <= 8 else width_bucket(n, lo=1)


def chunk_bucket(n: int) -> int:
    """Padded length of a prefill chunk of ``n`` tokens: 1 for a single token, else a multiple of 16 up to 256, then
    a quarter-octave step (320, 384, 448, 512, 640, ...): the next multiple of ``bucket(n) / 8``. A power of two pads
    a prompt of 2^k + 1 tokens (a 128-token prompt behind its <bos>) to twice its length; this pads at most 15 tokens
    up to 256 (a 129-143-token prompt, as ``vllm bench serve``'s 128 random tokens re-tokenize, computes 144 positions,
    not 160: ~10% of its prefill) and a fifth of the chunk above, at four compiled lengths per octave there. The single
    token is that prompt's suffix after a prefix hit on its 2^k cached tokens: padded to 16 it would cost 16 tokens'
    FFN per row."""
    if n <= 1:
        return 1
    g = 16 if n <= 256 else bucket(n) // 8
    return max(16, -(-n // g) * g)


def batch_buckets(max_rows: int) -> list[int]:
    """The padded batch sizes of up to ``max_rows`` rows: 1, 2, 4, .. bucket(max_rows)."""
    return [1 << i for i in range(bucket(max_rows).bit_length())]


def chunk_groups(chunks: list[Chunk], max_prefill_tokens: int) -> list[list[Chunk]]:
    """Batches of similar chunk lengths whose padded size stays within ``max_prefill_tokens``."""
    groups, cur = [], []
    for ch in sorted(chunks, key=lambda c: c.n):
        t = chunk_bucket(ch.n)
        if cur and bucket(len(cur) + 1) * t > max(max_prefill_tokens, t):
            groups.append(cur)
            cur = []
        cur.append(ch)
    return groups + ([cur] if cur else [])


def prefill_shapes(tables: PageTables, page_size: int, max_prefill_tokens: int, max_rows: int, max_chunk: int,
                   max_pages: int) -> list[tuple[int, int, int]]:
    """Every ``(rows, chunk, page-table width)`` a prefill group can be padded to, for groups of up to ``max_rows``
    chunks of up to ``max_chunk`` tokens of requests holding up to ``max_pages`` pages (:func:`chunk_groups` keeps
    rows x chunk within ``max_prefill_tokens``; a chunk of ``c`` tokens past a prefix or an earlier chunk may need
    any wider table).

    Ordered for a warm-up that may stop early (``Engine.warm_up``): first every ``(rows, chunk)`` at the narrowest
    table its chunk length can have (a fresh prompt prefilled in one chunk, no prefix hit) and the chunks of at most
    a page at every width (the suffix a prefix hit leaves: a cached prompt served again costs this step, not a whole
    prompt's), by rows then chunk (one and two prompts per launch are the most frequent groups); then the wider tables
    of longer chunks (later chunks of long prompts)."""
    cap, fresh, wider, shortest = min(tables.page_table.shape[1], max_pages), [], [], {}
    for n in range(max(max_chunk, 1), 0, -1):  # each padded length's shortest chunk
        shortest[chunk_bucket(n)] = n
    for c in sorted(shortest):
        least = -(-shortest[c] // page_size)  # pages of the shortest chunk padded to c
        widths = sorted({min(bucket(n, 4), cap) for n in range(least, cap + 1)})
        for b in batch_buckets(max_rows):
            if b * c <= max(max_prefill_tokens, c):
                first, later = (widths, []) if c <= chunk_bucket(page_size) else (widths[:1], widths[1:])
                fresh += [(b, c, w) for w in first]
                wider += [(b, c, w) for w in later]
    return sorted(fresh, key=lambda s: (s[0], s[1])) + wider


def decode_shapes(tables: PageTables, max_rows: int, max_pages: int) -> list[tuple[int, int]]:
    """Every ``(rows, page-table width)`` a decode batch of up to ``max_rows`` rows of requests holding up to
    ``max_pages`` pages can be padded to."""
    cap = min(tables.page_table.shape[1], max_pages)
    widths = sorted({min(width_bucket(n), cap) for n in range(1, cap + 1)})
    return [(b, w) for b in sorted({row_bucket(n) for n in range(1, max_rows + 1)}) for w in widths]
