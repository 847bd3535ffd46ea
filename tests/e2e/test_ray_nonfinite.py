"""Issue 61 on the Ray backend: the checkpoint whose attention overflows (layer 0's ``kv_a_layernorm`` scaled by 1e30,
``test_nonfinite_logits.write_overflowing_checkpoint``) served by prefill and decode actors ends every request with
``NonFiniteLogitsError`` and no token, integrity on, never as an integrity abort; no page is left held on either
side. A local Ray cluster; every wait has a timeout."""

from __future__ import annotations

import ray

from phaseserve.distributed import ModelSource, RayEngine, RayOptions
from tests.e2e.engine_utils import serve_config
from tests.e2e.test_nonfinite_logits import assert_overflow_outputs, overflow_requests, write_overflowing_checkpoint


def test_an_attention_overflow_on_the_ray_backend_emits_nothing(tmp_path):
    write_overflowing_checkpoint(tmp_path)
    serve = serve_config("disaggregated", num_pages=64, integrity=True, max_prefill_tokens=8)
    engine = RayEngine(ModelSource(checkpoint=str(tmp_path)), serve, RayOptions(transfer_timeout_s=120.0))
    try:
        outs = engine.generate(overflow_requests())
        summary = engine.summary()
        engine.check_invariants()
        assert engine.allocator.num_used == 0 and engine.prefill.allocator.num_used == 0
        staged = engine.prefill.snapshot()
        assert staged["staged"] == 0 and staged["staging_pages_in_use"] == 0, staged
    finally:
        engine.close()
        ray.shutdown()
    assert_overflow_outputs(outs, summary)
