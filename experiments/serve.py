"""Main job: greedy generation from a prompt.

Thin Hydra entry point (settings in ``configs/serve.yaml``). For now it runs ``ps.forward`` greedily
(full recompute per token) on a small random model of the Kimi K2 architecture, or on an HF checkpoint
directory given as ``checkpoint=/path``.
"""

from __future__ import annotations

import hydra
import jax
import jax.numpy as jnp
from omegaconf import DictConfig

import phaseserve as ps


@hydra.main(config_path="../configs", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    if cfg.checkpoint:
        model_cfg, params = ps.load_checkpoint(cfg.checkpoint, dtype=cfg.dtype)
    else:
        model_cfg = ps.ModelConfig.from_hf_config(dict(cfg.model))
        params = ps.init_params(model_cfg, jax.random.key(cfg.seed), cfg.dtype)
    fwd = jax.jit(lambda p, t: ps.forward(p, model_cfg, t))
    tokens = list(cfg.prompt)
    for _ in range(cfg.max_tokens):
        logits = fwd(params, jnp.asarray([tokens], jnp.int32))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    print(f"model: {model_cfg.architecture}, {ps.model.params.param_count(params):,} parameters")
    print(f"prompt:    {list(cfg.prompt)}")
    print(f"generated: {tokens[len(cfg.prompt):]}")


if __name__ == "__main__":
    main()
