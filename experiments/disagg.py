"""Multi-process disaggregated serving: start a prefill server, a decode server and a router from one config.

Thin Hydra entry point (settings in ``configs/disagg.yaml``); the logic lives in ``phaseserve.serving``. Prints
the tokens per request, throughput, and both servers' counters (transfers, bytes on the wire, pages in use).
"""

from __future__ import annotations

import time

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

import phaseserve as ps
import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from phaseserve.serving import ModelSpec, Router, ServerSpec


def specs(c: DictConfig) -> tuple[ServerSpec, ServerSpec]:
    quant = ps.QuantConfig(prefill_weights=c.prefill.weights, decode_weights=c.decode.weights, kv_dtype=c.kv_dtype,
                           prefill_kv_dtype=c.prefill_kv_dtype, int4_group_size=c.int4_group_size,
                           fp8_block=tuple(c.fp8_block) if c.fp8_block else None)
    cache = ps.CacheConfig(page_size=c.page_size, num_pages=c.decode.num_pages, max_pages_per_seq=c.max_pages_per_seq,
                           integrity=c.integrity)
    mesh = ps.MeshConfig(prefill_tp=c.prefill.tp, decode_tp=c.decode.tp, decode_ep=c.decode.ep)
    serve = ps.ServeConfig(mode="disaggregated", quant=quant, cache=cache, mesh=mesh, max_batch=c.max_batch)
    model = ModelSpec(checkpoint=c.checkpoint, hf_config=OmegaConf.to_container(c.model), seed=c.seed)
    common = dict(model=model, serve=serve, bind=c.transfer.bind, transfer_timeout_s=c.transfer.timeout_s,
                  staging_ttl_s=c.transfer.staging_ttl_s)
    return (ServerSpec(host_devices=c.prefill.host_devices, **common),
            ServerSpec(host_devices=c.decode.host_devices, **common))


@hydra.main(config_path="../configs", config_name="disagg", version_base=None)
def main(c: DictConfig) -> None:
    pre, dec = specs(c)
    rng = np.random.default_rng(c.seed)
    w = c.workload
    with Router(pre, dec) as router:
        vocab = router.cfg.vocab_size
        reqs = [ps.Request(id=f"r{i}", prompt=rng.integers(0, vocab, int(rng.integers(w.min_prompt,
                                                                                    w.max_prompt + 1))).tolist(),
                           max_tokens=w.max_tokens, ignore_eos=True) for i in range(w.num_requests)]
        t = time.perf_counter()
        outs = router.generate(reqs, timeout_s=600)
        dt = time.perf_counter() - t
        for o in outs:
            print(f"{o.id}: {o.finish_reason} {o.tokens}" + (f"  error: {o.error!r}" if o.error else ""))
        n = sum(len(o.tokens) for o in outs)
        print(f"{n} tokens in {dt:.2f}s (compilation included): {n / dt:.1f} tok/s")
        p, d = router.stats("prefill"), router.stats("decode")
        d.pop("events")
        print("prefill:", p)
        print("decode:", d)


if __name__ == "__main__":
    main()
