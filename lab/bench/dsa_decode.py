"""GLM-5 DSA decode benchmark: per-step attention cost against context length, the indexer's scoring pass reported
separately, and how often FP8 index keys select the same top-k as BF16 keys.

One GLM-5 attention layer at its real shapes (64 heads, kv_lora 512 + rope 64, indexer 32 heads x 128,
index_topk 2048) over a paged FP8 cache with page size 64, batch 2, at contexts 2x, 8x and 32x ``index_topk``.
Both parts are timed as separate jitted functions, interleaved over the contexts, median of ``repeats``:

- ``index``: :func:`phaseserve.cache.dsa.select_cached` (read the rows' index keys, score, top-k): linear in context;
- ``attention``: :func:`pallas_kernels.sparse_mla.sparse_mla_decode_attention` over the selected tokens (the
  reference on the CPU): flat in context.

Top-k agreement: the same index keys (a random GLM-5 indexer layer applied to random hidden states, LayerNorm and
RoPE included) quantized to FP8 (per-token scale, as the cache stores them) vs rounded to BF16, queries from the
same layer; reported as the mean overlap |A n B| / k and the fraction of queries with identical sets.

    python -m lab.bench.dsa_decode [out_dir]      # prints the table, writes dsa_decode.json there
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_mla import sparse_mla_decode_attention
from phaseserve.cache import dsa, paged
from phaseserve.config import ModelConfig
from phaseserve.model import indexer
from phaseserve.model.indexer import DSAQuery
from phaseserve.model.params import IndexerParams
from phaseserve.presets import preset

MULTIPLES = (2, 8, 32)
PAGE_SIZE = 64


def glm5_layer_config() -> ModelConfig:
    cfg = ModelConfig.from_hf_config(preset("glm-5"))
    return cfg.replace(num_layers=1, moe_layers=(False,), indexer_types=("full",))


def _pool(cfg: ModelConfig, batch: int, context: int, rng: np.random.Generator):
    """An FP8 pool holding ``batch`` rows of ``context`` random tokens, and its page table."""
    pages = context // PAGE_SIZE
    pool = paged.init_pool(cfg, batch * pages + 1, PAGE_SIZE, "float8_e4m3fn")
    table = jnp.asarray(1 + np.arange(batch * pages).reshape(batch, pages), jnp.int32)
    lat = jnp.asarray(rng.standard_normal((batch, context, cfg.kv_cache_width)), jnp.float32)
    key = jnp.asarray(rng.standard_normal((batch, context, cfg.index_head_dim)), jnp.float32)
    pool = jax.jit(paged.write_prompt)(pool, [(lat, key)], table, jnp.full((batch,), context, jnp.int32))
    return pool.layers[0], table


def _time(fn, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): on a shared CPU the second counts the work, not the waiting."""
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, time.process_time() - c0


def decode_timings(batch: int = 2, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Median seconds of the index pass and of the sparse attention per context, measured interleaved."""
    cfg = glm5_layer_config()
    rng = np.random.default_rng(seed)
    h, r, k = cfg.num_heads, cfg.kv_lora_rank, cfg.index_topk
    q = DSAQuery(jnp.asarray(rng.standard_normal((batch, h, r)), jnp.bfloat16),
                 jnp.asarray(rng.standard_normal((batch, h, cfg.qk_rope_head_dim)), jnp.bfloat16),
                 jnp.asarray(rng.standard_normal((batch, cfg.index_n_heads, cfg.index_head_dim)), jnp.bfloat16),
                 jnp.asarray(rng.standard_normal((batch, cfg.index_n_heads)), jnp.float32), k)
    index_fn = jax.jit(lambda pages, pt, lens: dsa.select_cached(pages, pt, lens, q)[0])
    attn_fn = jax.jit(lambda pages, pt, sel, lens: sparse_mla_decode_attention(
        q.q_latent, q.q_rope, paged.as_values(pages.latent), pt, sel, lens, scales=pages.scale,  # raw bits on CPU
        sm_scale=cfg.head_dim ** -0.5))
    cases = []
    for m in MULTIPLES:
        ctx = m * k
        pages, table = _pool(cfg, batch, ctx, rng)
        lens = jnp.full((batch,), ctx, jnp.int32)
        sel = index_fn(pages, table, lens)
        jax.block_until_ready(attn_fn(pages, table, sel, lens))
        cases.append({"multiple": m, "context": ctx, "args": (pages, table, lens, sel), "index": [], "attention": []})
    for _ in range(repeats):
        for c in cases:
            pages, table, lens, sel = c["args"]
            c["index"].append(_time(index_fn, pages, table, lens))
            c["attention"].append(_time(attn_fn, pages, table, sel, lens))
    rows = []
    for c in cases:
        row = {"multiple": c["multiple"], "context": c["context"], "batch": batch, "index_topk": k}
        for part in ("index", "attention"):
            for j, clock in enumerate(("ms", "cpu_ms")):
                xs = [1e3 * t[j] for t in c[part]]
                row[f"{part}_{clock}"], row[f"{part}_{clock}_range"] = statistics.median(xs), [min(xs), max(xs)]
        rows.append(row)
    return rows


def topk_agreement(context: int = 4096, queries: int = 64, seed: int = 0) -> dict:
    """FP8 vs BF16 index keys of one random GLM-5 indexer layer: mean top-k overlap and identical-set fraction."""
    cfg = glm5_layer_config()
    rng = np.random.default_rng(seed)
    d, ql, hi, dk = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

    p = IndexerParams(wq_b=w(ql, hi * dk), wk=w(d, dk), k_norm_w=jnp.asarray(1 + 0.1 * rng.standard_normal(dk)),
                      k_norm_b=jnp.asarray(0.1 * rng.standard_normal(dk)), weights_proj=w(d, hi))
    x = jnp.asarray(rng.standard_normal((1, context, cfg.hidden_size)), jnp.float32)
    q_resid = jnp.asarray(rng.standard_normal((1, context, cfg.q_lora_rank)), jnp.float32)
    pos = jnp.arange(context, dtype=jnp.int32)[None]
    keys = indexer.index_keys(p, cfg, x, pos)
    qpos = pos[:, -queries:]
    qi, w = indexer.index_queries(p, cfg, q_resid[:, -queries:], x[:, -queries:], qpos)
    fp8 = paged.dequantize_kv(*paged.quantize_kv(keys, jnp.float8_e4m3fn))
    bf16 = keys.astype(jnp.bfloat16).astype(jnp.float32)

    def sel(k):
        return np.asarray(indexer.select(indexer.index_scores(qi, w, k), qpos, None, cfg.index_topk))[0]

    a, b = sel(fp8), sel(bf16)
    overlap = [len(np.intersect1d(x, y)) / cfg.index_topk for x, y in zip(a, b, strict=True)]
    return {"context": context, "queries": queries, "index_topk": cfg.index_topk,
            "mean_overlap": float(np.mean(overlap)), "min_overlap": float(np.min(overlap)),
            "identical_fraction": float(np.mean([o == 1.0 for o in overlap]))}


def run(out_dir: str | Path | None = None, batch: int = 2, repeats: int = 5) -> dict:
    rows = decode_timings(batch, repeats)
    base = rows[0]
    for row in rows:
        for key in ("attention_ms", "attention_cpu_ms", "index_ms", "index_cpu_ms"):
            row[f"{key}_ratio_vs_2x"] = row[key] / base[key]
    result = {"backend": jax.default_backend(), "repeats": repeats, "decode": rows, "topk_agreement": topk_agreement()}
    print("context | attention wall ms (ratio) | attention CPU ms (ratio) | index wall ms (ratio) | index CPU ms")
    for row in rows:
        cells = [f"{row['context']} {row['multiple']}x"]
        for key in ("attention_ms", "attention_cpu_ms", "index_ms", "index_cpu_ms"):
            lo, hi = row[f"{key}_range"]
            cells.append(f"{row[key]:.1f} [{lo:.1f}, {hi:.1f}] ({row[key + '_ratio_vs_2x']:.2f})")
        print(" | ".join(cells))
    print("FP8 vs BF16 index keys:", result["topk_agreement"])
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "dsa_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else None)
