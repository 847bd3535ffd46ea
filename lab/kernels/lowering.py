"""Lowering check: export every Pallas kernel for TPU and CUDA from a CPU-only machine.

``python -m lab.kernels.lowering`` traces each kernel at serving-sized shapes with ``impl="pallas"``,
``interpret=False`` and the matching ``target``, runs ``jax.export`` with ``platforms=["tpu"]`` (Mosaic TPU:
block-shape and tiling rules are checked here, not in interpret mode) and ``platforms=["cuda"]`` (Pallas
Triton; its custom call is not on jax.export's stable list, hence the ``disabled_checks`` entry), and
prints one line per kernel x platform with the custom call found in the exported module. It exits with
status 1 if any export fails or lacks its kernel's custom call (i.e. silently fell back to XLA).

What this does not check: the Mosaic TPU compiler's layout passes and Triton's PTX compilation run only on
the device, so a kernel that exports here can still fail to compile there.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import export

from pallas_kernels import flash_prefill, fp8_matmul, int4_matmul, mla_attention, paged_attention, sparse_mla

PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}  # export platform -> kernel target
EXPECTED_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
DISABLED = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[str], Callable]  # target -> function of the abstract args
    args: tuple
    platforms: tuple[str, ...] = ("tpu", "cuda")


def _a(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _gqa(dtype, page_size: int, *, b: int = 8, hkv: int = 8, g: int = 8, d: int = 128, p: int = 1024,
         maxp: int = 64) -> Case:
    qdt = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    scaled = dtype == jnp.float8_e4m3fn
    args = (_a((b, hkv * g, d), qdt), _a((p, page_size, hkv, d), dtype), _a((p, page_size, hkv, d), dtype),
            _a((b, maxp), jnp.int32), _a((b,), jnp.int32))
    args += (_a((p, page_size, hkv), jnp.float32),) * 2 if scaled else ()

    def build(target):
        def f(q, k, v, pt, lens, ks=None, vs=None):
            return paged_attention.paged_decode_attention(q, k, v, pt, lens, k_scales=ks, v_scales=vs, impl="pallas",
                                                          interpret=False, target=target)
        return f

    return Case(f"paged_gqa {jnp.dtype(dtype).name} page{page_size}", build, args)


def _mla(dtype, page_size: int, *, b: int = 8, h: int = 16, r: int = 512, rope: int = 64, p: int = 1024,
         maxp: int = 64) -> Case:
    qdt = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    args = (_a((b, h, r), qdt), _a((b, h, rope), qdt), _a((p, page_size, r + rope), dtype), _a((b, maxp), jnp.int32),
            _a((b,), jnp.int32))
    args += (_a((p, page_size), jnp.float32),) if dtype == jnp.float8_e4m3fn else ()

    def build(target):
        def f(ql, qr, x, pt, lens, sc=None):
            return mla_attention.mla_decode_attention(ql, qr, x, pt, lens, scales=sc, sm_scale=0.0722, impl="pallas",
                                                      interpret=False, target=target)
        return f

    return Case(f"paged_mla {jnp.dtype(dtype).name} page{page_size}", build, args)


def _sparse_mla(dtype, k: int, *, b: int = 8, h: int = 16, r: int = 512, rope: int = 64, p: int = 1024, s: int = 64,
                maxp: int = 64) -> Case:
    """GLM-5 DSA decode: 64 heads (8-way TP of 64 -> 8 local; 16 here), index_topk k selected tokens."""
    qdt = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    args = (_a((b, h, r), qdt), _a((b, h, rope), qdt), _a((p, s, r + rope), dtype), _a((b, maxp), jnp.int32),
            _a((b, k), jnp.int32), _a((b,), jnp.int32))
    args += (_a((p, s), jnp.float32),) if dtype == jnp.float8_e4m3fn else ()

    def build(target):
        def f(ql, qr, x, pt, idx, lens, sc=None):
            return sparse_mla.sparse_mla_decode_attention(ql, qr, x, pt, idx, lens, scales=sc, sm_scale=0.0722,
                                                          impl="pallas", interpret=False, target=target)
        return f

    return Case(f"sparse_mla {jnp.dtype(dtype).name} K{k}", build, args)


def _int4(m: int, k: int, n: int, group: int, scale_dtype, experts: int = 0) -> Case:
    def build(target):
        if experts:
            def f(x, packed, scale, sizes):
                return int4_matmul.int4_grouped_matmul(x, int4_matmul.Int4Weight(packed, scale, group), sizes,
                                                       impl="pallas", interpret=False, target=target)
        else:
            def f(x, packed, scale):
                return int4_matmul.int4_matmul(x, int4_matmul.Int4Weight(packed, scale, group), impl="pallas",
                                               interpret=False, target=target)
        return f

    lead = (experts,) if experts else ()
    args = (_a((m, k), jnp.bfloat16), _a((*lead, k // 2, n), jnp.uint8), _a((*lead, k // group, n), scale_dtype))
    args += (_a((experts,), jnp.int32),) if experts else ()
    kind = f"int4_grouped E{experts}" if experts else "int4_matmul"
    return Case(f"{kind} M{m} K{k} N{n} g{group} {jnp.dtype(scale_dtype).name}-scale", build, args)


def _fp8(m: int, k: int, n: int, block, act_quant: bool, experts: int = 0) -> Case:
    bk, bn = (k, 1) if block is None else block
    def build(target):
        kw = dict(act_quant=act_quant, impl="pallas", interpret=False, target=target)
        if experts:
            def f(x, q, s, sizes):
                return fp8_matmul.fp8_grouped_matmul(x, fp8_matmul.Fp8Weight(q, s, (bk, bn)), sizes, **kw)
        else:
            def f(x, q, s):
                return fp8_matmul.fp8_matmul(x, fp8_matmul.Fp8Weight(q, s, (bk, bn)), **kw)
        return f

    lead = (experts,) if experts else ()
    args = (_a((m, k), jnp.bfloat16), _a((*lead, k, n), jnp.float8_e4m3fn),
            _a((*lead, -(-k // bk), -(-n // bn)), jnp.float32))
    args += (_a((experts,), jnp.int32),) if experts else ()
    kind = "per-channel" if block is None else f"block{bk}x{bn}"
    name = f"fp8_grouped E{experts}" if experts else "fp8_matmul"
    return Case(f"{name} M{m} K{k} N{n} {kind} {'W8A8' if act_quant else 'W8A16'}", build, args,
                ("cuda",) if act_quant else ("tpu", "cuda"))


def _prefill(dtype, t: int, heads: int, kv_heads: int, dk: int, dv: int, *, b: int = 2) -> Case:
    args = (_a((b, t, heads, dk), dtype), _a((b, t, kv_heads, dk), dtype), _a((b, t, kv_heads, dv), dtype),
            _a((b, t), jnp.int32), _a((b,), jnp.int32))

    def build(target):
        def f(q, k, v, pos, lens):
            return flash_prefill.flash_prefill(q, k, v, pos, lens, sm_scale=0.0722, impl="pallas", interpret=False,
                                               target=target)
        return f

    form = "mla" if dk != dv else f"gqa{heads // kv_heads}"
    return Case(f"flash_prefill {jnp.dtype(dtype).name} {form} T{t} H{heads} dk{dk} dv{dv}", build, args)


def cases() -> list[Case]:
    """The shapes every kernel must lower at (Kimi K2 / GLM-class decode and prefill)."""
    return [
        _gqa(jnp.bfloat16, 16), _gqa(jnp.float8_e4m3fn, 16), _gqa(jnp.float8_e4m3fn, 64), _gqa(jnp.float32, 64),
        _mla(jnp.bfloat16, 64), _mla(jnp.float8_e4m3fn, 64), _mla(jnp.float8_e4m3fn, 16), _mla(jnp.float32, 16),
        _sparse_mla(jnp.float8_e4m3fn, 2048), _sparse_mla(jnp.bfloat16, 2048), _sparse_mla(jnp.float32, 100),
        _int4(8, 7168, 7168, 32, jnp.bfloat16), _int4(64, 7168, 2048, 128, jnp.float32),
        _int4(4096, 7168, 2048, 128, jnp.bfloat16),
        _int4(256, 7168, 2048, 32, jnp.bfloat16, experts=16), _int4(64, 2048, 7168, 128, jnp.float32, experts=8),
        _fp8(4096, 7168, 7168, (128, 128), False), _fp8(4096, 7168, 7168, (128, 128), True),
        _fp8(16, 7168, 2048, None, False), _fp8(16, 7168, 2048, None, True),
        # GLM-5 routed experts under 8-way EP (32 local of 256, hidden 6144, moe 2048): decode and prefill rows
        _fp8(64, 6144, 2048, (128, 128), False, experts=32), _fp8(64, 2048, 6144, None, False, experts=32),
        _fp8(4096, 6144, 2048, (128, 128), True, experts=32),
        _prefill(jnp.bfloat16, 4096, 64, 64, 192, 128), _prefill(jnp.bfloat16, 2000, 32, 4, 128, 128),
        _prefill(jnp.float32, 1024, 8, 8, 192, 128),
    ]


@dataclasses.dataclass(frozen=True)
class Result:
    ok: bool
    detail: str  # the custom calls found, or the error


def check(case: Case, platform: str) -> Result:
    """Export ``case`` for ``platform``; ok iff the export succeeds and contains the Pallas custom call."""
    try:
        fn = case.build(PLATFORMS[platform])
        exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=DISABLED)(*case.args)
    except Exception as e:  # noqa: BLE001 - reported, and the command fails
        return Result(False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", exported.mlir_module())
    found = sorted({c for c in calls if c == EXPECTED_CALL[platform]})
    if not found:
        return Result(False, f"no {EXPECTED_CALL[platform]} in the export (custom calls: {sorted(set(calls))})")
    return Result(True, f"{found[0]} x{calls.count(found[0])}")


def main(argv: list[str] | None = None) -> int:
    failures = 0
    print(f"jax {jax.__version__}; exporting from {jax.default_backend()}")
    print(f"{'kernel':<58} {'platform':<6} result")
    for case in cases():
        for platform in case.platforms:
            t0 = time.perf_counter()
            res = check(case, platform)
            failures += not res.ok
            status = "ok  " if res.ok else "FAIL"
            print(f"{case.name:<58} {platform:<6} {status} {res.detail} ({time.perf_counter() - t0:.2f}s)")
    print("all kernels lower" if failures == 0 else f"{failures} export(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
