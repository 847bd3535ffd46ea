"""Data-parallel engine replicas: two engines, each on its own (simulated CPU) device, serving one batch together.

Each replica is a whole engine (weights, page pool, scheduler, jitted steps) on its own device; the batch is split
between them by load and each is driven from its own thread, so their decode steps run at the same time (on a CPU
machine: on two cores). The tokens are those of one engine; the script checks that and prints both throughputs.

Run: ``python examples/replicas.py`` (CPU is fine; it simulates 2 devices).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

import phaseserve as ps  # noqa: E402

hf_config = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=512, hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=64,
                 q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
cfg = ps.ModelConfig.from_hf_config(hf_config)
params = ps.init_params(cfg, jax.random.key(0), "float32")
f32 = ps.QuantConfig(prefill_weights="float32", decode_weights="float32", kv_dtype="float32",
                     prefill_kv_dtype="float32")
serve = ps.ServeConfig(mode="colocated", quant=f32, max_batch=16,
                       cache=ps.CacheConfig(page_size=16, num_pages=64, max_pages_per_seq=4))

one = ps.Engine(cfg, params, serve)
two = ps.ReplicatedEngine(cfg, params, dataclasses.replace(serve, mesh=ps.MeshConfig(replicas=2)))
requests = [ps.Request(id=f"r{i}", prompt=list(range(1 + i, 33 + i)), max_tokens=24, ignore_eos=True)
            for i in range(16)]
for engine in (one, two):  # warm-up: compile every shape once
    engine.generate([r.replace(id="warm-" + r.id) for r in requests])
    engine.reset_metrics()
times = {}
for name, engine in (("one engine", one), ("two replicas", two)):
    t = time.perf_counter()
    outs = engine.generate(requests)
    times[name] = time.perf_counter() - t
    tokens = [o.tokens for o in outs]
    if name == "one engine":
        reference = tokens
    print(f"{name}: {16 * 24 / times[name]:.0f} tok/s, same tokens as one engine: {tokens == reference}")
print("requests per replica:", [p["requests"] for p in two.summary()["replicas"]])
two.close()
