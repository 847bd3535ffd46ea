"""Padded prefill shapes: :func:`chunk_bucket` (a chunk's padded length) wastes at most a fifth of what it pads,
and :func:`prefill_shapes` (what ``Engine.warm_up`` compiles) lists every shape a chunk group is padded to."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phaseserve.engine.shapes import bucket, chunk_bucket, prefill_shapes


def test_chunk_bucket_pads_little_and_compiles_four_lengths_per_octave_above_256():
    padded = [chunk_bucket(n) for n in range(1, 8193)]
    assert chunk_bucket(129) == 144 and chunk_bucket(143) == 144 and chunk_bucket(128) == 128  # was 256, then 160
    assert chunk_bucket(1) == 1 and chunk_bucket(2) == 16  # a single token (a prefix hit's suffix) is not padded
    for n, c in enumerate(padded[1:], start=2):
        assert c >= n and c % 16 == 0 and c - n <= (15 if n <= 256 else c // 5), (n, c)
    assert padded == sorted(padded)  # monotone
    assert len({c for c in padded if 128 < c <= 256}) == 8  # multiples of 16 up to 256
    for k in range(9, 14):  # (2^(k-1), 2^k]: four lengths
        assert len({c for n, c in enumerate(padded, start=1) if 2 ** (k - 1) < n <= 2 ** k}) == 4


@settings(max_examples=60, deadline=None)
@given(max_chunk=st.integers(1, 700), page_size=st.sampled_from([4, 16]), n=st.integers(1, 700),
       start=st.integers(0, 300), rows=st.integers(1, 8), budget=st.sampled_from([256, 1024, 2048]))
def test_every_padded_group_shape_is_warmed(max_chunk, page_size, n, start, rows, budget):
    """A group of ``rows`` chunks of up to ``n`` tokens after ``start`` cached ones (``chunk_batch``'s padding)."""
    n = min(n, max_chunk)
    c = chunk_bucket(n)
    while rows > 1 and bucket(rows) * c > budget:  # chunk_groups keeps padded rows x chunk within the budget
        rows -= 1
    cap = -(-(max_chunk + start) // page_size) + 1
    tables = SimpleNamespace(page_table=np.zeros((1, cap), np.int32))
    shapes = set(prefill_shapes(tables, page_size, budget, 8, max_chunk, cap))
    need = -(-(start + n) // page_size)
    assert (bucket(rows), c, min(bucket(need, 4), cap)) in shapes


@settings(max_examples=40, deadline=None)
@given(max_chunk=st.integers(1, 700), page_size=st.sampled_from([4, 16]), n=st.integers(1, 700),
       rows=st.integers(1, 8), budget=st.sampled_from([256, 1024, 2048]))
def test_fresh_prompt_and_prefix_hit_shapes_come_first(max_chunk, page_size, n, rows, budget):
    """A warm-up that stops early (``Engine.warm_up`` at the memory-map limit) has compiled the shape of a group
    of fresh prompts in one chunk each (no prefix hit), one width per (rows, chunk), and the shape of a group of
    prefix-hit suffixes (at most a page each) at every width: those lead the list."""
    n = min(n, max_chunk)
    c = chunk_bucket(n)
    while rows > 1 and bucket(rows) * c > budget:
        rows -= 1
    cap = -(-max_chunk // page_size) + 8
    tables = SimpleNamespace(page_table=np.zeros((1, cap), np.int32))
    shapes = prefill_shapes(tables, page_size, budget, 8, max_chunk, cap)
    hit = chunk_bucket(page_size)
    short = [s for s in shapes if s[1] <= hit]
    lead = len({(b, c) for b, c, _ in shapes if c > hit}) + len(short)
    assert len(set(shapes)) == len(shapes)
    assert (bucket(rows), c, min(bucket(-(-n // page_size), 4), cap)) in shapes[:lead]
    assert set(short) <= set(shapes[:lead])
    longer = [(b, c) for b, c, _ in shapes[:lead] if c > hit]
    assert len(set(longer)) == len(longer)  # one width each past the prefix hits' chunks
    suffix = min(n, page_size)  # a prefix hit's suffix after the prompt's cached pages
    assert (bucket(rows), chunk_bucket(suffix), min(bucket(-(-(n + 8 * page_size) // page_size), 4), cap)) \
        in shapes[:lead] or -(-(n + 8 * page_size) // page_size) > cap
