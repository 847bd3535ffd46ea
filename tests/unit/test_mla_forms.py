"""MLA's two forms of a prefill chunk over cached keys agree: the weight-absorbed form (chosen where it is cheaper, a
short chunk over a long context) against the expanded one, on fresh random weights, activations and cached latents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from phaseserve.config import ModelConfig
from phaseserve.model import attention_mla
from phaseserve.model.params import init_params
from phaseserve.presets import preset

CFG = ModelConfig.from_hf_config(preset("tiny-mla-moe"))


def test_the_absorbed_form_is_chosen_for_short_chunks_over_long_contexts_only():
    race = ModelConfig.from_hf_config({**preset("tiny-mla-moe"), "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                                       "qk_nope_head_dim": 32, "v_head_dim": 32, "num_attention_heads": 8})
    assert attention_mla.absorbed_is_cheaper(race, 16, 256)  # a prefix hit's suffix over 16 pages
    assert not attention_mla.absorbed_is_cheaper(race, 160, 160)  # a fresh prompt over its own keys
    assert attention_mla.absorbed_is_cheaper(race, 1, 2) and not attention_mla.absorbed_is_cheaper(race, 512, 512)


@pytest.mark.parametrize("t,s,start", [(4, 24, 17), (1, 40, 39), (8, 16, 0)])
def test_absorbed_chunk_equals_expanded(monkeypatch, t, s, start):
    """Rows at different offsets (one padding row that sees no key), cached latents at positions < start, the
    chunk's own at start..start+t-1: both forms give the same output, and the chosen one is the absorbed."""
    key = jax.random.key(t * 100 + s)
    attn = init_params(CFG, key, "float32").layers[0].attn
    b = 3
    kx, kc = jax.random.split(jax.random.fold_in(key, 1))
    x = jax.random.normal(kx, (b, t, CFG.hidden_size), jnp.float32)
    cached = jax.random.normal(kc, (b, s, CFG.kv_lora_rank + CFG.qk_rope_head_dim), jnp.float32)
    offsets = np.array([start, max(start - 3, 0), 0])
    positions = jnp.asarray(offsets[:, None] + np.arange(t)[None], jnp.int32)
    lengths = jnp.asarray(np.minimum(offsets + t, s) * np.array([1, 1, 0]), jnp.int32)  # row 2: padding

    def context(kv):  # the chunk's latents written over the cache at their positions, as the pool gives them back
        rows = jnp.arange(b)[:, None]
        return cached.at[rows, jnp.clip(positions, 0, s - 1)].set(kv)

    run = jax.jit(lambda: attention_mla.forward(attn, CFG, x, positions, lengths, context=context)[0])
    assert attention_mla.absorbed_is_cheaper(CFG, t, s)
    absorbed = np.asarray(run())
    monkeypatch.setattr(attention_mla, "absorbed_is_cheaper", lambda *a: False)
    expanded = np.asarray(jax.jit(lambda: attention_mla.forward(attn, CFG, x, positions, lengths,
                                                                context=context)[0])())
    assert np.abs(expanded).max() > 0.01 and np.isfinite(absorbed).all()
    np.testing.assert_allclose(absorbed, expanded, rtol=2e-5, atol=2e-5)
