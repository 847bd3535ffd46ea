"""Context limits come from the model (RoPE scaling included) and the KV budget, not a small fixed page cap, and a
combination that cannot hold is a ConfigError when the config / engine is built."""

from __future__ import annotations

import jax
import pytest

import phaseserve as ps
from phaseserve.config import ConfigError, ModelConfig
from phaseserve.engine.request import Limits
from phaseserve.model.params import init_params
from phaseserve.presets import preset


def tiny(**kw) -> ModelConfig:
    return ModelConfig.from_hf_config(preset("tiny-mla-moe")).replace(**kw)


def test_context_length_follows_rope_scaling():
    cfg = tiny(max_position_embeddings=40960)
    assert cfg.context_length == 40960
    yarn = cfg.replace(rope=ps.config.RopeConfig(kind="yarn", factor=4.0, original_max_position_embeddings=32768))
    assert yarn.context_length == 131072  # Qwen3-style: rope_scaling added to a 32K-trained config
    kimi = cfg.replace(max_position_embeddings=262144,
                       rope=ps.config.RopeConfig(kind="yarn", factor=64.0, original_max_position_embeddings=4096))
    assert kimi.context_length == 262144
    assert cfg.replace(index_topk=2048).context_length == 40960  # GLM-5 DSA: sparse past index_topk, no limit


def test_max_context_derives_the_page_cap():
    serve = ps.ServeConfig(max_context=32768)
    assert serve.cache.max_pages_per_seq == 2048
    limits = Limits.of(tiny(max_position_embeddings=65536), serve)
    assert limits.max_context == 32768 and limits.max_pages == 2048
    assert ps.ServeConfig().cache.max_pages_per_seq == ps.config.DEFAULT_MAX_PAGES_PER_SEQ


def test_default_context_is_the_model_within_the_pool():
    serve = ps.ServeConfig(cache=ps.CacheConfig(page_size=16, max_pages_per_seq=4096))
    assert Limits.of(tiny(max_position_embeddings=8192), serve).max_context == 8192
    assert Limits.of(tiny(max_position_embeddings=8192), serve, num_pages=101).max_context == 1600


@pytest.mark.parametrize("build,match", [
    (lambda: ps.ServeConfig(max_context=5000, cache=ps.CacheConfig(max_pages_per_seq=64)), "max_pages_per_seq"),
    (lambda: Limits.of(tiny(max_position_embeddings=4096), ps.ServeConfig(max_context=8192)), "model's context"),
    (lambda: Limits.of(tiny(max_position_embeddings=8192), ps.ServeConfig(max_context=4096), num_pages=65),
     "64 pages x 16 = 1024"),
])
def test_bad_combinations_are_config_errors(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_engine_refuses_a_context_the_model_cannot_hold():
    cfg = tiny(max_position_embeddings=512)
    params = init_params(cfg, jax.random.key(0), "float32")
    with pytest.raises(ConfigError, match="model's context of 512"):
        ps.Engine(cfg, params, ps.ServeConfig(max_context=1024, cache=ps.CacheConfig(num_pages=256)))


def test_hydra_cache_can_derive_the_page_cap():
    from hydra import compose, initialize_config_dir

    from phaseserve.config_hydra import repo_path, serve_config

    with initialize_config_dir(config_dir=str(repo_path("configs")), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny_mla", "cache.max_pages_per_seq=null",
                                                       "engine.max_context=8192"])
    assert serve_config(cfg, tiny(max_position_embeddings=8192)).cache.max_pages_per_seq == 512
