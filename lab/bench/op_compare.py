"""Single operations of the ~15M DeepSeek-V3 shape on XLA:CPU and in torch, side by side, the same arithmetic.

Where the engine's CPU step loses time against transformers ``generate`` is a question about single operations:
each case here computes one of them on both sides from the same random inputs (the outputs are compared), and times
it as each side pays for it in a serving step: XLA inside one compiled program (a ``fori_loop`` of ``reps`` calls,
so no per-call dispatch), torch eagerly (a Python loop of ``reps`` calls, as transformers runs); every input but
the weights changes from call to call (shifted by a scalar from the previous output, on both sides), so nothing is
hoisted out of the loop. Each repeat times both sides, each after one untimed run of its own, the order
alternating; ms per call are medians [min, max] over the repeats, and the ratio XLA / torch is paired within a
repeat (above 1: XLA is slower).

    python -m lab.bench.op_compare --out benchmarks/engine/op_compare/xeon_260mb
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lab.bench.measure import environment, stats
from lab.bench.profile_decode import model_config, write
from lab.bench.report import environment_section, markdown_table, spread
from pallas_kernels.flash_prefill import flash_prefill_reference
from pallas_kernels.mla_attention import mla_decode_attention_reference
from phaseserve.config import ModelConfig

SM_SCALE = 0.1


@dataclass(frozen=True)
class Case:
    name: str
    shapes: dict[str, tuple[int, ...]]  # input name -> shape (float32 normal)
    xla: Callable[..., jax.Array]  # the arrays in ``shapes`` order (after ``xla_inputs``) -> output
    torch: Callable[..., Any]  # the same on torch tensors
    xla_inputs: Callable[[list[jax.Array]], list[jax.Array]] = list  # untimed: XLA's layout of the inputs
    weights: int = 0  # trailing inputs that are weights: held fixed across calls (the others change every call)


def _prefill_torch(q, k, v):  # q, k [B, T, H, dk], v [B, T, H, dv] -> [B, T, H, dv]
    import torch

    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, scale=SM_SCALE)
    return o.transpose(1, 2)


def _prefill_xla(q, k, v):
    b, t = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return flash_prefill_reference(q, k, v, pos, jnp.full((b,), t, jnp.int32), sm_scale=SM_SCALE)


def _decode_case(cfg: ModelConfig, batch: int, context: int, page_size: int = 16) -> Case:
    """Absorbed MLA decode attention of ``batch`` rows over ``context`` cached latents each: XLA through the engine's
    CPU path (pages gathered by a page table), torch on the contiguous latents (transformers' cache layout)."""
    h, r, f = cfg.num_heads, cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    per_row = -(-context // page_size)
    table = np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row) + 1  # page 0: the null page

    def pages_of(arrays):  # [q_latent, q_rope, latents [B, T, f]] -> [q_latent, q_rope, pages [P, S, f]]
        q_lat, q_rope, lat = arrays
        pad = per_row * page_size - context
        pages = jnp.pad(lat, ((0, 0), (0, pad), (0, 0))).reshape(batch * per_row, page_size, f)
        return [q_lat, q_rope, jnp.concatenate([jnp.zeros((1, page_size, f)), pages])]

    def xla(q_lat, q_rope, pages):  # [B, H, r], [B, H, rope], [P, S, r + rope] -> [B, H, r]
        return mla_decode_attention_reference(q_lat, q_rope, pages, jnp.asarray(table),
                                              jnp.full((batch,), context, jnp.int32), sm_scale=SM_SCALE)

    def torch_fn(q_lat, q_rope, lat):
        import torch

        q = torch.cat([q_lat, q_rope], dim=-1)  # [B, H, r + rope]
        p = torch.softmax(torch.einsum("bhf,btf->bht", q, lat) * SM_SCALE, dim=-1)
        return torch.einsum("bht,btr->bhr", p, lat[..., :r])

    return Case(f"decode MLA attention, {batch} rows x {context} tokens",
                {"q_latent": (batch, h, r), "q_rope": (batch, h, f - r), "latents": (batch, context, f)}, xla,
                torch_fn, pages_of)


def _ffn_xla(x, wg, wu, wd):
    return jnp.dot(jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)


def _ffn_torch(x, wg, wu, wd):
    import torch

    return (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd


def cases(model: str = "dsv3-15m") -> list[Case]:
    """The measured operations on ``model``'s shape (a ``profile_decode.MODELS`` name), at the engine benchmark's
    batch-32 point: 128-token prompts in prefill chunks of 16 rows, decode at 160 cached tokens."""
    cfg = model_config(model)
    d, h, dk, dv, fe = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.v_head_dim, cfg.moe_intermediate_size
    return [
        Case("prefill attention, 16 rows x 128 tokens (causal)",
             {"q": (16, 128, h, dk), "k": (16, 128, h, dk), "v": (16, 128, h, dv)}, _prefill_xla, _prefill_torch),
        _decode_case(cfg, 32, 160),
        Case("expert FFN, 8 rows", {"x": (8, d), "w_gate": (d, fe), "w_up": (d, fe), "w_down": (fe, d)},
             _ffn_xla, _ffn_torch, weights=3),
        Case("dense MLP, 32 rows", {"x": (32, d), "w_gate": (d, cfg.intermediate_size),
                                    "w_up": (d, cfg.intermediate_size), "w_down": (cfg.intermediate_size, d)},
             _ffn_xla, _ffn_torch, weights=3),
        Case("dense MLP, 2048 rows", {"x": (2048, d), "w_gate": (d, cfg.intermediate_size),
                                      "w_up": (d, cfg.intermediate_size), "w_down": (cfg.intermediate_size, d)},
             _ffn_xla, _ffn_torch, weights=3),
    ]


def _xla_loop(fn: Callable[..., jax.Array], reps: int, weights: int):
    """jit(*arrays) -> f32[]: ``reps`` calls of ``fn`` in one program, every input but the trailing ``weights``
    shifted by a scalar the previous call's output sets (so no call, and no part of one, can be hoisted)."""

    @jax.jit
    def run(*args):
        n = len(args) - weights

        def body(_, s):
            return s + fn(*[a + s for a in args[:n]], *args[n:]).reshape(-1)[0] * 1e-30

        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))

    return run


def _torch_loop(fn: Callable[..., Any], reps: int, weights: int):
    import torch

    def run(*args):
        n, s = len(args) - weights, torch.zeros(())
        with torch.inference_mode():
            for _ in range(reps):
                s = s + fn(*[a + s for a in args[:n]], *args[n:]).reshape(-1)[0] * 1e-30
        return s

    return run


def measure(case: Case, *, repeats: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """One case: outputs compared once, then ``repeats`` interleaved timings of ``reps`` calls per side."""
    import torch

    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s, dtype=np.float32) for s in case.shapes.values()]
    jx = case.xla_inputs([jnp.asarray(a) for a in arrays])
    tx = [torch.from_numpy(a.copy()) for a in arrays]
    out_x = np.asarray(jax.jit(case.xla)(*jx))
    with torch.inference_mode():
        out_t = case.torch(*tx).numpy()
    rel = float(np.max(np.abs(out_x - out_t)) / np.max(np.abs(out_t)))
    sides = {"xla": (_xla_loop(case.xla, reps, case.weights), jx, lambda r: r.block_until_ready()),
             "torch": (_torch_loop(case.torch, reps, case.weights), tx, lambda r: r)}
    for run, args, wait in sides.values():  # warm-up (and XLA's compile)
        wait(run(*args))
    ms: dict[str, list[float]] = {"xla": [], "torch": []}
    for r in range(repeats):
        for name in (["xla", "torch"] if r % 2 == 0 else ["torch", "xla"]):
            run, args, wait = sides[name]
            wait(run(*args))  # untimed: the other side's worker threads settle, this side's data is warm
            t = time.perf_counter()
            wait(run(*args))
            ms[name].append(1e3 * (time.perf_counter() - t) / reps)
    return {"case": case.name, "shapes": {k: list(v) for k, v in case.shapes.items()}, "ms": ms,
            "ratio": [x / t for x, t in zip(ms["xla"], ms["torch"], strict=True)], "rel_diff": rel}


def markdown(result: dict[str, Any]) -> str:
    rows = [[r["case"], spread(stats(r["ms"]["xla"])), spread(stats(r["ms"]["torch"])), spread(stats(r["ratio"])),
             f"{r['rel_diff']:.1e}"] for r in result["rows"]]
    return "\n".join([
        f"# Single operations: XLA:CPU vs torch ({result['label']})", "",
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        f"Model shape: {result['model']}. {result['repeats']} repeats of {result['reps']} calls per side; torch with "
        f"{result['torch_threads']} threads (torch {result['torch_version']}). `max rel. diff`: the largest "
        "difference of the two outputs over the output's largest magnitude.", "",
        markdown_table(["operation", "XLA ms", "torch ms", "XLA / torch", "max rel. diff"], rows), "",
        environment_section(result["environment"]), "",
    ])


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--label", default="")
    ap.add_argument("--model", default="dsv3-15m", help="a profile_decode.MODELS name")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--reps", type=int, default=20, help="calls per timing")
    ap.add_argument("--torch-threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.torch_threads)
    result: dict[str, Any] = {"label": a.label or a.out.rstrip("/").split("/")[-1], "repeats": a.repeats,
                              "reps": a.reps, "model": a.model, "torch_threads": a.torch_threads,
                              "torch_version": torch.__version__,
                              "environment": environment(), "rows": []}
    for case in cases(a.model):
        row = {"load_average_1m": os.getloadavg()[0], **measure(case, repeats=a.repeats, reps=a.reps)}
        result["rows"].append(row)
        print(case.name, "XLA / torch", spread(stats(row["ratio"])), f"rel diff {row['rel_diff']:.1e}", flush=True)
    write(a.out, result, markdown(result))


if __name__ == "__main__":
    main()
