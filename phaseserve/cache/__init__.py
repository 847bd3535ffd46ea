"""The decode-phase memory system: host page allocator, device page pool, page-tag integrity layer.

- ``allocator``: :class:`PageAllocator` (refcounted, tagged pages, null page 0, LRU free queue) and
  :class:`PageTables` (per-request owned pages, expected tags and page-table rows; batch assembly).
- ``paged``: :class:`PagePool` (per-layer GQA/MLA pages, BF16/FP8/F32 storage), quantized writes, gathers, and
  memory accounting (``kv_bytes_per_token``, ``kv_bytes_per_page``, ``pages_for_budget``).
- ``integrity``: :class:`IntegrityTracker` (device tags, the separate jitted check, step hooks, typed errors)
  and :class:`NoopTracker`.
- ``attend``: :class:`PagedAttend`, the per-layer decode attention over the pages (write, attend, integrity hooks)
  that ``transformer.decode_step`` runs in the engine.

Fault injection (:class:`FaultInjector`, a model-free ``toy_decode_step``) is lab code: :mod:`lab.faults`.
"""

from phaseserve.cache.allocator import (
    NULL_PAGE,
    TAG_MAX,
    AllocatorError,
    DoubleFreeError,
    InvalidPageError,
    PageAllocator,
    PageTables,
    UnknownRequestError,
)
from phaseserve.cache.integrity import (
    IntegrityTracker,
    KVIntegrityError,
    NoopTracker,
    check_tags,
    guard_finite,
    mask_page_table,
)
from phaseserve.cache.paged import (
    GQAPages,
    MLAPages,
    PagePool,
    clear_pages,
    dequantize_kv,
    gather_layer,
    gather_request,
    indexer_bytes_per_token,
    init_pool,
    kv_bytes_per_page,
    kv_bytes_per_token,
    pages_for_budget,
    pool_nbytes,
    quantize_kv,
    write_layer,
    write_prompt,
    write_token,
    write_token_layer,
)

__all__ = [
    "NULL_PAGE", "TAG_MAX", "AllocatorError", "DoubleFreeError", "GQAPages", "IntegrityTracker",
    "InvalidPageError", "KVIntegrityError", "MLAPages", "NoopTracker", "PageAllocator", "PagePool", "PageTables",
    "UnknownRequestError", "check_tags", "clear_pages", "dequantize_kv", "gather_layer", "gather_request",
    "guard_finite", "indexer_bytes_per_token", "init_pool", "kv_bytes_per_page", "kv_bytes_per_token",
    "mask_page_table", "pages_for_budget", "pool_nbytes", "quantize_kv", "write_layer",
    "write_prompt", "write_token", "write_token_layer",
]
