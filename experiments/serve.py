"""Main job: serve the shipped default model through the disaggregated engine and print what it generates.

Thin Hydra entry point (settings in ``configs/serve.yaml``). Prefill runs on one (simulated, on CPU) device with
its weight representation, decode on another with its own, the prompt KV is handed over as FP8 pages, and the
page-tag integrity check runs before every decode step. It prints a greedy continuation of a Python prompt, a
tool call for a held-out request (schema validity and exact match), and what the run measured (tok/s, TTFT and
TPOT p50/p95, KV pages and bytes per token, integrity checks). The requests run once to compile, then again
measured. ``checkpoint=/path/to/hf_dir`` serves any supported Hugging Face checkpoint instead (token ids are
printed then). A bad setting ends with one line naming it, not a traceback.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # CPU: prefill + decode devices

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

import phaseserve as ps  # noqa: E402
import phaseserve.quiet  # noqa: E402, F401  (no backend-probe INFO lines)
from lab.eval.demo import default_model_path, describe_engine, measured_lines, show_default_model  # noqa: E402
from lab.eval.generation import engine_generate_fn  # noqa: E402
from phaseserve.config_hydra import BenchConfig, serve_config  # noqa: E402


def engine_tree(cfg: DictConfig) -> DictConfig:
    """``configs/serve.yaml``'s engine settings as the experiments' tree (its ``quant`` and ``cache`` nodes, ``mode``
    and ``max_batch`` as ``engine.*``, over the schema's defaults), for the one Hydra -> ``ServeConfig`` translation,
    :func:`phaseserve.config_hydra.serve_config`."""
    return OmegaConf.merge(OmegaConf.structured(BenchConfig), {
        "quant": cfg.quant, "cache": cfg.cache, "engine": {"mode": cfg.mode, "max_batch": cfg.max_batch}})


def demo(engine: ps.Engine, cfg: DictConfig, show=print) -> None:
    """The run's requests: the default model's two examples, or ``cfg.prompt`` on another checkpoint."""
    if cfg.checkpoint:
        out = engine.generate([ps.Request(id="prompt", prompt=list(cfg.prompt), max_tokens=cfg.max_tokens)])[0]
        show(f"prompt: {list(cfg.prompt)}\ngenerated: {out.tokens} ({out.finish_reason})")
    else:
        show_default_model(generate_fn=engine_generate_fn(engine), text_tokens=cfg.max_tokens, show=show)


def run(cfg: DictConfig) -> None:
    path = cfg.checkpoint or default_model_path()
    model_cfg, params = ps.load_checkpoint(path, dtype=cfg.dtype)
    engine = ps.Engine(model_cfg, params, serve_config(engine_tree(cfg), model_cfg))
    print(describe_engine(engine, os.path.relpath(path)))
    demo(engine, cfg, show=lambda *_: None)  # once unprinted: compiles every shape, so the measured run has none
    engine.reset_metrics()
    demo(engine, cfg)
    print("\n".join(measured_lines(engine, "the second run of the same requests; CPU times")))


@hydra.main(config_path="../configs", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ps.ConfigError, ps.CheckpointError) as e:  # a bad setting: one line that names it, exit status 1
        raise SystemExit(f"error: {type(e).__name__}: {e}") from None


if __name__ == "__main__":
    main()
