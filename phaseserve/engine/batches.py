"""The host inputs of the two jitted steps: a :class:`~phaseserve.engine.prefill_step.ChunkBatch` from a group
of scheduled prompt chunks, a :class:`~phaseserve.engine.decode_step.DecodeBatch` (and its integrity check's inputs)
from the running sequences, padded to the shapes of :mod:`phaseserve.engine.shapes`; and the all-padding batches the
warm-up compiles with. Numpy only: the local workers and the Ray backend's proxies build them alike and hand them to
a worker's device half.
"""

from __future__ import annotations

import numpy as np

from phaseserve.cache.allocator import PageTables
from phaseserve.engine.decode_step import DecodeBatch
from phaseserve.engine.prefill_step import ChunkBatch
from phaseserve.engine.request import Sequence
from phaseserve.engine.scheduler import Chunk
from phaseserve.engine.shapes import bucket, chunk_bucket, row_bucket, width_bucket


def sampling_rows(seqs: list[Sequence], b: int) -> dict[str, np.ndarray]:
    """Per-row sampling parameters for ``seqs`` padded to ``b`` rows (padding rows are greedy)."""
    temp, top_k, top_p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
    seeds, steps, want = np.zeros(b, np.uint32), np.zeros(b, np.int32), np.zeros(b, bool)
    for i, s in enumerate(seqs):
        r = s.request
        temp[i], top_k[i], top_p[i], seeds[i], steps[i] = r.temperature, r.top_k, r.top_p, r.seed, s.num_generated
        want[i] = r.logprobs is not None
    return dict(temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps, want_logprobs=want)


def chunk_key(group: list[Chunk], page_size: int, max_width: int) -> tuple[int, int, int]:
    """The padded ``(rows, chunk, page-table width)`` of :func:`chunk_batch` for ``group``: a power of two rows,
    :func:`chunk_bucket` tokens, the pages the longest chunk reaches to bucketed (at most ``max_width``)."""
    need = max(-(-(ch.start + ch.n) // page_size) for ch in group)
    return bucket(len(group)), chunk_bucket(max(ch.n for ch in group)), min(bucket(need, 4), max_width)


def chunk_batch(tables: PageTables, page_size: int, group: list[Chunk]) -> ChunkBatch:
    """The host inputs of one chunk step for ``group``, padded to :func:`chunk_key` (``targets``: each position's
    next prompt token for the rows that asked for prompt logprobs, else -1)."""
    b, c, w = chunk_key(group, page_size, tables.page_table.shape[1])
    pt, _, _ = tables.batch([ch.id for ch in group], pad_to=b)
    pt = pt[:, :w]
    tokens, positions = np.zeros((b, c), np.int32), np.tile(np.arange(c, dtype=np.int32), (b, 1))
    valid, lengths, last = np.zeros((b, c), bool), np.zeros(b, np.int32), np.zeros(b, np.int32)
    targets, want_prompt = np.full((b, c), -1, np.int32), np.zeros(b, bool)
    for i, ch in enumerate(group):
        tokens[i, : ch.n] = ch.seq.tokens[ch.start: ch.start + ch.n]
        positions[i] += ch.start
        valid[i, : ch.n], lengths[i], last[i] = True, ch.start + ch.n, ch.n - 1
        n_prompt = len(ch.seq.request.prompt)  # the user's prompt (not tokens re-prefilled after a preemption)
        if ch.seq.request.prompt_logprobs is not None and ch.start < n_prompt - 1:
            end = min(ch.start + ch.n + 1, n_prompt)
            targets[i, : end - ch.start - 1] = ch.seq.tokens[ch.start + 1: end]
            want_prompt[i] = True
    return ChunkBatch(tokens=tokens, positions=positions, valid=valid, lengths=lengths, last=last, page_table=pt,
                      targets=targets, want_prompt=want_prompt, **sampling_rows([ch.seq for ch in group], b))


def decode_inputs(tables: PageTables, rows: list[Sequence]) -> tuple[DecodeBatch, tuple]:
    """The host inputs of one decode step for ``rows``: the batch (padded to :func:`row_bucket` rows, the page table
    as wide as the rows' pages, bucketed) and the integrity check's ``(page_table, expected_tags, num_live)``."""
    b = row_bucket(len(rows))
    pt, expected, live = tables.batch([s.id for s in rows], pad_to=b)
    width = min(width_bucket(int(live.max(initial=1))), pt.shape[1])  # as wide as the rows' pages (bucketed)
    pt, expected = pt[:, :width], expected[:, :width]  # so the step reads what the rows hold, not the per-row cap
    tokens, positions, active = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, bool)
    for i, s in enumerate(rows):
        tokens[i], positions[i], active[i] = s.tokens[-1], s.next_position, True
    batch = DecodeBatch(tokens=tokens, positions=positions, page_table=pt, active=active, **sampling_rows(rows, b))
    return batch, (pt, expected, live)


def warm_chunk_batch(b: int, c: int, w: int) -> ChunkBatch:
    """A chunk batch of one padded shape with nothing valid (compiling the step at it writes no page)."""
    z = lambda *shape, dt=np.int32: np.zeros(shape, dt)  # noqa: E731
    return ChunkBatch(tokens=z(b, c), positions=np.tile(np.arange(c, dtype=np.int32), (b, 1)),
                      valid=z(b, c, dt=bool), lengths=z(b), last=z(b), page_table=z(b, w),
                      targets=np.full((b, c), -1, np.int32), want_prompt=z(b, dt=bool), **sampling_rows([], b))


def warm_decode_inputs(b: int, w: int) -> tuple[DecodeBatch, tuple]:
    """A decode batch of one padded shape, padding rows only, and its integrity check's inputs."""
    pt, expected, live = np.zeros((b, w), np.int32), np.zeros((b, w), np.uint32), np.zeros(b, np.int32)
    batch = DecodeBatch(tokens=np.zeros(b, np.int32), positions=np.zeros(b, np.int32), page_table=pt,
                        active=np.zeros(b, bool), **sampling_rows([], b))
    return batch, (pt, expected, live)


def pad_rows(a: np.ndarray, rows: int, cols: int | None = None, fill: float | bool = 0) -> np.ndarray:
    """``a`` [B] or [B, C] padded with ``fill`` to ``rows`` (and ``cols``)."""
    widths = [(0, rows - a.shape[0])] + ([(0, cols - a.shape[1])] if a.ndim == 2 else [])
    return np.pad(a, widths, constant_values=fill)


def pad_sampling(batch: ChunkBatch | DecodeBatch, b: int) -> dict[str, np.ndarray]:
    """A batch's per-row sampling fields padded to ``b`` rows with :func:`sampling_rows`' padding-row values."""
    return {k: pad_rows(getattr(batch, k), b, fill=fill[0]) for k, fill in sampling_rows([], 1).items()}


def pad_chunk_batch(batch: ChunkBatch, b: int, c: int, w: int) -> ChunkBatch:
    """``batch`` padded to ``b`` rows, ``c`` tokens and ``w`` pages (padding rows and tokens are not valid; the
    valid rows' results are unchanged): to run it on a larger compiled shape
    (:class:`~phaseserve.engine.compiled.ShapeCache`)."""
    starts = pad_rows(batch.positions[:, 0], b)
    return batch.replace(
        tokens=pad_rows(batch.tokens, b, c), positions=starts[:, None] + np.arange(c, dtype=np.int32),
        valid=pad_rows(batch.valid, b, c, False), lengths=pad_rows(batch.lengths, b), last=pad_rows(batch.last, b),
        page_table=pad_rows(batch.page_table, b, w), targets=pad_rows(batch.targets, b, c, -1),
        want_prompt=pad_rows(batch.want_prompt, b, fill=False), **pad_sampling(batch, b))


def pad_decode_inputs(batch: DecodeBatch, check: tuple, b: int, w: int) -> tuple[DecodeBatch, tuple]:
    """A decode batch and its integrity check's inputs padded to ``b`` rows and ``w`` pages (padding rows are not
    active and hold no live page)."""
    pt, expected, live = pad_rows(check[0], b, w), pad_rows(check[1], b, w), pad_rows(check[2], b)
    batch = batch.replace(
        tokens=pad_rows(batch.tokens, b), positions=pad_rows(batch.positions, b), page_table=pt,
        active=pad_rows(batch.active, b, fill=False), **pad_sampling(batch, b))
    return batch, (pt, expected, live)
