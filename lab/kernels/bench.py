"""Kernel benchmark: each Pallas kernel against its XLA reference and against limits measured in the same run.

``python -m lab.kernels.bench`` on a GPU (or TPU) measures two ceilings first, a large device-to-device
copy (read + write bytes per second) and a large BF16 matmul (FLOP/s), then times:

* decode attention, batch 64 x 8K context: GQA (64 query / 8 KV heads, head_dim 128, page 64) with BF16
  and FP8 pages, and Kimi-like MLA (64 heads, kv_lora_rank 512, rope 64) with BF16 and FP8 latents;
* W4A16 (INT4, group 32) at M = 1, 8, 32, 64 for K = N = 7168 and the Kimi expert shapes (7168 -> 2048,
  2048 -> 7168), next to a BF16 XLA matmul of the same shape, and the grouped MoE form (48 local experts),
  INT4 and FP8 (128x128 blocks; its reference dequantizes the whole expert stack, the old serving path);
* prefill matmuls at M = 4096, K = N = 7168: FP8 (128x128 blocks; W8A8 on a GPU) and INT4 (group 32).

It prints one table (achieved GB/s and fraction of the measured copy bandwidth for the memory-bound
rows, TFLOP/s and fraction of the measured matmul rate for the compute-bound rows, speed-up over the
XLA reference) and the design goals as ratios measured side by side. Weights smaller than ~256 MiB are
cycled through several copies so the GPU's L2 cache cannot serve repeated iterations.

``--smoke`` runs the same code at tiny sizes with one iteration (on a CPU: Pallas interpret mode), only to
check that the script works; its numbers mean nothing. ``--out FILE`` also writes the table as markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import common, fp8_matmul, int4_matmul, mla_attention, paged_attention


@dataclasses.dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    matmul: int  # n for the n x n x n BF16 ceiling matmul
    batch: int
    context: int
    page_size: int
    gqa_heads: tuple[int, int, int]  # (query heads, kv heads, head_dim)
    mla_heads: tuple[int, int, int]  # (heads, kv_lora_rank, rope_dim)
    decode_m: tuple[int, ...]
    w4_shapes: tuple[tuple[int, int], ...]  # (K, N)
    experts: tuple[int, int, int, int]  # (local experts, top-k, K, N)
    prefill: tuple[int, int, int]  # (M, K, N)
    iters: int
    trials: int
    l2_bytes: int  # weights are replicated until their copies exceed this
    min_copies: int  # ops with weight copies run at least this many per timed program


FULL = Sizes(2 << 30, 8192, 64, 8192, 64, (64, 8, 128), (64, 512, 64), (1, 8, 32, 64),
             ((7168, 7168), (7168, 2048), (2048, 7168)), (48, 8, 7168, 2048), (4096, 7168, 7168), 20, 5, 256 << 20, 8)
SMOKE = Sizes(1 << 20, 128, 2, 64, 16, (8, 2, 128), (4, 128, 32), (1,), ((256, 128),), (3, 2, 256, 128),
              (16, 256, 128), 1, 1, 0, 1)


@dataclasses.dataclass
class Row:
    name: str
    impl: str
    seconds: float
    bytes: float = 0.0  # bytes the op must move (memory-bound rows)
    flops: float = 0.0  # (compute-bound rows)
    ref_seconds: float | None = None


def timeit(fn: Callable, arg_sets: list[tuple], iters: int, trials: int) -> float:
    """Median seconds per op. All ``arg_sets`` (copies of the weights, which also defeat the L2 cache) go through
    ``fn`` inside one jitted program, so a call's host dispatch is paid once per set of copies, not once per op:
    the first H200 run (benchmarks/gpu/2026-12-04-h200) dispatched one call per op, and a BF16 matmul took as long
    at 29 MB of weights as at 103 MB."""
    batched = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(batched(arg_sets))
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = batched(arg_sets)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (iters * len(arg_sets)))
    return statistics.median(samples)


def copies(make: Callable[[jax.Array], tuple], nbytes: int, sz: Sizes, seed: int) -> list[tuple]:
    """Enough copies of an op's weights to exceed the L2 cache, and at least ``sz.min_copies`` of them."""
    n = max(sz.min_copies, -(-sz.l2_bytes // max(nbytes, 1)))
    return [make(jax.random.key(seed + i)) for i in range(n)]


def ceilings(sz: Sizes) -> tuple[float, float]:
    """(copy bytes/s counting read + write, BF16 matmul FLOP/s)."""
    x = jnp.ones((sz.copy_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)
    t_copy = timeit(copy, [(x,)], sz.iters, sz.trials)
    a = jax.random.normal(jax.random.key(0), (sz.matmul, sz.matmul), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t_mm = timeit(mm, [(a, a)], sz.iters, sz.trials)
    return 2 * sz.copy_bytes / t_copy, 2 * sz.matmul**3 / t_mm


def _pool(key, sz: Sizes, row: tuple[int, ...], dtype, scale_shape):
    b, pages_per_seq = sz.batch, sz.context // sz.page_size
    num_pages = b * pages_per_seq
    k1, k2, k3 = jax.random.split(key, 3)
    pages = jax.random.normal(k1, (num_pages, sz.page_size, *row), jnp.float32).astype(dtype)
    scales = jax.random.uniform(k2, (num_pages, sz.page_size, *scale_shape), jnp.float32, 0.5, 1.5) / 8
    table = jax.random.permutation(k3, num_pages).reshape(b, pages_per_seq).astype(jnp.int32)
    return pages, (scales if dtype == jnp.float8_e4m3fn else None), table


def bench_attention(sz: Sizes, prov: common.Provenance) -> list[Row]:
    rows = []
    b, lengths = sz.batch, jnp.full((sz.batch,), sz.context, jnp.int32)
    hq, hkv, d = sz.gqa_heads
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        kp, ks, table = _pool(jax.random.key(1), sz, (hkv, d), dtype, (hkv,))
        vp, vs, _ = _pool(jax.random.key(2), sz, (hkv, d), dtype, (hkv,))
        q = jax.random.normal(jax.random.key(3), (b, hq, d), jnp.bfloat16)
        nbytes = 2 * b * sz.context * hkv * (d * jnp.dtype(dtype).itemsize + (4 if ks is not None else 0))
        args = [(q, kp, vp, table, lengths, ks, vs)]
        times = {}
        for impl in ("pallas", "reference"):
            fn = jax.jit(lambda q, k, v, t, n, a, c, impl=impl: paged_attention.paged_decode_attention(
                q, k, v, t, n, k_scales=a, v_scales=c, impl=impl, provenance=prov))
            times[impl] = timeit(fn, args, sz.iters, sz.trials)
        rows.append(Row(f"gqa decode {jnp.dtype(dtype).name} pages B{b} L{sz.context}", "pallas", times["pallas"],
                        nbytes, ref_seconds=times["reference"]))
    h, r, rope = sz.mla_heads
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        x, sc, table = _pool(jax.random.key(4), sz, (r + rope,), dtype, ())
        ql = jax.random.normal(jax.random.key(5), (b, h, r), jnp.bfloat16)
        qr = jax.random.normal(jax.random.key(6), (b, h, rope), jnp.bfloat16)
        nbytes = b * sz.context * ((r + rope) * jnp.dtype(dtype).itemsize + (4 if sc is not None else 0))
        times = {}
        for impl in ("pallas", "reference"):
            fn = jax.jit(lambda a, c, p, t, n, s, impl=impl: mla_attention.mla_decode_attention(
                a, c, p, t, n, scales=s, sm_scale=(192**-0.5), impl=impl, provenance=prov))
            times[impl] = timeit(fn, [(ql, qr, x, table, lengths, sc)], sz.iters, sz.trials)
        rows.append(Row(f"mla decode {jnp.dtype(dtype).name} latents B{b} L{sz.context} H{h}", "pallas",
                        times["pallas"], nbytes, ref_seconds=times["reference"]))
    return rows


def _int4_weight(key, lead, k, n):
    return int4_matmul.quantize_int4(jax.random.normal(key, (*lead, k, n), jnp.float32), 32, jnp.bfloat16)


def bench_w4a16(sz: Sizes, prov: common.Provenance) -> list[Row]:
    rows = []
    for k, n in sz.w4_shapes:
        w4 = copies(lambda key, k=k, n=n: (_int4_weight(key, (), k, n),), k * n // 2, sz, 10)
        wb = copies(lambda key, k=k, n=n: (jax.random.normal(key, (k, n), jnp.bfloat16),), 2 * k * n, sz, 20)
        for m in sz.decode_m:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            t4 = timeit(jax.jit(lambda x, w: int4_matmul.int4_matmul(x, w, impl="pallas", provenance=prov)),
                        [(x, *a) for a in w4], sz.iters, sz.trials)
            tr = timeit(jax.jit(lambda x, w: int4_matmul.int4_matmul_reference(x, w)), [(x, *a) for a in w4],
                        sz.iters, sz.trials)
            tb = timeit(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)),
                        [(x, *a) for a in wb], sz.iters, sz.trials)
            w4_bytes = w4[0][0].nbytes + 2 * m * (k + n)
            rows.append(Row(f"w4a16 M{m} K{k} N{n}", "pallas", t4, w4_bytes, ref_seconds=tr))
            rows.append(Row(f"bf16 matmul M{m} K{k} N{n}", "xla", tb, 2 * k * n + 2 * m * (k + n)))
    e, topk, k, n = sz.experts
    m = sz.decode_m[-1]
    rows_x = m * topk
    we = _int4_weight(jax.random.key(30), (e,), k, n)
    x = jax.random.normal(jax.random.key(31), (rows_x, k), jnp.bfloat16)
    experts = jax.random.randint(jax.random.key(32), (rows_x,), 0, e)
    sizes = jnp.bincount(experts, length=e).astype(jnp.int32)
    touched = int(jnp.sum(sizes > 0))
    tg = timeit(jax.jit(lambda x, w, g: int4_matmul.int4_grouped_matmul(x, w, g, impl="pallas", provenance=prov)),
                [(x, we, sizes)], sz.iters, sz.trials)
    tr = timeit(jax.jit(int4_matmul.int4_grouped_matmul_reference), [(x, we, sizes)], sz.iters, sz.trials)
    rows.append(Row(f"w4a16 grouped {rows_x} rows {touched}/{e} experts K{k} N{n}", "pallas", tg,
                    touched * we.nbytes / e, ref_seconds=tr))
    w8 = fp8_matmul.quantize_fp8(jax.random.normal(jax.random.key(33), (e, k, n), jnp.float32), (128, 128))
    t8 = timeit(jax.jit(lambda x, w, g: fp8_matmul.fp8_grouped_matmul(x, w, g, act_quant=False, impl="pallas",
                                                                      provenance=prov)),
                [(x, w8, sizes)], sz.iters, sz.trials)
    tr8 = timeit(jax.jit(fp8_matmul.fp8_grouped_matmul_reference), [(x, w8, sizes)], sz.iters, sz.trials)
    rows.append(Row(f"fp8 grouped W8A16 {rows_x} rows {touched}/{e} experts K{k} N{n}", "pallas", t8,
                    touched * w8.nbytes / e, ref_seconds=tr8))
    return rows


def bench_prefill(sz: Sizes, prov: common.Provenance) -> list[Row]:
    m, k, n = sz.prefill
    flops = 2 * m * k * n
    x = jax.random.normal(jax.random.key(40), (m, k), jnp.bfloat16)
    w8 = fp8_matmul.quantize_fp8(jax.random.normal(jax.random.key(41), (k, n), jnp.float32), (128, 128))
    w4 = _int4_weight(jax.random.key(42), (), k, n)
    rows = []
    for name, fn, ref, w in (("fp8", fp8_matmul.fp8_matmul, fp8_matmul.fp8_matmul_reference, w8),
                             ("int4", int4_matmul.int4_matmul, int4_matmul.int4_matmul_reference, w4)):
        t = timeit(jax.jit(functools.partial(fn, impl="pallas", provenance=prov)), [(x, w)], sz.iters, sz.trials)
        tr = timeit(jax.jit(ref), [(x, w)], sz.iters, sz.trials)
        rows.append(Row(f"prefill {name} M{m} K{k} N{n}", "pallas", t, flops=flops, ref_seconds=tr))
    return rows


def table(rows: list[Row], copy_bw: float, mm_rate: float) -> list[str]:
    lines = ["| op | impl | ms | GB/s | of copy BW | TFLOP/s | of BF16 matmul | vs XLA ref |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbs = f"{r.bytes / r.seconds / 1e9:.0f}" if r.bytes else ""
        frac = f"{r.bytes / r.seconds / copy_bw:.2f}" if r.bytes else ""
        tfs = f"{r.flops / r.seconds / 1e12:.0f}" if r.flops else ""
        mfr = f"{r.flops / r.seconds / mm_rate:.2f}" if r.flops else ""
        vs = f"{r.ref_seconds / r.seconds:.2f}x" if r.ref_seconds else ""
        lines.append(f"| {r.name} | {r.impl} | {r.seconds * 1e3:.3f} | {gbs} | {frac} | {tfs} | {mfr} | {vs} |")
    return lines


def goals(rows: list[Row], copy_bw: float, sz: Sizes) -> list[str]:
    by = {r.name: r for r in rows}
    find = lambda prefix: next(r for r in rows if r.name.startswith(prefix))  # noqa: E731
    fp8, bf16 = find("gqa decode float8"), find("gqa decode bfloat16")
    out = [f"FP8 paged decode attention at {fp8.bytes / fp8.seconds / copy_bw:.2f} of copy bandwidth (goal >= 0.75)",
           f"FP8 pages {bf16.seconds / fp8.seconds:.2f}x faster than BF16 pages (goal >= 1.7)"]
    for m in (m for m in sz.decode_m if m <= 16):
        k, n = sz.w4_shapes[0]
        w4, bf = by[f"w4a16 M{m} K{k} N{n}"], by[f"bf16 matmul M{m} K{k} N{n}"]
        out.append(f"W4A16 M{m}: {bf.seconds / w4.seconds:.2f}x faster than the BF16 XLA matmul (goal >= 3)")
    p8, p4 = find("prefill fp8"), find("prefill int4")
    out.append(f"prefill M{sz.prefill[0]}: FP8 {p4.seconds / p8.seconds:.2f}x faster than INT4 (goal > 1)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one iteration: checks the script runs")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    sz = SMOKE if args.smoke else FULL
    dev = jax.devices()[0]
    copy_bw, mm_rate = ceilings(sz)
    header = [f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}"
              + (" -- SMOKE RUN, numbers are meaningless" if args.smoke else ""),
              f"measured copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write), BF16 matmul {mm_rate / 1e12:.0f} "
              f"TFLOP/s ({sz.matmul}^3)", ""]
    prov = common.Provenance()  # what each kernel call built
    rows = bench_attention(sz, prov) + bench_w4a16(sz, prov) + bench_prefill(sz, prov)
    lines = header + table(rows, copy_bw, mm_rate) + [""] + goals(rows, copy_bw, sz) + ["", "kernel provenance:"]
    lines += [f"  {r['op']} [{r['platform']}] {r['impl']} x{r['count']} {r['reason']}"
              for r in common.provenance_rows(prov)]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
