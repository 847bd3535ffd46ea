"""Main job: serve the shipped default model through the disaggregated engine and print what it generates.

Thin Hydra entry point (settings in ``configs/serve.yaml``). Prefill runs on one (simulated, on CPU) device with
its weight representation, decode on another with its own, the prompt KV is handed over as FP8 pages, and the
page-tag integrity check runs before every decode step. It prints a greedy continuation of a Python prompt, a
tool call for a held-out request (checked against the tool's schema), and the run's serving metrics.
``checkpoint=/path/to/hf_dir`` serves any supported Hugging Face checkpoint instead (token ids are printed then).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # CPU: prefill + decode devices

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import phaseserve as ps  # noqa: E402
from phaseserve.eval.demo import default_model_path, show_default_model  # noqa: E402
from phaseserve.eval.generation import engine_generate_fn  # noqa: E402


def serve_config(cfg: DictConfig) -> ps.ServeConfig:
    q, c = cfg.quant, cfg.cache
    return ps.ServeConfig(
        mode=cfg.mode,
        quant=ps.QuantConfig(prefill_weights=q.prefill_weights, decode_weights=q.decode_weights, kv_dtype=q.kv,
                             prefill_kv_dtype=q.prefill_kv, int4_group_size=q.int4_group_size),
        cache=ps.CacheConfig(page_size=c.page_size, kv_budget_bytes=int(c.kv_budget_bytes),
                             max_pages_per_seq=c.max_pages_per_seq, integrity=c.integrity, admission=c.admission),
        max_batch=cfg.max_batch,
    )


@hydra.main(config_path="../configs", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    path = cfg.checkpoint or default_model_path()
    model_cfg, params = ps.load_checkpoint(path, dtype=cfg.dtype)
    engine = ps.Engine(model_cfg, params, serve_config(cfg))
    print(f"model: {path} ({model_cfg.architecture}); mode {cfg.mode}; prefill weights {cfg.quant.prefill_weights}, "
          f"decode weights {cfg.quant.decode_weights}, KV {engine.kv_dtype} in {engine.num_pages} pages")
    if cfg.checkpoint:
        out = engine.generate([ps.Request(id="prompt", prompt=list(cfg.prompt), max_tokens=cfg.max_tokens)])[0]
        print(f"prompt: {list(cfg.prompt)}\ngenerated: {out.tokens} ({out.finish_reason})")
    else:
        show_default_model(path, generate_fn=engine_generate_fn(engine), text_tokens=cfg.max_tokens)
    s = engine.summary()
    print(f"served {s['requests']} requests: {s['output_tokens']} tokens, {s['decode_steps']} decode steps, "
          f"{s['integrity_checks']} integrity row checks, aborted {s['aborted']}, "
          f"pages in use at peak {s['peak_pages_in_use']}")


if __name__ == "__main__":
    main()
