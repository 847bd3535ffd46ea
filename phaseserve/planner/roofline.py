"""Roofline step times of a :class:`~phaseserve.planner.deployment.Deployment` (upper bounds on speed, not predictions).

- Prefill is compute-bound: matmul FLOPs / the matrix rate of each weight's representation (FP8 at the FP8 rate;
  INT4 *dequantized to BF16 before the matmul*, so at the BF16 rate; BF16 at the BF16 rate) plus attention FLOPs
  at the BF16 rate.
- Decode is bandwidth-bound: weight bytes actually read per step (routed experts: only those the batch touches,
  ``E * (1 - (1 - k/E)^B)`` per layer under uniform routing, saturating to all experts as the batch grows) plus
  the KV bytes read, / HBM bandwidth; the step takes the larger of that and its compute time.

Not modelled: communication (all-reduce / all-to-all), kernel launch and scheduling overheads
(``Assumptions.decode_overhead_s`` adds a fixed per-step cost if wanted), expert load imbalance, speculative
decoding, prefix caching.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phaseserve.planner.inputs import PlannerError
from phaseserve.quant.size_report import GIB

if TYPE_CHECKING:
    from phaseserve.planner.deployment import Deployment


def _kind(rep: str) -> str:
    return "int4" if rep.startswith("int4") else "fp8" if rep.startswith("fp8") else "bfloat16"


def linear_flops(d: Deployment, tokens: float, lm_head_rows: float) -> dict[str, float]:
    """Matmul FLOPs by compute kind for ``tokens`` tokens through the serving weights (whole replica)."""
    cfg = d.cfg
    out: dict[str, float] = {}
    for r in d.serving.rows:
        if r.tensor_class in ("embeddings", "norms") or r.rep == "float32":
            continue  # lookups, vectors and the router's f32 bias: no matmul
        if r.tensor_class == "routed_experts":
            n = tokens * r.params * cfg.num_experts_per_tok / max(cfg.num_experts, 1)
        elif r.tensor_class == "lm_head":
            n = lm_head_rows * r.params
        else:
            n = tokens * r.params
        kind = _kind(r.rep)
        kind = d.a.int4_compute if kind == "int4" else kind
        out[kind] = out.get(kind, 0.0) + 2.0 * n
    return out


def attention_flops_per_pair(d: Deployment) -> tuple[float, float]:
    """(attention FLOPs per query-key pair over all layers, DSA indexer FLOPs per pair) in prefill."""
    cfg = d.cfg
    if cfg.is_mla:
        per = 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    else:
        per = 4 * cfg.num_heads * cfg.head_dim
    idx = 2 * cfg.index_n_heads * cfg.index_head_dim if cfg.index_topk else 0
    return per * cfg.num_layers, idx * cfg.num_layers


def compute_time(d: Deployment, flops: dict[str, float], devices: int) -> float:
    eff = d.a.compute_efficiency
    return sum(f / (d.hw.rate(k) * eff * devices) for k, f in flops.items())


def prefill_time(d: Deployment, prompt_len: int, batch: int = 1) -> dict[str, float]:
    """Compute-bound prefill of ``batch`` prompts of ``prompt_len`` tokens on one replica."""
    if prompt_len < 1 or batch < 1:
        raise PlannerError(f"prefill needs prompt_len >= 1 and batch >= 1, got {prompt_len}, {batch}")
    cfg = d.cfg
    flops = linear_flops(d, batch * prompt_len, batch)  # logits only for each prompt's last position
    pair, idx_pair = attention_flops_per_pair(d)
    p = prompt_len
    pairs = p * (p + 1) / 2  # causal
    if cfg.index_topk:  # DSA: each query attends to at most index_topk keys; the indexer scores all of them
        k = min(p, cfg.index_topk)
        pairs = k * (k + 1) / 2 + (p - k) * k
    att = d.a.attention_compute
    flops[att] = flops.get(att, 0.0) + batch * (pairs * pair + p * (p + 1) / 2 * idx_pair)
    t = compute_time(d, flops, d.gpus_per_replica)
    return {"seconds": t, "prompt_tok_s": batch * prompt_len / t, "flops": sum(flops.values())}


def decode_time(d: Deployment, concurrency: int, context_len: int) -> dict[str, Any]:
    """One bandwidth-bound decode step of ``concurrency`` requests (per replica) with ``context_len`` cached."""
    if concurrency < 1 or context_len < 0:
        raise PlannerError(f"decode needs concurrency >= 1 and context_len >= 0, got {concurrency}, {context_len}")
    cfg, a, g, t = d.cfg, d.a, d.gpus_per_replica, d.attn_tp
    b = concurrency
    frac = 1.0
    if cfg.is_moe:
        frac = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** b
    rep = d.serving
    experts, embed = rep.bytes_of("routed_experts"), rep.bytes_of("embeddings")
    embed_rows = min(1.0, b / cfg.vocab_size) * embed  # only the looked-up rows are read
    weight_bytes = experts * frac / g + (rep.total_bytes - experts - embed + embed_rows) / t
    latent_ctx = context_len
    if cfg.index_topk and a.dsa_sparse_decode:
        latent_ctx = min(context_len, cfg.index_topk)
    per_request = latent_ctx * d.latent_bytes_per_token + context_len * d.indexer_bytes_per_token
    kv_bytes = b / d.attn_dp * per_request / d.kv_shards
    mem_s = (weight_bytes + kv_bytes) / (d.hw.hbm_tbps * 1e12 * a.bandwidth_efficiency)
    flops = linear_flops(d, b, b)
    if cfg.is_mla:  # absorbed MLA: scores against the latent (+rope), values from the latent
        per_key = 2 * cfg.num_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    else:
        per_key = 4 * cfg.num_heads * cfg.head_dim
    idx = 2 * cfg.index_n_heads * cfg.index_head_dim if cfg.index_topk else 0
    att = b * cfg.num_layers * (latent_ctx * per_key + context_len * idx)
    # attention runs in attn_dp groups of attn_tp ranks; the linear FLOPs spread over the whole replica
    compute_s = compute_time(d, flops, g) + compute_time(d, {a.attention_compute: att}, g)
    step = max(mem_s, compute_s) + a.decode_overhead_s
    return {"concurrency": b, "context_len": context_len, "step_s": step, "tok_s": b / step,
            "tok_s_per_request": 1.0 / step, "bound": "memory" if mem_s >= compute_s else "compute",
            "weight_gib_read_per_device": weight_bytes / GIB, "kv_gib_read_per_device": kv_bytes / GIB,
            "expert_fraction_read": frac, "memory_s": mem_s, "compute_s": compute_s}


def decode_curve(d: Deployment, concurrencies: list[int], prompt_len: int, output_len: int,
                 rule: str = "on_demand") -> list[dict[str, Any]]:
    """Decode tok/s vs concurrency at the workload's mean context ``prompt + output / 2``.

    Each row says whether that concurrency fits in the KV cache under ``rule`` (``fits_kv``).
    """
    limit = d.admitted(prompt_len, output_len, rule)
    ctx = prompt_len + output_len // 2
    return [{**decode_time(d, c, ctx), "fits_kv": c <= limit} for c in concurrencies]
