"""The two phase workers the :class:`~phaseserve.engine.engine.Engine` drives (in process, or their device halves in
Ray actors: ``phaseserve.distributed``): each owns one phase's weights-on-mesh and jitted steps; neither schedules.

- :class:`PrefillWorker`: the prefill pool (prompts in progress, prefill KV dtype) and its allocator; groups the
  step's prompt chunks into padded batches (bounded by ``max_prefill_tokens``), runs the chunk step
  (``engine.prefill``), and exports finished prompts' pages quantized for the decode cache (``engine.handoff``).
- :class:`DecodeWorker`: the decode cache (page pool on the decode mesh, allocator, page tables, integrity tracker)
  and its jitted steps: :meth:`~DecodeWorker.land` writes handed-over whole pages into a request's pages,
  :meth:`~DecodeWorker.step` runs one integrity-checked decode step for a list of running sequences and returns the
  next tokens plus the typed failures (pages of rows that read NaN/inf are scrubbed before anyone releases them);
  :meth:`~DecodeWorker.swap_out` / :meth:`~DecodeWorker.swap_in` copy pages to host memory and back, bit for bit
  (preemption by swap).

:func:`cache_pages` sizes the page pool from ``CacheConfig`` (pages, a byte budget, or the documented default).

:func:`stop_reason` is the one stop rule (stop tokens, eos unless ``ignore_eos``, ``max_tokens``).

Each worker is split in a host half (page tables, batch building: :func:`chunk_batch`, :func:`decode_inputs`,
:func:`pages_to_scrub`) and a device half (``run_batch``, ``land``, ``export``, ``scrub``, swaps) that takes only
arrays and page ids, so the device half can live in another process: :func:`local_workers` builds both phases in
this process (the engine's default); ``phaseserve.distributed`` puts each phase's device half in a Ray actor and
keeps the host half, with the one scheduler, in the engine.
"""

from __future__ import annotations

import collections
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.cache.allocator import PageAllocator, PageTables
from phaseserve.cache.integrity import IntegrityTracker, KVIntegrityError, NoopTracker
from phaseserve.cache.paged import clear_pages, init_pool, pages_for_budget
from phaseserve.config import DEFAULT_CPU_KV_BYTES, CacheConfig, ModelConfig, ServeConfig, canonical_dtype
from phaseserve.engine.decode import DecodeBatch, decode_step
from phaseserve.engine.handoff import export_pages, import_pages, page_chunks
from phaseserve.engine.prefill import ChunkBatch, chunk_step
from phaseserve.engine.request import MAX_LOGPROBS, Limits, Logprob, Request
from phaseserve.engine.sampling import NONFINITE_TOKEN
from phaseserve.engine.scheduler import Chunk, Sequence
from phaseserve.kernel_mesh import KernelDispatch
from phaseserve.quant.policy import phase_policy
from phaseserve.quant.quantize import quantize_params
from phaseserve.sharding import make_mesh, phase_devices, pool_shardings, replicated, shard_params, sharded_step


def bucket(n: int, lo: int = 1) -> int:
    """Next power of two >= max(n, lo): padded shapes compile a handful of times, not once per size."""
    return max(lo, 1 << max(n - 1, 0).bit_length())


def width_bucket(n: int, lo: int = 4) -> int:
    """Page-table width for ``n`` live pages: the next of ``lo`` and 2^k, 3 * 2^(k-1) (4, 6, 8, 12, 16, 24, ...) at
    or above ``n``. Attention reads every listed page, so the table wastes at most a third of what it reads (a
    power of two wastes up to a half) at twice the compiled widths of :func:`bucket`."""
    w = bucket(n, lo)
    return max(lo, w * 3 // 4) if w * 3 // 4 >= n else w


def batch_buckets(max_rows: int) -> list[int]:
    """The padded batch sizes of up to ``max_rows`` rows: 1, 2, 4, .. bucket(max_rows)."""
    return [1 << i for i in range(bucket(max_rows).bit_length())]


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


def stop_reason(req: Request, token: int, num_generated: int, eos_ids: tuple[int, ...]) -> str | None:
    """``"stop"`` on a stop (or, unless ``ignore_eos``, eos) token past the first ``min_tokens`` (such a token
    earlier is kept, and generation goes on: the finish rule, not a mask on the logits), ``"length"`` at
    ``max_tokens``, else None."""
    stoppable = num_generated > req.min_tokens
    if stoppable and (token in req.stop_token_ids or (not req.ignore_eos and token in eos_ids)):
        return "stop"
    if num_generated >= req.max_tokens:
        return "length"
    return None


def sampling_rows(seqs: list[Sequence], b: int) -> dict[str, np.ndarray]:
    """Per-row sampling parameters for ``seqs`` padded to ``b`` rows (padding rows are greedy)."""
    temp, top_k, top_p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
    seeds, steps, want = np.zeros(b, np.uint32), np.zeros(b, np.int32), np.zeros(b, bool)
    for i, s in enumerate(seqs):
        r = s.request
        temp[i], top_k[i], top_p[i], seeds[i], steps[i] = r.temperature, r.top_k, r.top_p, r.seed, s.num_generated
        want[i] = r.logprobs is not None
    return dict(temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps, want_logprobs=want)


def top_logprobs_k(cfg: ModelConfig) -> int:
    """The number of top alternatives the jitted steps compute per token (a request slices its own)."""
    return min(MAX_LOGPROBS, cfg.vocab_size)


def logprob_at(arrays: tuple[np.ndarray, ...] | None, index: tuple, token: int, n_top: int | None) -> Logprob | None:
    """The :class:`Logprob` at ``index`` of a step's host logprob arrays ``(logprob, top logprobs, top ids)``, with
    ``n_top`` alternatives; None when the request did not ask (``n_top`` None) or the step computed none."""
    if arrays is None or n_top is None:
        return None
    lp, top_lp, top_ids = arrays
    top = tuple((int(t), float(v)) for t, v in zip(top_ids[index][:n_top], top_lp[index][:n_top], strict=True))
    return Logprob(int(token), float(lp[index]), top)


def chunk_step_jit(cfg: ModelConfig, mesh: jax.sharding.Mesh, pool_sharding: Any, *, matmul_impl: str = "auto",
                   attn_impl: str = "auto", log: collections.Counter | None = None) -> Any:
    """The prefill worker's jitted chunk step on ``mesh`` (pool donated): ``(params, pool, ChunkBatch) -> (first
    i32[B] replicated, pool', sampled tokens' logprobs, prompt positions' logprobs)``
    (:func:`~phaseserve.engine.prefill.chunk_step`). Built from shardings only, so it also lowers for abstract
    arguments on a deviceless mesh (``jax.experimental.topologies``; ``lab.bench.tpu_compile``)."""
    rep, top = replicated(mesh), top_logprobs_k(cfg)
    dispatch = KernelDispatch(mesh, matmul_impl, attn_impl, phase="prefill", log=log)  # log: the worker's table
    return jax.jit(sharded_step(lambda p, pool, b, kd: chunk_step(p, cfg, pool, b, top, kd=kd), cfg, dispatch),
                   out_shardings=(rep, pool_sharding, rep, rep), donate_argnums=(1,))


def decode_step_jit(cfg: ModelConfig, mesh: jax.sharding.Mesh, pool_sharding: Any, *, hooks: Any = None,
                    matmul_impl: str = "auto", attn_impl: str = "auto", log: collections.Counter | None = None) -> Any:
    """The decode worker's jitted step on ``mesh`` (pool donated): ``(params, pool, DecodeBatch, ok bool[B] | None)
    -> (next i32[B], pool', finite bool[B] | None, logprobs)``; ``hooks``: the integrity tracker (its hooks are static
    methods, so the class :class:`~phaseserve.cache.integrity.IntegrityTracker` itself serves for tracing) or None.
    Built from shardings only, like :func:`chunk_step_jit`."""
    rep, top = replicated(mesh), top_logprobs_k(cfg)
    dispatch = KernelDispatch(mesh, matmul_impl, attn_impl, phase="decode", log=log)
    return jax.jit(sharded_step(
        lambda p, pool, b, ok, kd: decode_step(p, cfg, pool, b, ok, tracker=hooks, kd=kd, top=top), cfg, dispatch),
        out_shardings=(rep, pool_sharding, rep, rep), donate_argnums=(1,))


def scrub_pages(worker: Any, pages: list[int]) -> None:
    """A worker's ``scrub``: zero these pages of its pool (they may hold NaN/inf) before they are freed; a masked key
    slot's NaN still reaches the next owner's attention output through ``0 * NaN``."""
    if pages:
        worker.pool = worker._clear(worker.pool, jnp.asarray(pages, jnp.int32))


def chunk_groups(chunks: list[Chunk], max_prefill_tokens: int) -> list[list[Chunk]]:
    """Batches of similar chunk lengths whose padded size stays within ``max_prefill_tokens``."""
    groups, cur = [], []
    for ch in sorted(chunks, key=lambda c: c.n):
        t = bucket(ch.n, 16)
        if cur and bucket(len(cur) + 1) * t > max(max_prefill_tokens, t):
            groups.append(cur)
            cur = []
        cur.append(ch)
    return groups + ([cur] if cur else [])


def chunk_batch(tables: PageTables, page_size: int, group: list[Chunk]) -> ChunkBatch:
    """The host inputs of one chunk step for ``group`` (padded to a power of two rows and chunk length; the page
    table as wide as the longest chunk needs, bucketed; ``targets``: each position's next prompt token for the rows
    that asked for prompt logprobs, else -1)."""
    b, c = bucket(len(group)), bucket(max(ch.n for ch in group), 16)
    need = max(-(-(ch.start + ch.n) // page_size) for ch in group)
    pt, _, _ = tables.batch([ch.id for ch in group], pad_to=b)
    pt = pt[:, : min(bucket(need, 4), pt.shape[1])]
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


def prefill_shapes(tables: PageTables, page_size: int, max_prefill_tokens: int, max_rows: int, max_chunk: int,
                   max_pages: int) -> list[tuple[int, int, int]]:
    """Every ``(rows, chunk, page-table width)`` a prefill group can be padded to, for groups of up to ``max_rows``
    chunks of up to ``max_chunk`` tokens of requests holding up to ``max_pages`` pages (:func:`chunk_groups` keeps
    rows x chunk within ``max_prefill_tokens``; a chunk of ``c`` tokens past a prefix or an earlier chunk may need
    any wider table)."""
    cap, out = min(tables.page_table.shape[1], max_pages), []
    for c in (16 << i for i in range(bucket(max(max_chunk, 16), 16).bit_length() - 4)):
        least = -(-(c // 2 + 1 if c > 16 else 1) // page_size)  # pages of the shortest chunk padded to c
        widths = sorted({min(bucket(n, 4), cap) for n in range(least, cap + 1)})
        for b in batch_buckets(max_rows):
            if b * c <= max(max_prefill_tokens, c):
                out += [(b, c, w) for w in widths]
    return out


def decode_shapes(tables: PageTables, max_rows: int, max_pages: int) -> list[tuple[int, int]]:
    """Every ``(rows, page-table width)`` a decode batch of up to ``max_rows`` rows of requests holding up to
    ``max_pages`` pages can be padded to."""
    cap = min(tables.page_table.shape[1], max_pages)
    widths = sorted({min(width_bucket(n), cap) for n in range(1, cap + 1)})
    return [(b, w) for b in batch_buckets(max_rows) for w in widths]


def decode_inputs(tables: PageTables, rows: list[Sequence]) -> tuple[DecodeBatch, tuple]:
    """The host inputs of one decode step for ``rows``: the batch (padded to a power of two rows, the page table
    as wide as the rows' pages, bucketed) and the integrity check's ``(page_table, expected_tags, num_live)``."""
    b = bucket(len(rows))
    pt, expected, live = tables.batch([s.id for s in rows], pad_to=b)
    width = min(width_bucket(int(live.max(initial=1))), pt.shape[1])  # as wide as the rows' pages (bucketed)
    pt, expected = pt[:, :width], expected[:, :width]  # so the step reads what the rows hold, not the per-row cap
    tokens, positions, active = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, bool)
    for i, s in enumerate(rows):
        tokens[i], positions[i], active[i] = s.tokens[-1], s.next_position, True
    batch = DecodeBatch(tokens=tokens, positions=positions, page_table=pt, active=active, **sampling_rows(rows, b))
    return batch, (pt, expected, live)


def pages_to_scrub(tables: PageTables, page_size: int, rows: list[Sequence], nxt: np.ndarray,
                   failures: dict[str, KVIntegrityError]) -> list[int]:
    """After a decode step: the pages that may hold NaN/inf (every page of a row that read them; the page of this
    step's token of a row that produced them), to be zeroed before anyone releases them."""
    scrub = [p for rid, e in failures.items() if e.kind == "nonfinite" for p in tables.owned(rid)]
    # a row that overflowed wrote NaN only into the page of this step's token (never a shared prompt page)
    scrub += [tables.owned(s.id)[s.next_position // page_size]
              for s, tok in zip(rows, nxt, strict=False) if tok == NONFINITE_TOKEN]
    return scrub


class PrefillWorker:
    """Prefill weights and the prefill page pool (prefill KV dtype) on the prefill mesh, with the jitted chunk step
    and the page export of the handoff. The pool holds the KV of the prompts in progress only: a request gets its
    pages at admission (:attr:`tables`) and gives them back once its pages are handed to decode."""

    def __init__(self, cfg: ModelConfig, params: Any, mesh: jax.sharding.Mesh, *, kv_dtype: str,
                 prefill_kv_dtype: str, max_prefill_tokens: int, page_size: int, num_pages: int,
                 max_pages_per_seq: int, attn_impl: str = "auto", matmul_impl: str = "auto"):
        self.cfg, self.params, self.mesh, self.max_prefill_tokens = cfg, params, mesh, max_prefill_tokens
        self.kv_dtype, self.pool_dtype = kv_dtype, canonical_dtype(prefill_kv_dtype)
        self.num_pages, self.page_size = num_pages, page_size
        pool = init_pool(cfg, num_pages, page_size, self.pool_dtype)
        self._pool_sharding = pool_shardings(pool, mesh)
        self.pool = jax.device_put(pool, self._pool_sharding)
        self.allocator = PageAllocator(num_pages)
        self.tables = PageTables(self.allocator, max_pages_per_seq)
        rep = replicated(mesh)
        self.kernels: collections.Counter = collections.Counter()  # kernel provenance (kernel_mesh.provenance_rows)
        self._chunk = chunk_step_jit(cfg, mesh, self._pool_sharding, matmul_impl=matmul_impl, attn_impl=attn_impl,
                                     log=self.kernels)
        self._export = jax.jit(export_pages, static_argnums=(2,), out_shardings=rep)
        self._import = jax.jit(import_pages, out_shardings=self._pool_sharding, donate_argnums=(0,))
        self._clear = jax.jit(clear_pages, out_shardings=self._pool_sharding, donate_argnums=(0,))
        self.sharding = rep

    def pool_ok(self) -> bool:
        return not any(x.is_deleted() for x in jax.tree.leaves(self.pool))

    requeue_lost = False  # a lost pool ends its requests (a remote worker that restarts requeues the fresh ones)

    def block(self) -> None:
        jax.block_until_ready(self.pool)

    scrub = scrub_pages

    def reset_pool(self) -> None:
        """A fresh zeroed pool after a failed call consumed the donated one (the caller ended its requests)."""
        self.pool = jax.device_put(init_pool(self.cfg, self.num_pages, self.page_size, self.pool_dtype),
                                   self._pool_sharding)

    def groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        return chunk_groups(chunks, self.max_prefill_tokens)

    def run(self, group: list[Chunk]) -> tuple[np.ndarray, tuple | None, tuple | None]:
        """One chunk step for ``group`` (each request's pages already allocated): the token sampled at each chunk's
        last token, i32[len(group)] on the host (a request's first output token when its chunk ends the prompt);
        the host logprob arrays of those tokens and of every chunk position's next prompt token (``(logprob, top
        logprobs, top ids)`` indexed ``[row]`` and ``[row, j]``), each None unless a row of the group asked."""
        first, gen, prompt = self.run_batch(chunk_batch(self.tables, self.page_size, group))
        return first[: len(group)], gen, prompt

    def run_batch(self, batch: ChunkBatch) -> tuple[np.ndarray, tuple | None, tuple | None]:
        """The device half of :meth:`run`: one jitted chunk step; the sampled tokens i32[B] and the logprob arrays
        (fetched only when a row asked) on the host."""
        first, self.pool, gen, prompt = self._chunk(self.params, self.pool, batch)
        gen = jax.device_get(gen) if batch.want_logprobs.any() else None
        prompt = jax.device_get(prompt) if batch.want_prompt.any() else None
        return np.asarray(first), gen, prompt

    def shapes(self, max_rows: int, max_chunk: int, max_pages: int) -> list[tuple[int, int, int]]:
        """Every padded ``(rows, chunk, page-table width)`` :meth:`run` can use (:func:`prefill_shapes`)."""
        return prefill_shapes(self.tables, self.page_size, self.max_prefill_tokens, max_rows, max_chunk, max_pages)

    def warm(self, b: int, c: int, w: int) -> None:
        """Compile the chunk step at one padded shape (nothing valid: no page is written)."""
        self.run_batch(warm_chunk_batch(b, c, w))

    def export(self, pages: list[int]) -> list:
        """The KV of these prefill pages, quantized to the decode storage dtype: exactly ``len(pages)`` pages
        (see :mod:`phaseserve.engine.handoff`)."""
        return export_paged(self._export, self.pool, pages, self.kv_dtype)

    def land(self, pages: list[int], payload: list) -> None:
        """Write a payload (a prefix hit's pages, in the prefill KV dtype, already on this mesh) into ``pages``."""
        self.pool = import_paged(self._import, self.pool, pages, payload)


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


class DecodeWorker:
    """The decode cache and the decode weights on the decode mesh, with the jitted decode/scatter/scrub steps."""

    def __init__(self, cfg: ModelConfig, params: Any, mesh: jax.sharding.Mesh, *, kv_dtype: str, num_pages: int,
                 page_size: int, max_pages_per_seq: int, integrity: bool, attn_impl: str = "auto",
                 matmul_impl: str = "auto"):
        if num_pages < 2:
            raise ValueError(f"the KV budget gives {num_pages} pages; need at least 2 (one is the null page)")
        self.cfg, self.params, self.mesh = cfg, params, mesh
        self.kv_dtype, self.num_pages, self.page_size = kv_dtype, num_pages, page_size
        pool = init_pool(cfg, num_pages, page_size, kv_dtype)
        self._pool_sharding = pool_shardings(pool, mesh)
        self.pool = jax.device_put(pool, self._pool_sharding)
        self._gather = jax.jit(lambda pool, idx: jax.tree.map(lambda x: x[idx], pool.layers))
        self._put = jax.jit(lambda pool, idx, layers: pool.replace(layers=jax.tree.map(
            lambda x, h: x.at[idx].set(h), pool.layers, layers)), out_shardings=self._pool_sharding,
            donate_argnums=(0,))
        self.allocator = PageAllocator(num_pages)
        self.tables = PageTables(self.allocator, max_pages_per_seq)
        self.tracker = (IntegrityTracker(self.allocator, device=replicated(mesh)) if integrity
                        else NoopTracker(self.allocator))
        hooks = self.tracker if integrity else None
        rep = replicated(mesh)
        self.kernels: collections.Counter = collections.Counter()  # kernel provenance (kernel_mesh.provenance_rows)
        self._decode = decode_step_jit(cfg, mesh, self._pool_sharding, hooks=hooks, matmul_impl=matmul_impl,
                                       attn_impl=attn_impl, log=self.kernels)
        self._import = jax.jit(import_pages, out_shardings=self._pool_sharding, donate_argnums=(0,))
        self._export = jax.jit(export_pages, static_argnums=(2,), out_shardings=rep)
        self._clear = jax.jit(clear_pages, out_shardings=self._pool_sharding, donate_argnums=(0,))
        self.sharding = rep

    def pool_ok(self) -> bool:
        """False when a failed call consumed the (donated) pool: its buffers are gone."""
        return not any(x.is_deleted() for x in jax.tree.leaves(self.pool))

    requeue_lost = False

    def block(self) -> None:
        jax.block_until_ready(self.pool)

    scrub = scrub_pages

    def reset_pool(self) -> None:
        """A fresh zeroed pool (after :meth:`pool_ok` turned False; the caller has ended every request that held
        pages, so the allocator holds none)."""
        pool = init_pool(self.cfg, self.num_pages, self.page_size, self.kv_dtype)
        self.pool = jax.device_put(pool, self._pool_sharding)

    def swap_out(self, pages: list[int]) -> tuple[int, Any]:
        """Copy ``pages`` (every layer, values and scales) to host memory: ``(n, host layers)``, each leaf
        ``[bucket(n), ...]`` (padding rows read the null page). Call before anything writes to these pages."""
        idx = np.zeros(bucket(len(pages)), np.int32)
        idx[: len(pages)] = pages
        return len(pages), jax.device_get(self._gather(self.pool, idx))

    def swap_in(self, pages: list[int], host: tuple[int, Any]) -> None:
        """Write a :meth:`swap_out` copy into the first ``n`` of ``pages`` (padding rows rewrite the null page with
        its own contents)."""
        n, layers = host
        idx = np.zeros(jax.tree.leaves(layers)[0].shape[0], np.int32)
        idx[:n] = pages[:n]
        self.pool = self._put(self.pool, idx, layers)

    @staticmethod
    def swap_nbytes(host: tuple[int, Any]) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(host[1]))

    def land(self, pages: list[int], payload: list) -> None:
        """Write handed-over whole pages (already in the storage dtype, on the decode devices) into ``pages``."""
        self.pool = import_paged(self._import, self.pool, pages, payload)

    def export(self, pages: list[int], dtype: str) -> list:
        """These decode pages' KV dequantized and rounded to ``dtype`` (a prefix hit going to the prefill pool)."""
        return export_paged(self._export, self.pool, pages, dtype)

    def step(self, rows: list[Sequence]) -> tuple[np.ndarray, dict[str, KVIntegrityError], float, tuple | None]:
        """One decode step for ``rows``: (next tokens i32[len(rows)], failures by id, device seconds, the tokens'
        host logprob arrays ``(logprob, top logprobs, top ids)`` indexed by row, None unless a row asked)."""
        batch, check = decode_inputs(self.tables, rows)
        nxt, failures, device_s, lps = self.run_batch(batch, check, [s.id for s in rows])
        self.scrub(pages_to_scrub(self.tables, self.page_size, rows, nxt, failures))  # before any release
        return nxt[: len(rows)], failures, device_s, lps

    def run_batch(self, batch: DecodeBatch, check: tuple, ids: list[str]) -> tuple[np.ndarray, dict, float, Any]:
        """The device half of :meth:`step`: the integrity check (``check`` = page table, expected tags, live pages)
        and the jitted step; (next tokens i32[B], failures by id, device seconds, logprob arrays or None)."""
        pt, expected, live = check
        b = len(batch.tokens)
        t0 = time.perf_counter()
        ok = self.tracker.check(pt, expected, live)
        nxt, self.pool, finite, lps = self._decode(self.params, self.pool, batch, ok)
        lps = lps if batch.want_logprobs.any() else None
        nxt, ok_h, finite_h, lps = jax.device_get((nxt, ok, finite, lps))
        device_s = time.perf_counter() - t0
        failures = self.tracker.failures(ids + [None] * (b - len(ids)), ok_h, finite_h, (pt, expected, live))
        return np.asarray(nxt), failures, device_s, lps

    def shapes(self, max_rows: int, max_pages: int) -> list[tuple[int, int]]:
        """Every padded ``(rows, page-table width)`` :meth:`step` can use (:func:`decode_shapes`)."""
        return decode_shapes(self.tables, max_rows, max_pages)

    def warm(self, b: int, w: int) -> None:
        """Compile the integrity check and the decode step at one padded shape (padding rows only: nothing is
        written)."""
        batch, check = warm_decode_inputs(b, w)
        self.run_batch(batch, check, [])

    def warm_tags(self) -> int:
        """Compile the integrity tracker's tag updates at every padded size (the number of sizes)."""
        return self.tracker.warm()


class PhaseWorkers(NamedTuple):
    """The two workers an :class:`~phaseserve.engine.engine.Engine` drives (local, or proxies to remote ones)."""

    prefill: Any
    decode: Any


def build_decode(cfg: ModelConfig, params: Any, serve: ServeConfig, devices: list, *, attn_impl: str = "auto",
                 matmul_impl: str = "auto") -> DecodeWorker:
    """The decode worker on ``devices`` (exactly ``decode_tp * decode_ep``): decode weights, the page pool."""
    m, c = serve.mesh, serve.cache
    mesh = make_mesh(devices, tp=m.decode_tp, ep=m.decode_ep)
    params = shard_params(cfg, quantize_params(params, phase_policy(serve.quant, "decode")), mesh)
    kv_dtype = canonical_dtype(serve.quant.kv_dtype)
    return DecodeWorker(cfg, params, mesh, kv_dtype=kv_dtype, num_pages=cache_pages(cfg, c, kv_dtype, devices[0]),
                        page_size=c.page_size, max_pages_per_seq=c.max_pages_per_seq, integrity=c.integrity,
                        attn_impl=attn_impl, matmul_impl=matmul_impl)


def build_prefill(cfg: ModelConfig, params: Any, serve: ServeConfig, mesh: jax.sharding.Mesh, decode_pages: int, *,
                  attn_impl: str = "auto", matmul_impl: str = "auto") -> PrefillWorker:
    """The prefill worker on ``mesh`` with ``params`` already in the prefill representation on it; its pool is
    sized from the limits of a decode pool of ``decode_pages`` pages (:func:`prefill_pages`)."""
    limits = Limits.of(cfg, serve, decode_pages)
    return PrefillWorker(cfg, params, mesh, kv_dtype=canonical_dtype(serve.quant.kv_dtype),
                         prefill_kv_dtype=serve.quant.prefill_kv_dtype, max_prefill_tokens=serve.max_prefill_tokens,
                         page_size=serve.cache.page_size, max_pages_per_seq=limits.max_pages,
                         num_pages=prefill_pages(limits, serve.max_prefill_tokens), attn_impl=attn_impl,
                         matmul_impl=matmul_impl)


def prefill_params(cfg: ModelConfig, params: Any, serve: ServeConfig, mesh: jax.sharding.Mesh) -> Any:
    """``params`` in the prefill representation (``QuantConfig.prefill_weights``), sharded on ``mesh``."""
    return shard_params(cfg, quantize_params(params, phase_policy(serve.quant, "prefill")), mesh)


def local_workers(cfg: ModelConfig, params: Any, serve: ServeConfig, attn_impl: str = "auto",
                  matmul_impl: str = "auto", devices: list | None = None) -> PhaseWorkers:
    """Both phases in this process, over ``devices`` (default ``jax.devices()``): disaggregated, each on its own
    mesh with its own weight copy; colocated, one mesh and the decode weights for both."""
    m = serve.mesh
    pre_devs, dec_devs = phase_devices(devices if devices is not None else jax.devices(), m, serve.mode)
    decode = build_decode(cfg, params, serve, dec_devs, attn_impl=attn_impl, matmul_impl=matmul_impl)
    if serve.mode == "colocated":
        mesh, pparams = decode.mesh, decode.params
    else:
        mesh = make_mesh(pre_devs, tp=m.prefill_tp)
        pparams = prefill_params(cfg, params, serve, mesh)
    prefill = build_prefill(cfg, pparams, serve, mesh, decode.num_pages, attn_impl=attn_impl, matmul_impl=matmul_impl)
    return PhaseWorkers(prefill, decode)
