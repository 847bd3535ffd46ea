"""GLM-5 DSA on the Ray backend: the prefill actor hands the prompt's FP8 latents *and* FP8 index keys to the decode
actor over the transfer layer; the tokens equal the in-process engine's (FP8 KV) for generations running past
``index_topk``. A local Ray cluster; every wait has a timeout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import ray

import phaseserve as ps
from phaseserve.distributed import ModelSource, RayEngine, RayOptions
from phaseserve.engine import Request
from tests.e2e.engine_utils import F32, serve_config
from tests.parity.hf_models import build, dsa_config

pytestmark = pytest.mark.slow  # minutes of CPU: run by `pytest -m slow` (README), not the default run

FP8_KV = dataclasses.replace(F32, kv_dtype="float8_e4m3fn")


@pytest.mark.parametrize("lengths", [(6, 12)])
def test_ray_actors_carry_index_keys(tmp_path, lengths):
    build(dsa_config(8, ["full", "shared", "full"]), tmp_path, seed=5)
    cfg, params = ps.load_checkpoint(tmp_path, dtype="float32")
    rng = np.random.default_rng(0)
    reqs = [Request(id=f"d{i}", prompt=rng.integers(0, 96, n).tolist(), max_tokens=16, ignore_eos=True)
            for i, n in enumerate(lengths)]
    serve = serve_config("disaggregated", quant=FP8_KV, num_pages=64, max_batch=4)
    ref = {o.id: o.tokens for o in ps.Engine(cfg, params, serve).generate(reqs)}
    engine = RayEngine(ModelSource(checkpoint=str(tmp_path)), serve, RayOptions(transfer_timeout_s=240.0))
    try:
        outs = engine.generate(reqs)
        engine.check_invariants()
        assert engine.allocator.num_used == 0 and engine.prefill.allocator.num_used == 0
    finally:
        engine.close()
        ray.shutdown()
    assert all(o.error is None and o.finish_reason == "length" for o in outs), [o.error for o in outs]
    assert {o.id: o.tokens for o in outs} == ref
