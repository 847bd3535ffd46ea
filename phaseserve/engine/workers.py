"""The two phase workers the :class:`~phaseserve.engine.engine.Engine` drives (in process, or their device halves in
Ray actors: ``phaseserve.distributed``): each owns one phase's weights-on-mesh and jitted steps; neither schedules.

- :class:`PrefillWorker`: the prefill pool (prompts in progress, prefill KV dtype) and its allocator; groups the
  step's prompt chunks into padded batches (bounded by ``max_prefill_tokens``), runs the chunk step
  (``engine.prefill_step``), and exports finished prompts' pages quantized for the decode cache (``engine.handoff``).
- :class:`DecodeWorker`: the decode cache (page pool on the decode mesh, allocator, page tables, integrity tracker)
  and its jitted steps: :meth:`~DecodeWorker.land` writes handed-over whole pages into a request's pages,
  :meth:`~DecodeWorker.step` runs one integrity-checked decode step for a list of running sequences and returns the
  next tokens plus the typed page-tag failures (pages of rows that overflowed are scrubbed before anyone releases them);
  with ``lookahead`` it launches the next step before reading this one's tokens (:class:`Ahead`), so the host's
  work between two steps overlaps the device's;
  :meth:`~DecodeWorker.swap_out` / :meth:`~DecodeWorker.swap_in` copy pages to host memory and back, bit for bit
  (preemption by swap).

Each worker is split in a host half (page tables; batch building, :mod:`phaseserve.engine.batches`, padded to
the shapes of :mod:`phaseserve.engine.shapes`; :func:`pages_to_scrub`) and a device half (``run_batch``, ``land``,
``export``, ``scrub``, swaps) that takes only arrays and page ids, so the device half can live in another process:
:func:`local_workers` builds both phases in this process (the engine's default); ``phaseserve.distributed`` puts
each phase's device half in a Ray actor and keeps the host half, with the one scheduler, in the engine.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.cache.allocator import NULL_PAGE, PageAllocator, PageTables
from phaseserve.cache.integrity import IntegrityTracker, KVIntegrityError, NoopTracker
from phaseserve.cache.paged import clear_pages, init_pool
from phaseserve.config import ModelConfig, ServeConfig, canonical_dtype
from phaseserve.engine.batches import (
    chunk_batch,
    chunk_key,
    decode_inputs,
    pad_chunk_batch,
    pad_decode_inputs,
    warm_chunk_batch,
    warm_decode_inputs,
)
from phaseserve.engine.compiled import ShapeCache, abstract
from phaseserve.engine.decode_step import DecodeBatch, decode_step
from phaseserve.engine.handoff import export_paged, export_pages, import_paged, import_pages
from phaseserve.engine.prefill_step import ChunkBatch, chunk_step
from phaseserve.engine.request import MAX_LOGPROBS, Limits, Sequence
from phaseserve.engine.sampling import NONFINITE_ATTENTION, NONFINITE_TOKEN
from phaseserve.engine.scheduler import Chunk
from phaseserve.engine.shapes import bucket, cache_pages, chunk_groups, decode_shapes, prefill_pages, prefill_shapes
from phaseserve.kernel_mesh import KernelDispatch
from phaseserve.model.attention_mla import with_head_major_kv_b
from phaseserve.quant.policy import phase_policy
from phaseserve.quant.quantize import quantize_params
from phaseserve.sharding import make_mesh, phase_devices, pool_shardings, replicated, shard_params, sharded_step


def top_logprobs_k(cfg: ModelConfig) -> int:
    """The number of top alternatives the jitted steps compute per token (a request slices its own)."""
    return min(MAX_LOGPROBS, cfg.vocab_size)


def chunk_step_jit(cfg: ModelConfig, mesh: jax.sharding.Mesh, pool_sharding: Any, *, matmul_impl: str = "auto",
                   attn_impl: str = "auto", log: collections.Counter | None = None) -> Any:
    """The prefill worker's jitted chunk step on ``mesh`` (pool donated): ``(params, pool, ChunkBatch) -> (first
    i32[B] replicated, pool', sampled tokens' logprobs, prompt positions' logprobs)``
    (:func:`~phaseserve.engine.prefill_step.chunk_step`). Built from shardings only, so it also lowers for abstract
    arguments on a deviceless mesh (``jax.experimental.topologies``; ``lab.bench.tpu_compile``)."""
    rep, top = replicated(mesh), top_logprobs_k(cfg)
    dispatch = KernelDispatch(mesh, matmul_impl, attn_impl, phase="prefill", log=log)  # log: the worker's table
    return jax.jit(sharded_step(lambda p, pool, b, kd: chunk_step(p, cfg, pool, b, top, kd=kd), cfg, dispatch),
                   out_shardings=(rep, pool_sharding, rep, rep), donate_argnums=(1,))


def decode_step_jit(cfg: ModelConfig, mesh: jax.sharding.Mesh, pool_sharding: Any, *, hooks: Any = None,
                    matmul_impl: str = "auto", attn_impl: str = "auto", log: collections.Counter | None = None) -> Any:
    """The decode worker's jitted step on ``mesh`` (pool donated): ``(params, pool, DecodeBatch, ok bool[B] | None)
    -> (next i32[B], pool', logprobs)``; ``hooks``: the integrity tracker (its hooks are static
    methods, so the class :class:`~phaseserve.cache.integrity.IntegrityTracker` itself serves for tracing) or None.
    Built from shardings only, like :func:`chunk_step_jit`."""
    rep, top = replicated(mesh), top_logprobs_k(cfg)
    dispatch = KernelDispatch(mesh, matmul_impl, attn_impl, phase="decode", log=log)
    return jax.jit(sharded_step(
        lambda p, pool, b, ok, kd: decode_step(p, cfg, pool, b, ok, tracker=hooks, kd=kd, top=top), cfg, dispatch),
        out_shardings=(rep, pool_sharding, rep), donate_argnums=(1,))


def scrub_pages(worker: Any, pages: list[int]) -> None:
    """A worker's ``scrub``: zero these pages of its pool (they may hold NaN/inf) before they are freed; a masked key
    slot's NaN still reaches the next owner's attention output through ``0 * NaN``."""
    if pages:
        worker.pool = worker._clear(worker.pool, jnp.asarray(pages, jnp.int32))


def pages_to_scrub(tables: PageTables, page_size: int, rows: list[Sequence], nxt: np.ndarray,
                   ahead: bool = False) -> list[int]:
    """After a decode step: the pages that may hold NaN/inf (every page of a row whose attention output was NaN/inf,
    since it may have read them; the page of this step's token of a row whose logits were, and with ``ahead`` -- a
    next step launched before these tokens were read -- the page of its position too), to be zeroed before anyone
    releases them."""
    scrub = []
    for s, tok in zip(rows, nxt, strict=False):
        if tok == NONFINITE_ATTENTION:
            scrub += tables.owned(s.id)
        elif tok == NONFINITE_TOKEN:
            # it wrote NaN only into the page of this step's token (never a shared prompt page)
            owned = tables.owned(s.id)
            scrub += [owned[q // page_size] for q in range(s.next_position, s.next_position + 1 + ahead)
                      if q // page_size < len(owned)]
    return list(dict.fromkeys(scrub))


def scrub_after_step(worker: Any, rows: list[Sequence], nxt: np.ndarray, ahead: bool = False) -> None:
    """A decode worker's host half after a step: :func:`pages_to_scrub` zeroed in its pool (before any release) and
    forgotten by its allocator, so no prefix hit revives them once they are free."""
    pages = pages_to_scrub(worker.tables, worker.page_size, rows, nxt, ahead)
    worker.tables.allocator.forget(pages)
    worker.scrub(pages)


class Launched(NamedTuple):
    """A chunk step in flight (:meth:`PrefillWorker.launch`): its device outputs, fetched by :meth:`result`."""

    first: Any  # i32[B] the sampled tokens (a jax.Array still computing, or host values)
    gen: tuple | None  # the sampled tokens' logprob arrays, None unless a row asked
    prompt: tuple | None  # every chunk position's logprob arrays, None unless a row asked
    rows: int  # the group's real rows (the batch may be padded past them)

    def ready(self) -> bool:
        """The step has finished (fetching its result will not wait)."""
        return not isinstance(self.first, jax.Array) or self.first.is_ready()

    def result(self) -> tuple[np.ndarray, tuple | None, tuple | None]:
        """Wait for the step: (sampled tokens i32[rows], gen, prompt) on the host (an error the step raised on the
        device is raised here)."""
        gen = jax.device_get(self.gen) if self.gen is not None else None
        prompt = jax.device_get(self.prompt) if self.prompt is not None else None
        return np.asarray(self.first)[: self.rows], gen, prompt


class PrefillWorker:
    """Prefill weights and the prefill page pool on the prefill mesh, with the jitted chunk step and the page export
    of the handoff. The pool holds the KV of the prompts in progress only, in :attr:`pool_dtype` (the prefill KV
    dtype); :meth:`export` quantizes pages to :attr:`export_dtype` (the decode cache's storage dtype). A request gets
    its pages at admission (:attr:`tables`) and gives them back once its pages are handed to decode."""

    def __init__(self, cfg: ModelConfig, params: Any, mesh: jax.sharding.Mesh, *, pool_dtype: str,
                 export_dtype: str, max_prefill_tokens: int, page_size: int, num_pages: int,
                 max_pages_per_seq: int, attn_impl: str = "auto", matmul_impl: str = "auto"):
        self.cfg, self.params, self.mesh, self.max_prefill_tokens = cfg, params, mesh, max_prefill_tokens
        self.pool_dtype, self.export_dtype = canonical_dtype(pool_dtype), canonical_dtype(export_dtype)
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
        self.steps = ShapeCache(self._chunk, "prefill")  # (rows, chunk, width) -> compiled; new shapes off-path
        self._abstract = abstract((self.params, self.pool))
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
        """This step's chunks in launch groups (:func:`chunk_groups`); a group whose padded shape has no compiled
        executable and no compiled cover is split in halves, down to parts that each have one (:meth:`_covered`),
        so it runs at once on compiled shapes instead of waiting for a compile in the serving loop, while its own
        shape compiles in the background for later groups. A group no split can cover (no shape compiled yet, nothing
        warmed) stays whole and compiles as before."""
        out = []
        for g in chunk_groups(chunks, self.max_prefill_tokens):
            parts = self._covered(g) or [g]
            if len(parts) > 1:
                self.steps.compile_later(chunk_key(g, self.page_size, self.tables.page_table.shape[1]),
                                         self._abstract_step)
            out += parts
        return out

    def _abstract_step(self, key: tuple[int, int, int]) -> tuple:
        """The chunk step's arguments at padded shape ``key`` as ``jax.ShapeDtypeStruct`` trees (background compile)."""
        return (*self._abstract, abstract(warm_chunk_batch(*key)))

    def _covered(self, group: list[Chunk]) -> list[list[Chunk]] | None:
        """``group``, or its halves split further, each with a compiled shape or cover; None if no split has."""
        key = chunk_key(group, self.page_size, self.tables.page_table.shape[1])
        if self.steps.ready(key) or self.steps.cover(key) is not None:
            return [group]
        if len(group) == 1:
            return None
        half = len(group) // 2
        a, b = self._covered(group[:half]), self._covered(group[half:])
        return None if a is None or b is None else a + b

    def launch(self, group: list[Chunk]) -> Launched:
        """One chunk step for ``group`` (each request's pages already allocated), dispatched to the prefill mesh and
        not waited for (the engine decodes on the decode mesh meanwhile). :meth:`Launched.result` gives the token
        sampled at each chunk's last token, i32[len(group)] on the host (a request's first output token when its
        chunk ends the prompt), and the host logprob arrays of those tokens and of every chunk position's next prompt
        token (``(logprob, top logprobs, top ids)`` indexed ``[row]`` and ``[row, j]``), each None unless a row of
        the group asked."""
        return Launched(*self.dispatch(chunk_batch(self.tables, self.page_size, group)), rows=len(group))

    def dispatch(self, batch: ChunkBatch, exact: bool = False) -> tuple[jax.Array, tuple | None, tuple | None]:
        """The device half of :meth:`launch`: one jitted chunk step dispatched (not waited for); the sampled tokens
        i32[B] and the logprob arrays (None where no row asked), on the device. A padded shape not compiled yet runs
        on a larger compiled one while it compiles in the background
        (:class:`~phaseserve.engine.compiled.ShapeCache`); ``exact``: compile this shape now if needed (warm-up)."""
        key = (*batch.tokens.shape, batch.page_table.shape[1])
        use = key if exact else self.steps.choose(key, self._abstract_step)
        if use != key:
            batch = pad_chunk_batch(batch, *use)
        step = self.steps.executable(use, (self.params, self.pool, batch))
        first, self.pool, gen, prompt = step(self.params, self.pool, batch)
        return first, gen if batch.want_logprobs.any() else None, prompt if batch.want_prompt.any() else None

    def run_batch(self, batch: ChunkBatch, exact: bool = False) -> tuple[np.ndarray, tuple | None, tuple | None]:
        """:meth:`dispatch`, waited for: the sampled tokens and the asked-for logprob arrays on the host."""
        return Launched(*self.dispatch(batch, exact), rows=batch.tokens.shape[0]).result()

    def shapes(self, max_rows: int, max_chunk: int, max_pages: int) -> list[tuple[int, int, int]]:
        """Every padded ``(rows, chunk, page-table width)`` :meth:`launch` can use (:func:`prefill_shapes`)."""
        return prefill_shapes(self.tables, self.page_size, self.max_prefill_tokens, max_rows, max_chunk, max_pages)

    def warm(self, b: int, c: int, w: int) -> None:
        """Compile the chunk step at one padded shape (nothing valid: no page is written)."""
        self.run_batch(warm_chunk_batch(b, c, w), exact=True)

    def export(self, pages: list[int]) -> list:
        """The KV of these prefill pages, quantized to the decode storage dtype: exactly ``len(pages)`` pages
        (see :mod:`phaseserve.engine.handoff`)."""
        return export_paged(self._export, self.pool, pages, self.export_dtype)

    def land(self, pages: list[int], payload: list) -> None:
        """Write a payload (a prefix hit's pages, in the prefill KV dtype, already on this mesh) into ``pages``."""
        self.pool = import_paged(self._import, self.pool, pages, payload)


class Pending(NamedTuple):
    """A decode step launched (:meth:`DecodeWorker.launch`): its padded host inputs, the integrity check's inputs,
    and its device outputs ``(next, ok, logprobs)``."""

    batch: DecodeBatch
    check: tuple
    out: tuple


class Ahead(NamedTuple):
    """A decode step launched before the host knew its input tokens (:meth:`DecodeWorker._launch_ahead`): the
    previous step's sampled tokens fed on the device. ``planned`` is the host batch it ran on, its ``tokens`` filled
    in once the previous step's tokens are read (:meth:`known`)."""

    ids: tuple[str, ...]
    planned: DecodeBatch
    check: tuple  # (page table, expected tags, live pages) its integrity check ran on
    launched: Pending

    def known(self, nxt: np.ndarray) -> Ahead:
        """The previous step's tokens (i32[B] host) read: the tokens this step was fed."""
        return self._replace(planned=self.planned.replace(tokens=np.where(self.planned.active & (nxt >= 0), nxt, 0)))

    def matches(self, ids: list[str], batch: DecodeBatch, check: tuple, allocator: PageAllocator) -> bool:
        """Whether this launch is exactly the step the host would launch now for ``ids``: the same rows in the same
        order, every host input equal (``batch`` and ``check`` padded to its shape), and no page tag change still
        to reach the device for a page a row reads (the check it ran would then differ from one run now)."""
        shape = self.planned.page_table.shape
        if tuple(ids) != self.ids or batch.page_table.shape[1] > shape[1]:
            return False
        if batch.page_table.shape != shape:  # it ran on a larger compiled shape
            batch, check = pad_decode_inputs(batch, check, *shape)
        if not all(np.array_equal(x, y) for x, y in zip(check, self.check, strict=True)):
            return False
        if not all(np.array_equal(getattr(batch, f), getattr(self.planned, f)) for f in DECODE_FIELDS):
            return False
        return not allocator.pending_touch(check[0])


DECODE_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeBatch))


class DecodeWorker:
    """The decode cache (its pages in :attr:`pool_dtype`, the KV storage dtype) and the decode weights on the decode
    mesh, with the jitted decode/scatter/scrub steps."""

    def __init__(self, cfg: ModelConfig, params: Any, mesh: jax.sharding.Mesh, *, pool_dtype: str, num_pages: int,
                 page_size: int, max_pages_per_seq: int, integrity: bool, attn_impl: str = "auto",
                 matmul_impl: str = "auto"):
        if num_pages < 2:
            raise ValueError(f"the KV budget gives {num_pages} pages; need at least 2 (one is the null page)")
        self.cfg, self.params, self.mesh = cfg, params, mesh
        self.pool_dtype, self.num_pages, self.page_size = pool_dtype, num_pages, page_size
        self._ahead: Ahead | None = None  # the next step, launched before this one's tokens were read
        self.lookahead_stats: collections.Counter = collections.Counter()  # launches ahead used / dropped
        pool = init_pool(cfg, num_pages, page_size, pool_dtype)
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
        self.steps = ShapeCache(self._decode, "decode")  # (rows, width) -> compiled; new shapes off the serving path
        self._abstract = abstract((self.params, self.pool))
        self._import = jax.jit(import_pages, out_shardings=self._pool_sharding, donate_argnums=(0,))
        self._export = jax.jit(export_pages, static_argnums=(2,), out_shardings=rep)
        self._clear = jax.jit(clear_pages, out_shardings=self._pool_sharding, donate_argnums=(0,))
        self._feed = jax.jit(lambda nxt, active: jnp.where(active & (nxt >= 0), nxt, 0), out_shardings=rep)
        self.sharding = rep

    @property
    def pool(self) -> Any:
        return self._pool

    @pool.setter
    def pool(self, value: Any) -> None:
        """Anything but a decode step writing the pool (pages landed, scrubbed, swapped in, a test's fault): a step
        launched ahead did not see the write, so it is dropped."""
        self.lookahead_stats["dropped"] += self._ahead is not None
        self._pool, self._ahead = value, None

    def _written(self, value: Any, pages: list[int]) -> None:
        """The pool after a write to ``pages`` only (pages landed, copied or swapped in for rows new to the batch; the
        null page rewritten with its own contents by padding): a step launched ahead that reads none of them stays,
        since it neither read nor wrote them, and the write runs after it on the device; else it is dropped."""
        read = self._ahead.check[0] if self._ahead is not None else None
        if read is not None and not np.isin(np.setdiff1d(pages, [NULL_PAGE]), read).any():
            self._pool = value
        else:
            self.pool = value

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
        pool = init_pool(self.cfg, self.num_pages, self.page_size, self.pool_dtype)
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
        self._written(self._put(self.pool, idx, layers), idx)

    @staticmethod
    def swap_nbytes(host: tuple[int, Any]) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(host[1]))

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages ``src`` onto ``dst`` within the pool, bit for bit (every layer, values and scales), on the
        device (padding rows copy the null page onto itself)."""
        n = bucket(len(src))
        s, d = np.zeros(n, np.int32), np.zeros(n, np.int32)
        s[: len(src)], d[: len(dst)] = src, dst
        self._written(self._put(self.pool, d, self._gather(self.pool, s)), d)

    def land(self, pages: list[int], payload: list) -> None:
        """Write handed-over whole pages (already in the storage dtype, on the decode devices) into ``pages``."""
        self._written(import_paged(self._import, self.pool, pages, payload), pages)

    def export(self, pages: list[int], dtype: str) -> list:
        """These decode pages' KV dequantized and rounded to ``dtype`` (a prefix hit going to the prefill pool)."""
        return export_paged(self._export, self.pool, pages, dtype)

    @property
    def ahead_ids(self) -> tuple[str, ...] | None:
        """The rows of the step launched ahead and not yet used or dropped (None: nothing ahead)."""
        return None if self._ahead is None else self._ahead.ids

    def step(self, rows: list[Sequence], lookahead: bool = False,
             ) -> tuple[np.ndarray, dict[str, KVIntegrityError], float, tuple | None]:
        """One decode step for ``rows``: (next tokens i32[len(rows)], failures by id, device seconds, the tokens'
        host logprob arrays ``(logprob, top logprobs, top ids)`` indexed by row, None unless a row asked).

        The step the previous call launched ahead is this one when it ran on exactly these inputs
        (:meth:`Ahead.matches`); else it is dropped and this step launched now. ``lookahead``: before reading this
        step's tokens, launch the next step for the same rows (:meth:`_launch_ahead`)."""
        batch, check = decode_inputs(self.tables, rows)
        ids = [s.id for s in rows]
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.matches(ids, batch, check, self.allocator):
            launched = ahead.launched
            self.lookahead_stats["used"] += 1
        else:
            self.lookahead_stats["dropped"] += ahead is not None
            launched = self.launch(batch, check)
        if lookahead:
            self._ahead = self._launch_ahead(launched, ids, rows)
        nxt, failures, lps = self.fetch(launched, ids)
        device_s = time.perf_counter() - t0
        if self._ahead is not None:
            self._ahead = self._ahead.known(nxt)
        scrub_after_step(self, rows, nxt, ahead=self._ahead is not None)
        return nxt[: len(rows)], failures, device_s, lps

    def run_batch(self, batch: DecodeBatch, check: tuple, ids: list[str], exact: bool = False,
                  ) -> tuple[np.ndarray, dict, float, Any]:
        """The device half of :meth:`step` (nothing launched ahead): the integrity check (``check`` = page table,
        expected tags, live pages) and the jitted step; (next tokens i32[B], failures by id, device seconds, logprob
        arrays or None)."""
        t0 = time.perf_counter()
        nxt, failures, lps = self.fetch(self.launch(batch, check, exact), ids)
        return nxt, failures, time.perf_counter() - t0, lps

    def launch(self, batch: DecodeBatch, check: tuple, exact: bool = False) -> Pending:
        """The integrity check and the jitted step launched, not waited for. A shape not compiled yet runs on a
        larger compiled one meanwhile, as :meth:`PrefillWorker.run_batch`."""
        key = batch.page_table.shape
        use = key if exact else self.steps.choose(key, self._abstract_step)
        if use != key:
            batch, check = pad_decode_inputs(batch, check, *use)
        ok = self.tracker.check(*check)
        step = self.steps.executable(use, (self.params, self.pool, batch, ok))
        nxt, self._pool, lps = step(self.params, self._pool, batch, ok)
        return Pending(batch, check, (nxt, ok, lps))

    def fetch(self, p: Pending, ids: list[str]) -> tuple[np.ndarray, dict, Any]:
        """A launched step waited for: (next tokens i32[B], failures by id, logprob arrays or None)."""
        nxt, ok, lps = p.out
        lps = lps if p.batch.want_logprobs.any() else None
        nxt, ok_h, lps = jax.device_get((nxt, ok, lps))
        b = len(p.batch.tokens)
        failures = self.tracker.failures(ids + [None] * (b - len(ids)), ok_h, p.check)
        return np.asarray(nxt), failures, lps

    def _launch_ahead(self, p: Pending, ids: list[str], rows: list[Sequence]) -> Ahead | None:
        """The step after ``p`` for the same rows, launched now: each row's token sampled by ``p`` fed on the
        device at the next position, its sampling step one further, the same pages. None (nothing launched) when
        a row ends by length with ``p``'s token or its next position is past its pages."""
        b = p.batch
        if any(s.num_generated + 1 >= s.request.max_tokens for s in rows):
            return None
        step = b.active.astype(np.int32)
        positions = b.positions + step
        if not np.all(~b.active | (positions < p.check[2] * self.page_size)):
            return None
        planned = b.replace(positions=positions, steps=b.steps + step)
        tokens = self._feed(p.out[0], b.active)  # i32[B] on the device: where(active, sampled, 0)
        return Ahead(tuple(ids), planned, p.check, self.launch(planned.replace(tokens=tokens), p.check, exact=True))

    def _abstract_step(self, key: tuple[int, int]) -> tuple:
        """The decode step's arguments at padded shape ``key`` as ``jax.ShapeDtypeStruct`` trees (``ok`` as the
        integrity check returns it, placed on the decode mesh)."""
        batch, _ = warm_decode_inputs(*key)
        ok = (None if isinstance(self.tracker, NoopTracker)
              else jax.ShapeDtypeStruct((key[0],), np.bool_, sharding=replicated(self.mesh)))
        return (*self._abstract, abstract(batch), ok)

    def shapes(self, max_rows: int, max_pages: int) -> list[tuple[int, int]]:
        """Every padded ``(rows, page-table width)`` :meth:`step` can use (:func:`decode_shapes`)."""
        return decode_shapes(self.tables, max_rows, max_pages)

    def warm(self, b: int, w: int) -> None:
        """Compile the integrity check, the decode step and the lookahead's token feed at one padded shape (padding
        rows only: nothing is written)."""
        batch, check = warm_decode_inputs(b, w)
        self.run_batch(batch, check, [], exact=True)
        self._feed(jax.device_put(batch.tokens, self.sharding), batch.active)

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
    params = with_head_major_kv_b(cfg, params)  # the absorbed products read W_uk / W_uv in place in every step
    kv_dtype = canonical_dtype(serve.quant.kv_dtype)
    return DecodeWorker(cfg, params, mesh, pool_dtype=kv_dtype, num_pages=cache_pages(cfg, c, kv_dtype, devices[0]),
                        page_size=c.page_size, max_pages_per_seq=c.max_pages_per_seq, integrity=c.integrity,
                        attn_impl=attn_impl, matmul_impl=matmul_impl)


def build_prefill(cfg: ModelConfig, params: Any, serve: ServeConfig, mesh: jax.sharding.Mesh, decode_pages: int, *,
                  attn_impl: str = "auto", matmul_impl: str = "auto") -> PrefillWorker:
    """The prefill worker on ``mesh`` with ``params`` already in the prefill representation on it; its pool is
    sized from the limits of a decode pool of ``decode_pages`` pages (:func:`prefill_pages`)."""
    limits = Limits.of(cfg, serve, decode_pages)
    return PrefillWorker(cfg, params, mesh, pool_dtype=serve.quant.prefill_kv_dtype,
                         export_dtype=serve.quant.kv_dtype, max_prefill_tokens=serve.max_prefill_tokens,
                         page_size=serve.cache.page_size, max_pages_per_seq=limits.max_pages,
                         num_pages=prefill_pages(limits, serve.max_prefill_tokens), attn_impl=attn_impl,
                         matmul_impl=matmul_impl)


def prefill_params(cfg: ModelConfig, params: Any, serve: ServeConfig, mesh: jax.sharding.Mesh) -> Any:
    """``params`` in the prefill representation (``QuantConfig.prefill_weights``), sharded on ``mesh`` (MLA's kv_b
    also laid out per head, for a chunk over cached keys in the weight-absorbed form)."""
    return with_head_major_kv_b(cfg, shard_params(cfg, quantize_params(params, phase_policy(serve.quant, "prefill")),
                                                  mesh))


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
