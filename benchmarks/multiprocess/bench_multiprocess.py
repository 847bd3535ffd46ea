"""Two-process disaggregated serving against the single-process engine, side by side in one run (CPU).

1. Throughput (output tokens/s, prompt + generation wall time) at the same concurrency: ``ps.Engine``
   (disaggregated mode, one process) vs a prefill server process + decode server process + router, KV pulled over
   ``jax.experimental.transfer``. Same weights (float32 both phases), same FP8 decode KV, same requests; each arm
   is run once to compile and then measured on a second batch; greedy tokens are compared.
2. Bytes moved per prompt token on the wire, FP8 vs BF16 KV: measured from what the decode side pulled (whole
   staging pages, so a partly filled last page counts) and per valid prompt token, beside the in-process
   handoff's count and ``kv_bytes_per_token``.

Run: ``python benchmarks/multiprocess/bench_multiprocess.py [--out benchmarks/multiprocess/results.md]``.
On CPU the two processes share the same cores, so this measures the overhead of the split (control plane,
transfer, polling), not the gain of dedicated devices per phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import phaseserve as ps
from phaseserve.cache.paged import kv_bytes_per_token
from phaseserve.serving import ModelSpec, Router, ServerSpec

HF_CONFIG = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512, hidden_size=128,
                 intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
                 v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 n_group=2, topk_group=1, max_position_embeddings=1024, rms_norm_eps=1e-6)


def make_requests(tag: str, n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> list[ps.Request]:
    rng = np.random.default_rng(seed)
    return [ps.Request(id=f"{tag}{i}", prompt=rng.integers(1, vocab, prompt_len).tolist(), max_tokens=new_tokens,
                       ignore_eos=True) for i in range(n)]


def serve(max_batch: int, kv: str, page_size: int = 16) -> ps.ServeConfig:
    quant = ps.QuantConfig(prefill_weights="float32", decode_weights="float32", kv_dtype=kv,
                           prefill_kv_dtype="float32")
    return ps.ServeConfig(mode="disaggregated", quant=quant, max_batch=max_batch, max_prefill_tokens=4096,
                          cache=ps.CacheConfig(page_size=page_size, num_pages=max_batch * 8 + 8, max_pages_per_seq=8))


def run_engine(cfg, params, warm, reqs, max_batch):
    eng = ps.Engine(cfg, params, serve(max_batch, "float8_e4m3fn"))
    eng.generate(warm)
    t = time.perf_counter()
    outs = eng.generate(reqs)
    dt = time.perf_counter() - t
    return sum(len(o.tokens) for o in outs) / dt, {o.id: o.tokens for o in outs}, eng.handoff.bytes_moved


def run_router(router, warm, reqs):
    router.generate(warm, timeout_s=900)
    t = time.perf_counter()
    outs = router.generate(reqs, timeout_s=900)
    dt = time.perf_counter() - t
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return sum(len(o.tokens) for o in outs) / dt, {o.id: o.tokens for o in outs}


def spec(max_batch: int, kv: str, cache_dir: str) -> ServerSpec:
    return ServerSpec(model=ModelSpec(hf_config=HF_CONFIG, seed=0), serve=serve(max_batch, kv),
                      compilation_cache_dir=cache_dir, transfer_timeout_s=300.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    cfg = ps.ModelConfig.from_hf_config(HF_CONFIG)
    params = ps.init_params(cfg, jax.random.key(0), "float32")
    cache_dir = tempfile.mkdtemp(prefix="ps_jax_cache_")
    rows, wire = [], []
    for c in [int(x) for x in args.concurrency.split(",")]:
        warm = make_requests("w", c, args.prompt, args.new, cfg.vocab_size, seed=c)
        reqs = make_requests("q", c, args.prompt, args.new, cfg.vocab_size, seed=100 + c)
        e_tps, e_tok, _ = run_engine(cfg, params, warm, reqs, c)
        with Router(spec(c, "float8_e4m3fn", cache_dir), spec(c, "float8_e4m3fn", cache_dir)) as router:
            r_tps, r_tok = run_router(router, warm, reqs)
            dec = router.stats("decode")
        agree = np.mean([np.mean(np.equal(e_tok[k], r_tok[k])) for k in e_tok])
        rows.append((c, e_tps, r_tps, r_tps / e_tps, agree, dec["transfer_time"] / max(dec["transfers"], 1)))
        print(rows[-1], flush=True)
    for kv in ("float8_e4m3fn", "bfloat16"):
        lens = [5, 16, 27, 32, 40]  # a partly filled last page, exact pages
        reqs = [ps.Request(id=f"b{i}", prompt=list(range(1, n + 1)), max_tokens=2, ignore_eos=True)
                for i, n in enumerate(lens)]
        with Router(spec(8, kv, cache_dir), spec(8, kv, cache_dir)) as router:
            router.generate(reqs, timeout_s=900)
            dec = router.stats("decode")
        eng = ps.Engine(cfg, params, dataclasses.replace(serve(8, kv)))
        eng.generate(reqs)
        wire.append((kv, dec["bytes_pulled"] / sum(lens), dec["bytes_pulled"] / dec["valid_kv_tokens"],
                     kv_bytes_per_token(cfg, kv), eng.handoff.bytes_moved / sum(lens)))
        print(wire[-1], flush=True)
    lines = [
        "# Multi-process disaggregated serving (CPU)", "",
        f"Date {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores (shared); "
        f"jax {jax.__version__}; Python {platform.python_version()}.",
        f"Model: DeepSeek-V3 architecture (MLA + MoE), random weights, {json.dumps(HF_CONFIG)}; float32 weights in "
        f"both phases, FP8 (e4m3) decode KV; prompt {args.prompt} tokens, {args.new} new tokens, greedy; "
        "engine arm: `ps.Engine` disaggregated mode in one process; two-process arm: prefill server + decode "
        "server + router, KV over `jax.experimental.transfer` (loopback). Each arm compiled on a warm-up batch, "
        "then measured on a second batch of the same shapes, in the same run.", "",
        "| concurrency | single-process engine tok/s | two processes tok/s | ratio | greedy agreement | "
        "mean grant+pull+land s |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {c} | {e:.1f} | {r:.1f} | {x:.2f}x | {a:.3f} | {t:.4f} |" for c, e, r, x, a, t in rows], "",
        f"Bytes moved per prompt token (prompts of {[5, 16, 27, 32, 40]} tokens, page size 16, 4 layers, "
        "latent 64 + rope 16):", "",
        "| KV dtype | wire bytes / prompt token | wire bytes / valid token | kv_bytes_per_token | "
        "in-process handoff bytes / prompt token |",
        "|---|---:|---:|---:|---:|",
        *[f"| {k} | {a:.1f} | {b:.1f} | {c} | {d:.1f} |" for k, a, b, c, d in wire], "",
        f"FP8 / BF16 bytes on the wire: {wire[0][1] / wire[1][1]:.3f} (FP8 carries one f32 scale per token and layer).",
        "Wire bytes count whole staging pages (the last page of a prompt is padded); the in-process handoff moves "
        "the prefill batch's padded [B, T] arrays.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
