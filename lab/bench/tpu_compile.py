"""The engine's jitted decode and prefill steps compiled for real TPU deployments without a TPU, beside the planner.

``experiments/tpu_compile.py`` (settings ``configs/experiment/tpu_compile.yaml``) runs :func:`run`: for each model x
phase x TPU generation it takes the smallest slice the planner (:mod:`phaseserve.planner`) says fits, describes it
deviceless (``jax.experimental.topologies``, libtpu), builds the engine's own step (``engine.workers.decode_step_jit``
with the integrity hooks, or ``chunk_step_jit``) on an ``(ep, tp)`` mesh of its chips, and compiles it with abstract
parameters and page pools (``jax.ShapeDtypeStruct`` with the engine's shardings: no memory is allocated). Every
Pallas call runs its Mosaic body (``attn_impl = matmul_impl = "pallas"``: in a CPU process the kernels are built per
lowering platform, so the TPU compile gets the TPU bodies); the integrity check (``cache.integrity.check_tags``) is
compiled on the same mesh. Per chip it records ``memory_analysis`` (argument, output, temp, generated code) and
``cost_analysis`` (FLOPs, bytes accessed), and a roofline time at the chip's published rates.

Layers. The model code loops over layers in Python, so a step's compile time grows with the layer count (about
20 s per MoE layer on this CPU); the compiled model keeps the dense layers and ``moe_layers`` MoE layers (stated in
every row). Two compiles (1 and ``moe_layers`` MoE layers) give the per-MoE-layer increment of FLOPs and bytes
accessed, which extrapolates them to the full depth. Memory per chip for the full model is not extrapolated: every
layer of the full model has the shape, dtype and sharding of a compiled one, so each of its arguments is sized with
the TPU layout the compiler chose for its twin (``compiled.input_formats``: the tile padding of minor dimensions
included) -- :func:`padded_bytes` -- and that sum is checked against ``memory_analysis`` on the compiled model.

Against the planner (``planner.deployment(..., load_mtp=False)``: the serving weights, no MTP layers): weights and KV
per chip from the compiled layouts vs the planner's ``weight_bytes_per_device`` and ``pages x page bytes`` (the
pool is sized to the planner's pages per chip), with the difference split by tensor class.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from lab.kernels import tpu_compile as kernels_tpu
from phaseserve import planner, presets
from phaseserve.cache.integrity import IntegrityTracker, check_tags
from phaseserve.cache.paged import init_pool, value_dtype
from phaseserve.config import ModelConfig, canonical_dtype
from phaseserve.engine.decode_step import DecodeBatch
from phaseserve.engine.prefill_step import ChunkBatch
from phaseserve.engine.shapes import bucket, chunk_bucket, row_bucket, width_bucket
from phaseserve.engine.workers import chunk_step_jit, decode_step_jit
from phaseserve.quant.quantize import abstract_quantized, named_leaves, shape_dtype_tree, tensor_class
from phaseserve.sharding import make_mesh, param_shardings, pool_shardings, replicated

GIB = 2**30
# generation -> (planner hardware, topology names by chip count)
SLICES = {
    "v5p": ("tpu-v5p", {8: "v5p:2x2x2", 16: "v5p:2x2x4", 32: "v5p:2x4x4", 64: "v5p:4x4x4"}),
    "v6e": ("tpu-v6e", {8: "v6e:2x4", 16: "v6e:4x4", 32: "v6e:4x8", 64: "v6e:8x8"}),
    "v5e": ("tpu-v5e", {8: "v5e:2x4", 16: "v5e:4x4", 32: "v5e:4x8", 64: "v5e:8x8"}),
}


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One step to compile: a model preset's phase on a TPU slice (the representation as the design has it)."""

    model: str  # a phaseserve.presets name
    phase: str  # "decode" | "prefill"
    generation: str  # a key of SLICES
    weights: str  # planner weight name: "int4" (INT4 routed experts) | "fp8"
    kv: str  # decode: the page dtype; prefill: the prefill pool's
    chips: int
    tp: int
    ep: int
    moe_layers: int = 2  # MoE layers compiled (after all the dense layers)
    batch: int = 64  # decode rows / prefill rows
    context: int = 9216  # tokens a decode row's page table covers (prompt 8192 + 1024 out)
    chunk: int = 8192  # prefill tokens per row
    page_size: int = 64
    overrides: tuple[tuple[str, Any], ...] = ()  # config.json keys replaced (tests: tiny shapes the kernels tile)

    @property
    def topology(self) -> str:
        return SLICES[self.generation][1][self.chips]

    @property
    def name(self) -> str:
        return f"{self.model} {self.phase} {self.generation}x{self.chips} tp{self.tp} ep{self.ep}"


def cut_config(model: str, num_layers: int | None, overrides: tuple[tuple[str, Any], ...] = ()) -> ModelConfig:
    """The preset's config with ``num_hidden_layers`` cut to ``num_layers`` (None: the full model)."""
    hf = copy.deepcopy(presets.preset(model))
    text = hf.get("text_config", hf)
    text.update(dict(overrides))
    if num_layers is not None:
        text["num_hidden_layers"] = num_layers
    return ModelConfig.from_hf_config(hf)


def dense_layers(cfg: ModelConfig) -> int:
    return sum(not m for m in cfg.moe_layers)


def plan_slice(model: str, phase: str, generation: str, weights: str, kv: str, tp: int = 8,
               chips: tuple[int, ...] = (8, 16, 32, 64)) -> tuple[int, dict]:
    """The smallest slice of ``generation`` the planner says holds the model (attention TP ``tp``, experts over every
    chip): (chips, the planner's summary)."""
    hw = SLICES[generation][0]
    for n in chips:
        d = planner.deployment(model, hw, n, weights, kv, load_mtp=False, attn_tp=min(tp, n))
        if d.fits:
            return n, d.summary()
    return chips[-1], planner.deployment(model, hw, chips[-1], weights, kv, load_mtp=False,
                                         attn_tp=min(tp, chips[-1])).summary()


# ---- abstract arguments ----------------------------------------------------------------------------------------
def _placed(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_params(cfg: ModelConfig, weights: str, mesh: jax.sharding.Mesh) -> Any:
    """The params tree in the planner's ``weights`` representation as ShapeDtypeStructs with the engine's
    shardings (``sharding.param_shardings``)."""
    params = shape_dtype_tree(abstract_quantized(cfg, planner.weight_policy(weights)))
    return _placed(params, param_shardings(cfg, params, mesh))


def abstract_pool(cfg: ModelConfig, num_pages: int, page_size: int, kv: str, mesh: jax.sharding.Mesh) -> Any:
    """The page pool as ShapeDtypeStructs in its *device* dtypes (a CPU process would hold BF16/FP8 pools as raw bits,
    ``cache.paged.storage_dtype``) with the engine's shardings (``sharding.pool_shardings``)."""
    pool = jax.eval_shape(functools.partial(init_pool, cfg, num_pages, page_size, canonical_dtype(kv)))
    pool = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, value_dtype(a.dtype)), pool)
    return _placed(pool, pool_shardings(pool, mesh))


def _rep(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=replicated(mesh))


def decode_batch(mesh, b: int, width: int) -> DecodeBatch:
    """An abstract DecodeBatch of ``b`` rows and a ``width``-page table (replicated, as the worker passes it)."""
    a = functools.partial(_rep, mesh)
    return DecodeBatch(tokens=a((b,), "int32"), positions=a((b,), "int32"), page_table=a((b, width), "int32"),
                       active=a((b,), "bool"), temperature=a((b,), "float32"), top_k=a((b,), "int32"),
                       top_p=a((b,), "float32"), seeds=a((b,), "uint32"), steps=a((b,), "int32"),
                       want_logprobs=a((b,), "bool"))


def chunk_batch(mesh, b: int, c: int, width: int) -> ChunkBatch:
    a = functools.partial(_rep, mesh)
    return ChunkBatch(tokens=a((b, c), "int32"), positions=a((b, c), "int32"), valid=a((b, c), "bool"),
                      lengths=a((b,), "int32"), last=a((b,), "int32"), page_table=a((b, width), "int32"),
                      temperature=a((b,), "float32"), top_k=a((b,), "int32"), top_p=a((b,), "float32"),
                      seeds=a((b,), "uint32"), steps=a((b,), "int32"), targets=a((b, c), "int32"),
                      want_logprobs=a((b,), "bool"), want_prompt=a((b,), "bool"))


# ---- bytes per chip ----------------------------------------------------------------------------------------------
def shard_shape(a: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    return tuple(a.sharding.shard_shape(a.shape)) if a.sharding is not None else tuple(a.shape)


def logical_bytes(a: jax.ShapeDtypeStruct) -> int:
    """Bytes of one device's shard, unpadded."""
    return math.prod(shard_shape(a)) * jnp.dtype(a.dtype).itemsize


def padded_bytes(a: jax.ShapeDtypeStruct, layout: Any) -> int:
    """Bytes of one device's shard in a TPU layout: dims in ``major_to_minor`` order, the minor ones rounded up to the
    first tile (e.g. FP8 (32, 128): a 576-wide latent row takes 640 bytes). None layout: unpadded."""
    if layout is None or not getattr(layout, "tiling", None):
        return logical_bytes(a)
    shape = shard_shape(a)
    phys = [shape[i] for i in layout.major_to_minor]
    tile = layout.tiling[0]
    for j, t in enumerate(tile, start=len(phys) - len(tile)):
        if j >= 0:
            phys[j] = -(-phys[j] // t) * t
    return math.prod(phys) * jnp.dtype(a.dtype).itemsize


def _key(a: jax.ShapeDtypeStruct) -> tuple:
    spec = a.sharding.spec if isinstance(a.sharding, NamedSharding) else None
    return tuple(a.shape), jnp.dtype(a.dtype).name, str(spec)


def layouts_of(compiled: Any, args: tuple) -> dict[tuple, Any]:
    """(shape, dtype, spec) -> the layout the compiler chose for an argument of that kind."""
    formats = jax.tree.leaves(compiled.input_formats[0], is_leaf=lambda x: hasattr(x, "layout"))
    leaves = jax.tree.leaves(args)
    if len(formats) != len(leaves):
        return {}
    return {_key(a): f.layout for a, f in zip(leaves, formats, strict=True)}


def tree_bytes(tree: Any, layouts: dict[tuple, Any]) -> tuple[int, int, int]:
    """(padded bytes per chip, logical bytes per chip, leaves without a compiled twin) of an abstract tree."""
    padded = logical = missing = 0
    for a in jax.tree.leaves(tree):
        lay = layouts.get(_key(a))
        missing += lay is None
        padded += padded_bytes(a, lay)
        logical += logical_bytes(a)
    return padded, logical, missing


def class_bytes(params: Any, layouts: dict[tuple, Any]) -> dict[str, dict[str, int]]:
    """Per tensor class: padded and logical bytes per chip, and bytes if split evenly over the mesh."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict(padded=0, logical=0, whole=0, replicated=0))
    for path, leaf in named_leaves(params):
        parts = jax.tree.leaves(leaf)
        cls = tensor_class(path, len(leaf.shape))
        for a in parts:
            pb, lb = padded_bytes(a, layouts.get(_key(a))), logical_bytes(a)
            row = out[cls]
            row["padded"] += pb
            row["logical"] += lb
            row["whole"] += math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
            row["replicated"] += lb if shard_shape(a) == tuple(a.shape) else 0
    return dict(out)


# ---- compile ------------------------------------------------------------------------------------------------------
def memory_stats(compiled: Any) -> dict[str, Any]:
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                alias_bytes=m.alias_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                code_bytes=m.generated_code_size_in_bytes, flops=float(cost.get("flops", 0.0)),
                bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                mosaic_calls=compiled.as_text().count('custom_call_target="tpu_custom_call"'))


def build_step(spec: StepSpec, cfg: ModelConfig, mesh, num_pages: int,
               log: collections.Counter | None = None) -> tuple[Any, tuple]:
    """(the engine's jitted step, its abstract arguments) for ``spec`` on ``mesh``; ``log`` gets the kernel
    provenance of the trace (``kernel_mesh``)."""
    params = abstract_params(cfg, spec.weights, mesh)
    pages_per_row = -(-spec.context // spec.page_size)
    if spec.phase == "decode":
        pool = abstract_pool(cfg, num_pages, spec.page_size, spec.kv, mesh)
        step = decode_step_jit(cfg, mesh, jax.tree.map(lambda a: a.sharding, pool), hooks=IntegrityTracker,
                               matmul_impl="pallas", attn_impl="pallas", log=log)
        b = row_bucket(spec.batch)  # the engine's padded decode rows
        args = (params, pool, decode_batch(mesh, b, width_bucket(pages_per_row)), _rep(mesh, (b,), "bool"))
        return step, args
    pool = abstract_pool(cfg, num_pages, spec.page_size, spec.kv, mesh)
    step = chunk_step_jit(cfg, mesh, jax.tree.map(lambda a: a.sharding, pool), matmul_impl="pallas",
                          attn_impl="pallas", log=log)
    width = bucket(-(-spec.chunk // spec.page_size), 4)
    return step, (params, pool, chunk_batch(mesh, bucket(spec.batch), chunk_bucket(spec.chunk), width))


def compile_step(spec: StepSpec, num_layers: int, num_pages: int) -> dict[str, Any]:
    """Compile ``spec``'s step for a model of ``num_layers`` layers: memory and cost stats, compile seconds, the
    layouts of its arguments (for :func:`tree_bytes`) and the arguments."""
    cfg = cut_config(spec.model, num_layers, spec.overrides)
    devices = kernels_tpu.topology(spec.topology)
    mesh = make_mesh(list(devices[: spec.tp * spec.ep]), tp=spec.tp, ep=spec.ep)
    log: collections.Counter = collections.Counter()
    step, args = build_step(spec, cfg, mesh, num_pages, log)
    t0 = time.perf_counter()
    with kernels_tpu.no_persistent_cache():
        lowered = step.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
    out = dict(layers=num_layers, moe_layers=sum(cfg.moe_layers), lower_s=t1 - t0,
               compile_s=time.perf_counter() - t1, **memory_stats(compiled))
    out["args_padded_bytes"], out["args_logical_bytes"], _ = tree_bytes(args, layouts_of(compiled, args))
    # what the TPU branch of each kernel call built: ops that fell back to the XLA reference there, with the reason
    out["tpu_kernels"] = sorted({f"{op} {layout}" for (_, op, plat, impl, _, layout) in log if plat == "tpu"
                                 and impl == "pallas"})
    out["tpu_fallbacks"] = sorted({f"{op}: {why}" for (_, op, plat, impl, why, _) in log if plat == "tpu"
                                   and impl == "fallback"})
    return dict(stats=out, layouts=layouts_of(compiled, args), args=args, mesh=mesh)


def compile_check(spec: StepSpec, mesh, num_pages: int) -> dict[str, Any]:
    """The integrity layer's batched check (``check_tags``) compiled on the decode mesh."""
    b, w = row_bucket(spec.batch), width_bucket(-(-spec.context // spec.page_size))
    args = (_rep(mesh, (num_pages,), "uint32"), _rep(mesh, (b, w), "int32"), _rep(mesh, (b, w), "uint32"),
            _rep(mesh, (b,), "int32"))
    t0 = time.perf_counter()
    with kernels_tpu.no_persistent_cache():
        compiled = check_tags.lower(*args).compile()
    return dict(compile_s=time.perf_counter() - t0, **memory_stats(compiled))


def roofline(flops: float, bytes_accessed: float, hw: planner.Hardware) -> dict[str, float]:
    """Seconds per step at the chip's published BF16 rate and HBM bandwidth (the larger of the two bounds)."""
    compute_s, memory_s = flops / hw.rate("bfloat16"), bytes_accessed / (hw.hbm_tbps * 1e12)
    return dict(compute_s=compute_s, memory_s=memory_s, step_s=max(compute_s, memory_s),
                bound="compute" if compute_s > memory_s else "memory")


def evaluate(spec: StepSpec, plan: dict, *, check: bool = True) -> dict[str, Any]:
    """Compile ``spec`` at 1 and ``spec.moe_layers`` MoE layers; full-model memory per chip from the compiled
    layouts, FLOPs and bytes accessed extrapolated per MoE layer; the planner's figures beside them."""
    full = cut_config(spec.model, None, spec.overrides)
    nd = dense_layers(full)
    num_pages = max(2, int(plan["kv_pages_per_device"])) if spec.phase == "decode" else prefill_pool_pages(spec)
    small = compile_step(spec, nd + 1, num_pages) if spec.moe_layers > 1 else None
    big = compile_step(spec, nd + spec.moe_layers, num_pages)
    mesh, layouts = big["mesh"], big["layouts"]
    params = abstract_params(full, spec.weights, mesh)
    pool = abstract_pool(full, num_pages, spec.page_size, spec.kv, mesh)
    w_pad, w_log, w_missing = tree_bytes(params, layouts)
    kv_pad, kv_log, kv_missing = tree_bytes(pool, layouts)
    st = big["stats"]
    moe_full = sum(full.moe_layers)
    per_layer = {}
    if small is not None:
        s = small["stats"]
        for k in ("flops", "bytes_accessed"):
            per_layer[k] = (st[k] - s[k]) / (spec.moe_layers - 1)
    extra = moe_full - spec.moe_layers
    flops_full = st["flops"] + extra * per_layer.get("flops", 0.0)
    bytes_full = st["bytes_accessed"] + extra * per_layer.get("bytes_accessed", 0.0)
    hw = planner.hardware(SLICES[spec.generation][0])
    planner_weights = plan["weight_gib_per_device"] * GIB
    planner_kv = plan["kv_pages_per_device"] * plan["kv_bytes_per_token_per_device"] * spec.page_size
    row = dict(
        spec=dataclasses.asdict(spec), name=spec.name, topology=spec.topology, num_pages=num_pages,
        compiled=[x["stats"] for x in (small, big) if x is not None],
        weights_padded_bytes=w_pad, weights_logical_bytes=w_log, kv_padded_bytes=kv_pad, kv_logical_bytes=kv_log,
        leaves_without_twin=w_missing + kv_missing,
        temp_bytes=st["temp_bytes"], code_bytes=st["code_bytes"], output_bytes=st["output_bytes"],
        alias_bytes=st["alias_bytes"],
        hbm_bytes=hw.hbm_gib * GIB,
        total_bytes=w_pad + kv_pad + st["temp_bytes"] + st["code_bytes"],
        flops_full=flops_full, bytes_accessed_full=bytes_full, per_moe_layer=per_layer,
        roofline=roofline(flops_full, bytes_full, hw),
        planner=dict(weights_bytes=planner_weights, kv_bytes=planner_kv, fits=plan["fits"],
                     pages_per_device=plan["kv_pages_per_device"], kv_tokens=plan["kv_tokens"],
                     weight_policy=plan["weight_policy"], attn_tp=plan["attn_tp"]),
        weights_vs_planner=w_pad / planner_weights - 1 if planner_weights else None,
        weights_logical_vs_planner=w_log / planner_weights - 1 if planner_weights else None,
        kv_vs_planner=kv_pad / planner_kv - 1 if planner_kv else None,
        classes=class_bytes(params, layouts),
        args_check=dict(compiled=st["argument_bytes"], from_layouts=st["args_padded_bytes"],
                        logical=st["args_logical_bytes"]),
    )
    add_engine_layout(row)
    row["fits_hbm"] = row["total_bytes"] <= row["hbm_bytes"]
    if check and spec.phase == "decode":
        row["integrity_check"] = compile_check(spec, mesh, num_pages)
    return row


def add_engine_layout(row: dict) -> dict:
    """The planner's weights per chip under ``weight_layout="engine"`` (phaseserve's own placement) beside a step
    row, and the compiled layouts' difference from it (what is left is the TPU tile padding)."""
    sp = row["spec"]
    d = planner.deployment(sp["model"], SLICES[sp["generation"]][0], sp["chips"], sp["weights"], sp["kv"],
                           load_mtp=False, attn_tp=sp["tp"], weight_layout="engine")
    row["planner"]["weights_engine_layout_bytes"] = d.weight_bytes_per_device
    row["planner"]["fits_engine_layout"] = bool(d.fits)
    row["planner"]["pages_per_device_engine_layout"] = d.pages_per_device
    row["weights_vs_planner_engine_layout"] = row["weights_padded_bytes"] / d.weight_bytes_per_device - 1
    # the planner's own roofline for the same step (analytic FLOPs: cost_analysis counts no FLOPs inside Mosaic
    # kernels, which carry no cost estimate; it does count their operands' bytes)
    if sp["phase"] == "decode":
        row["planner"]["roofline_s"] = d.decode_time(sp["batch"], sp["context"])["step_s"]
    else:
        row["planner"]["roofline_s"] = d.prefill_time(sp["chunk"], sp["batch"])["seconds"]
    return row


def rerender(out_dir: str | Path) -> dict[str, Any]:
    """Re-write ``README.md`` and the plot of a run directory from its ``results.json`` (no compiling), adding
    the engine-layout planner figures where the run predates them."""
    import json

    from lab.bench import tpu_compile_report as report
    from lab.bench.report import write_json

    out = Path(out_dir)
    results = json.loads((out / "results.json").read_text())
    for row in results.get("steps") or []:
        if "fits_engine_layout" not in row["planner"]:
            add_engine_layout(row)
    write_json(out / "results.json", results)
    report.memory_plot(out / "memory_per_chip.png", results.get("steps") or [])
    (out / "README.md").write_text(report.markdown(results))
    return results


def prefill_pool_pages(spec: StepSpec) -> int:
    """The prefill worker's pool (``engine.shapes.prefill_pages``): two of the longest prompts plus one step's
    tokens, whole pages, and the null page."""
    per_seq = -(-spec.context // spec.page_size)
    return 2 * per_seq + -(-spec.chunk // spec.page_size) + 1


def step_specs(models: list[str], phases: dict[str, dict], generations: list[str], *, tp: int = 8,
               moe_layers: int = 2, batch: dict[str, int] | None = None) -> list[tuple[StepSpec, dict]]:
    """One spec per model x phase x generation on the planner's smallest fitting slice (tp ``tp``, ep the rest)."""
    out = []
    for model in models:
        for phase, rep in phases.items():
            for gen in generations:
                chips, plan = plan_slice(model, phase, gen, rep["weights"], rep["kv"], tp)
                t = min(tp, chips)
                spec = StepSpec(model, phase, gen, rep["weights"], rep["kv"], chips, t, chips // t,
                                moe_layers=moe_layers, batch=(batch or {}).get(phase, 64 if phase == "decode" else 1))
                out.append((spec, plan))
    return out


# ---- the experiment --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TpuCompileSpec:
    """``experiment:`` of ``configs/experiment/tpu_compile.yaml``."""

    name: str = "tpu_compile"
    kernels: str = "full"  # "full" (serving tile shapes) | "small" (the test suite's) | "none"
    kernel_generations: list[str] = dataclasses.field(default_factory=lambda: ["v5e", "v6e", "v5p"])
    models: list[str] = dataclasses.field(default_factory=lambda: ["kimi-k2.6", "glm-5"])
    step_generations: list[str] = dataclasses.field(default_factory=lambda: ["v5p", "v6e"])
    phases: dict[str, Any] = dataclasses.field(default_factory=lambda: {
        "decode": {"weights": "int4", "kv": "fp8"}, "prefill": {"weights": "fp8", "kv": "bf16"}})
    tp: int = 8  # attention tensor parallelism; experts over ep = chips / tp (and over tp within a rank)
    moe_layers: int = 2  # MoE layers compiled after the dense ones (1 and this many: the per-layer increment)
    decode_batch: int = 64
    prefill_batch: int = 1


def _git() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Compile the kernels and the steps (:class:`TpuCompileSpec`); write ``results.json``, ``README.md`` and
    ``memory_per_chip.png`` into ``out_dir``; print the summary lines. Returns the results dict."""
    from lab.bench import tpu_compile_report as report
    from lab.bench.report import write_json
    from lab.bench.schema import experiment_spec

    spec = experiment_spec(cfg, TpuCompileSpec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), git=_git(),
                                   environment=kernels_tpu.environment(), settings=dataclasses.asdict(spec))
    if kernels_tpu.libtpu_version() is None:
        raise RuntimeError("libtpu is not installed: pip install -e '.[tpu]'")
    if spec.kernels != "none":
        cases = kernels_tpu.small_cases() if spec.kernels == "small" else kernels_tpu.tpu_cases()
        results["kernels"] = [dataclasses.asdict(r) for r in kernels_tpu.run(cases, spec.kernel_generations)]
    steps, errors = [], []
    batch = {"decode": spec.decode_batch, "prefill": spec.prefill_batch}
    for step, plan in step_specs(spec.models, spec.phases, spec.step_generations, tp=spec.tp,
                                 moe_layers=spec.moe_layers, batch=batch):
        t0 = time.perf_counter()
        print(f"compiling {step.name} on {step.topology} ...", flush=True)
        try:
            row = evaluate(step, plan)
        except Exception as e:  # noqa: BLE001 - reported in the results and the summary
            errors.append(dict(name=step.name, error=f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"))
            print(f"  FAILED: {errors[-1]['error'][:300]}", flush=True)
            continue
        row["seconds"] = time.perf_counter() - t0
        steps.append(row)
        print("  " + report.summary_lines({"steps": [row]})[0], flush=True)
        write_json(out / "results.json", {**results, "steps": steps, "step_errors": errors})  # progress
    results.update(steps=steps, step_errors=errors)
    write_json(out / "results.json", results)
    report.memory_plot(out / "memory_per_chip.png", steps)
    (out / "README.md").write_text(report.markdown(results))
    for line in report.summary_lines(results):
        print(line)
    return results


def main(argv: list[str]) -> int:
    """``python -m lab.bench.tpu_compile --rerender RUN_DIR``: README and plot again from results.json."""
    import sys

    from lab.bench.tpu_compile_report import summary_lines

    if len(argv) != 2 or argv[0] != "--rerender":
        print("usage: python -m lab.bench.tpu_compile --rerender RUN_DIR", file=sys.stderr)
        return 2
    for line in summary_lines(rerender(argv[1])):
        print(line)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
