"""Kernel correctness on the device: every Pallas kernel, compiled (``impl="pallas"``, not interpret mode), against
its reference at serving shapes, before anything is timed.

``python -m lab.kernels.device_check [--smoke] [--out FILE.json]`` builds fresh random inputs, runs each kernel
with ``impl="pallas"`` and ``interpret=None`` and ``target=None`` (so the body is the one for the platform the
call lowers for: Triton on a GPU, Mosaic on a TPU; on a CPU, interpret mode), compares with the kernel's
reference by relative Frobenius error (float32: 1e-5, which only holds with exact f32 dots; bf16: 1e-2), and
prints one line per check. It exits with status 1 if any check fails or raises. ``--smoke`` uses tiny shapes
(for the CPU: the recipe's smoke test). The JSON has each check's error, tolerance and time, the versions and
the kernel provenance (:func:`pallas_kernels.common.provenance_rows` of the calls' sink).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common, flash_prefill, fp8_matmul, int4_matmul, mla_attention, paged_attention, sparse_mla

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int
    context: int
    page_size: int
    gqa: tuple[int, int, int]  # query heads, kv heads, head_dim
    mla: tuple[int, int, int]  # heads, kv_lora_rank, rope_dim
    dense: tuple[int, int]  # K, N of the dense matmuls
    experts: tuple[int, int, int, int]  # local experts, rows, K, N
    topk: int  # sparse MLA (GLM-5 DSA decode): selected tokens per row
    prefill: tuple[int, int, int, int]  # flash prefill (MLA expanded form): tokens, heads, dk, dv


FULL = Shapes(8, 2048, 64, (64, 8, 128), (64, 512, 64), (7168, 2048), (32, 64, 6144, 2048), 1024, (1024, 16, 192, 128))
SMOKE = Shapes(2, 40, 16, (4, 2, 128), (4, 128, 32), (256, 128), (3, 8, 256, 128), 24, (40, 2, 48, 32))


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[str], jax.Array]  # impl -> output
    dtype: str  # tolerance key


def _pool(rng, s: Shapes, row: tuple[int, ...], dtype):
    """Random pages (every page owned by one row), page table, ragged lengths (incl. 1 and a page boundary)."""
    maxp = -(-s.context // s.page_size)
    lengths = rng.integers(1, s.context + 1, size=s.batch)
    lengths[0], lengths[-1] = 1, s.page_size * max(1, maxp // 2)
    table = rng.permutation(s.batch * maxp).reshape(s.batch, maxp)
    vals = rng.standard_normal((s.batch * maxp, s.page_size, *row)).astype(np.float32)
    scales = None
    if dtype == jnp.float8_e4m3fn:
        scales = np.abs(vals).max(axis=-1) / 448.0
        vals = vals / scales[..., None]
        scales = jnp.asarray(scales)
    return jnp.asarray(vals).astype(dtype), scales, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def checks(s: Shapes, prov: common.Provenance, seed: int = 0) -> list[Check]:
    """The checks at shapes ``s``; each kernel call counts what it built in ``prov``."""
    rng = np.random.default_rng(seed)
    out: list[Check] = []
    hq, hkv, d = s.gqa
    for dt in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32):
        qdt = jnp.float32 if dt == jnp.float32 else jnp.bfloat16
        k, ks, pt, lens = _pool(rng, s, (hkv, d), dt)
        v, vs, _, _ = _pool(rng, s, (hkv, d), dt)
        q = jnp.asarray(rng.standard_normal((s.batch, hq, d)), qdt)
        out.append(Check(f"paged_gqa {jnp.dtype(dt).name} B{s.batch} ctx{s.context}", functools.partial(
            lambda impl, q, k, v, pt, lens, ks, vs: paged_decode(q, k, v, pt, lens, ks, vs, impl, prov),
            q=q, k=k, v=v, pt=pt, lens=lens, ks=ks, vs=vs), jnp.dtype(qdt).name))
    h, r, rope = s.mla
    for dt in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32):
        qdt = jnp.float32 if dt == jnp.float32 else jnp.bfloat16
        x, sc, pt, lens = _pool(rng, s, (r + rope,), dt)
        ql = jnp.asarray(rng.standard_normal((s.batch, h, r)), qdt)
        qr = jnp.asarray(rng.standard_normal((s.batch, h, rope)), qdt)
        out.append(Check(f"paged_mla {jnp.dtype(dt).name} H{h} B{s.batch} ctx{s.context}", functools.partial(
            lambda impl, ql, qr, x, pt, lens, sc: jax.jit(functools.partial(
                mla_attention.mla_decode_attention, scales=sc, sm_scale=r ** -0.5, impl=impl, provenance=prov))(
                ql, qr, x, pt, lens),
            ql=ql, qr=qr, x=x, pt=pt, lens=lens, sc=sc), jnp.dtype(qdt).name))
        idx = jnp.asarray(rng.integers(-1, s.context, size=(s.batch, s.topk)), jnp.int32)  # -1 and >= len: masked
        out.append(Check(f"sparse_mla {jnp.dtype(dt).name} H{h} B{s.batch} K{s.topk}", functools.partial(
            lambda impl, ql, qr, x, pt, idx, lens, sc: jax.jit(functools.partial(
                sparse_mla.sparse_mla_decode_attention, scales=sc, sm_scale=r ** -0.5, impl=impl, provenance=prov))(
                ql, qr, x, pt, idx, lens), ql=ql, qr=qr, x=x, pt=pt, idx=idx, lens=lens, sc=sc), jnp.dtype(qdt).name))
    t, hp, dk, dv = s.prefill
    for dt in (jnp.bfloat16, jnp.float32):
        q, k, v = (jnp.asarray(rng.standard_normal((2, t, hp, d_)), dt) for d_ in (dk, dk, dv))
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
        lens = jnp.asarray([t, t // 2 + 1], jnp.int32)
        out.append(Check(f"flash_prefill {jnp.dtype(dt).name} T{t} H{hp} dk{dk} dv{dv}", functools.partial(
            lambda impl, q, k, v, pos, lens: jax.jit(functools.partial(
                flash_prefill.flash_prefill, sm_scale=dk ** -0.5, impl=impl, provenance=prov))(q, k, v, pos, lens),
            q=q, k=k, v=v, pos=pos, lens=lens), jnp.dtype(dt).name))
    kd, nd = s.dense
    for m, xdt in ((1, jnp.bfloat16), (16, jnp.bfloat16), (4, jnp.float32)):
        w = int4_matmul.quantize_int4(jnp.asarray(rng.standard_normal((kd, nd)), jnp.float32), 32)
        x = jnp.asarray(rng.standard_normal((m, kd)), xdt)
        out.append(Check(f"int4_matmul M{m} K{kd} N{nd} {jnp.dtype(xdt).name}", functools.partial(
            lambda impl, x, w: jax.jit(functools.partial(int4_matmul.int4_matmul, impl=impl, provenance=prov))(x, w),
            x=x, w=w),
            jnp.dtype(xdt).name))
        wf = fp8_matmul.quantize_fp8(jnp.asarray(rng.standard_normal((kd, nd)), jnp.float32))
        out.append(Check(f"fp8_matmul W8A16 M{m} K{kd} N{nd} {jnp.dtype(xdt).name}", functools.partial(
            lambda impl, x, w: jax.jit(functools.partial(fp8_matmul.fp8_matmul, act_quant=False, impl=impl,
                                                         provenance=prov))(x, w),
            x=x, w=wf), jnp.dtype(xdt).name))
        if xdt == jnp.bfloat16:  # W8A8 (the GPU default for 16-bit activations): activations rounded to e4m3
            out.append(Check(f"fp8_matmul W8A8 M{m} K{kd} N{nd} {jnp.dtype(xdt).name}", functools.partial(
                lambda impl, x, w: jax.jit(functools.partial(fp8_matmul.fp8_matmul, act_quant=True, impl=impl,
                                                             provenance=prov))(x, w),
                x=x, w=wf), jnp.dtype(xdt).name))
    e, rows, ke, ne = s.experts
    sizes = rng.multinomial(rows, np.ones(e) / e)
    sizes[0] = 0  # an empty expert
    gs = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, ke)), jnp.bfloat16)
    wi = int4_matmul.quantize_int4(jnp.asarray(rng.standard_normal((e, ke, ne)), jnp.float32), 128)
    out.append(Check(f"int4_grouped E{e} M{rows} K{ke} N{ne}", functools.partial(
        lambda impl, x, w: jax.jit(functools.partial(int4_matmul.int4_grouped_matmul, impl=impl, provenance=prov))(
            x, w, gs),
        x=x, w=wi), "bfloat16"))
    for block in ((128, 128), None):
        wf = fp8_matmul.quantize_fp8(jnp.asarray(rng.standard_normal((e, ke, ne)), jnp.float32), block)
        for aq in (False, True):
            out.append(Check(f"fp8_grouped {'block' if block else 'channel'} {'W8A8' if aq else 'W8A16'} E{e} "
                             f"M{rows} K{ke} N{ne}", functools.partial(
                lambda impl, x, w, aq: jax.jit(functools.partial(fp8_matmul.fp8_grouped_matmul, act_quant=aq,
                                                                 impl=impl, provenance=prov))(x, w, gs),
                x=x, w=wf, aq=aq),
                "bfloat16"))
    return out


def paged_decode(q, k, v, pt, lens, ks, vs, impl, prov):
    fn = functools.partial(paged_attention.paged_decode_attention, k_scales=ks, v_scales=vs, impl=impl, provenance=prov)
    return jax.jit(fn)(q, k, v, pt, lens)


def fp8_roundtrip_kept() -> bool:
    """Whether ``jit(lambda x: x.astype(e4m3).astype(f32))`` rounds at all on this backend (fresh random input)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal(4096), jnp.float32)
    rounded = jax.jit(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32))(x)
    return bool(jnp.any(rounded != x))


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpret mode)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    rows, failures = [], 0
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    kept = fp8_roundtrip_kept()
    print(f"a jitted f32 -> e4m3 -> f32 round trip rounds: {kept} (False: XLA drops the rounding, as excess precision "
          "allows; the W8A8 references hold their e4m3 values behind an optimization barrier)")
    prov = common.Provenance()  # what each kernel call built
    for c in checks(SMOKE if args.smoke else FULL, prov):
        t0 = time.perf_counter()
        try:
            ref = c.run("reference")
            out = c.run("pallas")
            err, note = rel_err(out, ref), ""
        except Exception as e:  # noqa: BLE001 - reported per check; the command fails
            err, note = float("inf"), f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ok = err < TOL[c.dtype]
        failures += not ok
        rows.append(dict(name=c.name, ok=ok, rel_err=err, tol=TOL[c.dtype], seconds=time.perf_counter() - t0,
                         error=note))
        print(f"{'ok  ' if ok else 'FAIL'} {c.name:<58} err {err:.2e} (tol {TOL[c.dtype]:.0e}) {note}", flush=True)
    print(f"{len(rows) - failures}/{len(rows)} kernel checks passed")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                           fp8_roundtrip_kept=kept, smoke=args.smoke, checks=rows,
                           provenance=common.provenance_rows(prov)),
                      f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
