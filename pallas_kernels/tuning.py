"""Block sizes for every kernel, per target, and the TPU VMEM estimates that justify them.

Kept apart from the kernels so that tuning runs change one small file. Every function returns plain
ints; the kernels check the constraints (powers of two on Triton, (8, 128) tiles on TPU) and raise
:class:`pallas_kernels.common.UnsupportedShapeError` where a shape cannot be tiled.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.common import cdiv, is_pow2, next_pow2

# Streaming multiprocessors assumed when tracing for a GPU from a machine without one (H100/H200: 132).
DEFAULT_GPU_CORES = 132
TPU_VMEM_LIMIT_BYTES = 48 * 1024 * 1024  # under the 64 MiB of v7x, 128 MiB of v5e/v6e


def gpu_core_count() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or DEFAULT_GPU_CORES) if dev.platform == "gpu" else DEFAULT_GPU_CORES


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    pages_per_block: int  # pages gathered per inner step (tokens per step = pages_per_block * page_size)
    num_splits: int  # split-K partitions of the page range (GPU flash-decoding); 1 on TPU
    pages_per_split: int  # page-table columns per split, a multiple of pages_per_block
    block_h: int = 16  # query heads per program (GPU); padded with zero heads up to a power of two >= 16


def _split(programs: int, max_pages: int, ppb: int, cores: int) -> tuple[int, int]:
    """Split-K: enough programs for ~2 waves of the GPU, never a split with less than one block."""
    blocks = cdiv(max_pages, ppb)
    splits = min(next_pow2(cdiv(2 * cores, max(programs, 1))), next_pow2(blocks))
    while splits > 1 and cdiv(blocks, splits) * splits - blocks >= cdiv(blocks, splits):
        splits //= 2  # a whole split would be padding
    return splits, cdiv(blocks, splits) * ppb


def gqa_gpu(batch: int, num_kv_heads: int, page_size: int, max_pages: int) -> DecodeBlocks:
    ppb = max(1, 64 // page_size)
    ppb = min(ppb, next_pow2(max_pages))
    splits, pps = _split(batch * num_kv_heads, max_pages, ppb, gpu_core_count())
    return DecodeBlocks(ppb, splits, pps)


def gqa_tpu(page_size: int, max_pages: int) -> DecodeBlocks:
    ppb = min(max(1, 256 // page_size), max_pages)
    return DecodeBlocks(ppb, 1, cdiv(max_pages, ppb) * ppb)


def mla_gpu(batch: int, num_heads: int, page_size: int, max_pages: int, itemsize: int = 2) -> DecodeBlocks:
    # all heads (up to 64, Kimi/DeepSeek-V3 per device) in one program: the latent page is read once per row
    # (FlashMLA's layout), not once per 16 heads; the 64 x kv_lora_rank f32 accumulator needs 8 warps.
    # itemsize: bytes of the compute dtype. float32 (4) operands at 64 heads x 32 tokens x 512 asked the H200 for
    # 432 KiB of shared memory (it has 227 KiB): 16 heads and 16 tokens per step there (a reference-precision path)
    wide = itemsize >= 4
    block_h = min(max(16, next_pow2(num_heads)), 16 if wide else 64)
    ppb = min(max(1, (16 if wide else 32) // page_size), next_pow2(max_pages))
    splits, pps = _split(batch * cdiv(num_heads, block_h), max_pages, ppb, gpu_core_count())
    return DecodeBlocks(ppb, splits, pps, block_h)


def mla_tpu(page_size: int, max_pages: int) -> DecodeBlocks:
    ppb = min(max(1, 128 // page_size), max_pages)
    return DecodeBlocks(ppb, 1, cdiv(max_pages, ppb) * ppb)


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    bm: int  # rows of x per program (M is padded up to a multiple)
    bn: int  # output columns per program (must divide N)
    bk: int  # K rows per inner step (INT4: packed rows, i.e. K/2 units; FP8: K rows)


def _largest_divisor(n: int, candidates) -> int | None:
    return next((c for c in candidates if n % c == 0), None)


def split_k(programs: int, k_steps: int, cores: int | None = None) -> int:
    """GPU split-K factor: the largest power of two that divides the K steps and keeps programs x splits within
    ~2 waves of the SMs (1 when the (M, N) grid already fills them, e.g. prefill)."""
    want = cdiv(2 * (cores or gpu_core_count()), max(programs, 1))
    splits = 1
    while splits * 2 <= want and k_steps % (splits * 2) == 0:
        splits *= 2
    return splits


def matmul_gpu_launch(bm: int) -> tuple[int, int]:
    """(num_warps, num_stages) of the Triton matmul kernels: decode tiles (bm <= 16) are weight-streaming, so
    more stages keep more weight tiles in flight; larger tiles use 4 warps and 3 stages. Untuned defaults: no
    GPU measurement has set them yet."""
    return (4, 4) if bm <= 16 else (4, 3)


def int4_blocks(target: str, m: int, k: int, n: int, group_size: int) -> MatmulBlocks | None:
    """INT4 W4A16 tiles; None when no tiling fits (the caller raises UnsupportedShapeError).

    A K step covers whole groups (bk packed rows = bk / (G/2) scale rows); on TPU that scale-row count is a
    multiple of 8 so the dynamic slice of the (f32, in VMEM) scales stays sublane-tile aligned.
    """
    half = group_size // 2
    kh = k // 2
    if target == "gpu":
        bm = min(max(16, next_pow2(m)), 64 if m <= 64 else 128)
        bn = _largest_divisor(n, (128, 64, 32, 16))
        bk = _largest_divisor(kh, [c for c in (64, 128, 32, 16) if c % half == 0])
        if bn is None or bk is None or not is_pow2(half):
            return None
        return MatmulBlocks(bm, bn, bk)
    bm = min(max(8, cdiv(m, 8) * 8), 256)
    bn = _largest_divisor(n, (256, 128)) or (n if n <= 512 else None)
    bk = _largest_divisor(kh, [c for c in (1024, 512, 256, 128) if c % (8 * half) == 0])
    if bn is None or bk is None or half % 8:
        return None
    return MatmulBlocks(bm, bn, bk)


def fp8_blocks(target: str, m: int, k: int, n: int, scale_block: tuple[int, int]) -> MatmulBlocks | None:
    """FP8 tiles. Block scales need bn | scale-block-N and bk | scale-block-K; per-channel scales (K, 1) any."""
    bks, bns = scale_block
    per_channel = bks == k and bns == 1
    if target == "gpu":
        bm = min(max(16, next_pow2(m)), 128)
        bn_cands = (128, 64, 32, 16)
        bk_cands = (128, 64, 32, 16)
    else:
        bm = min(max(8, cdiv(m, 8) * 8), 256)
        bn_cands = (256, 128)
        bk_cands = (512, 256, 128)
    if per_channel:
        bn = _largest_divisor(n, bn_cands)
        bk = _largest_divisor(k, bk_cands)
    else:
        bn = _largest_divisor(n, [c for c in bn_cands if bns % c == 0])
        bk = _largest_divisor(k, [c for c in bk_cands if bks % c == 0])
    if bn is None or bk is None:
        return None
    return MatmulBlocks(bm, bn, bk)


def int4_vmem_bytes(blocks: MatmulBlocks, k: int, group_size: int, x_itemsize: int) -> int:
    """TPU VMEM of the INT4 kernel: double-buffered x halves, packed weights and scales, out, f32 temporaries."""
    kh = k // 2
    x = 2 * 2 * blocks.bm * kh * x_itemsize
    w = 2 * kh * blocks.bn
    s = 2 * (k // group_size) * blocks.bn * 4
    out = 2 * blocks.bm * blocks.bn * x_itemsize
    tmp = 4 * blocks.bk * blocks.bn * 4 + blocks.bm * blocks.bn * 4
    return x + w + s + out + tmp


def fp8_vmem_bytes(blocks: MatmulBlocks, k: int, x_itemsize: int) -> int:
    """TPU VMEM of the FP8 kernel: double-buffered x rows and weight columns over all of K, out, f32 temporaries."""
    return (2 * blocks.bm * k * x_itemsize + 2 * k * blocks.bn + 2 * blocks.bm * blocks.bn * x_itemsize
            + 2 * blocks.bk * blocks.bn * 4 + blocks.bm * blocks.bn * 4)


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
    block_q: int  # query rows per program (GPU/TPU) or per lax.map step (reference)
    block_k: int  # keys per inner step; a key block no query of a query block can see is skipped
    num_warps: int = 4  # Triton only


def prefill_blocks(target: str, t: int, s: int) -> PrefillBlocks:
    """Flash-prefill tiles for T queries over S keys (GPU and TPU sizes are starting points, not tuned on a device).

    reference (XLA on the CPU): 512 x 512, the per-step f32 logits are 1 MiB per head; short sequences use one
    block. GPU: 64 x 64 with 4 warps (powers of two for Triton). TPU: 256 x 512, (8, 128)-aligned; VMEM per step
    ~ 2 buffers x (bq + 2 bk) x d x 2 bytes + bq x bk x 4 bytes of logits ~ 3 MiB at d = 192, under the limit.
    """
    if target == "reference":
        return PrefillBlocks(min(512, t), min(512, s))
    if target == "gpu":
        return PrefillBlocks(min(64, max(16, next_pow2(t))), min(64, max(16, next_pow2(s))))
    return PrefillBlocks(min(256, cdiv(t, 8) * 8), min(512, cdiv(s, 128) * 128))
