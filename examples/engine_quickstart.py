"""Serve a few requests through the disaggregated engine: FP8 KV pages, INT4 decode weights, FP8 prefill weights,
the page-tag integrity check on, and a fault injected into one request to show that only it is aborted; then a prompt
served again from the prefix cache, its last token run as a decode row instead of a prefill launch.

Run: ``python examples/engine_quickstart.py`` (CPU is fine; it simulates 2 devices so prefill and decode get
their own meshes).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402

import phaseserve as ps  # noqa: E402
from lab.faults import FaultInjector  # noqa: E402

hf_config = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=512, hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=128,
                 q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
cfg = ps.ModelConfig.from_hf_config(hf_config)
params = ps.init_params(cfg, jax.random.key(0), "bfloat16")

serve = ps.ServeConfig(
    mode="disaggregated",  # prefill on device 0, decode on device 1
    quant=ps.QuantConfig(prefill_weights="fp8", decode_weights="int4", kv_dtype="float8_e4m3fn",
                         int4_group_size=32),
    cache=ps.CacheConfig(page_size=16, kv_budget_bytes=2 << 20, max_pages_per_seq=16, integrity=True,
                         retain_prefixes=True),  # finished prompts' pages stay cached until reused
    max_batch=8,
)
engine = ps.Engine(cfg, params, serve)
requests = [ps.Request(id=f"r{i}", prompt=list(range(1 + i, 20 + 3 * i)), max_tokens=12, ignore_eos=True)
            for i in range(6)]
requests.append(ps.Request(id="bad", prompt=[], max_tokens=4))  # rejected alone with a typed error


def corrupt_r3(eng, rows):
    """Before the 3rd decode step, point r3's first page-table entry at a free page (a bookkeeping bug)."""
    if eng.metrics.decode_steps == 2:
        FaultInjector(eng.tables).point_at_free_page("r3", 0)


engine.fault_hooks.append(corrupt_r3)
for out in engine.generate(requests):
    print(f"{out.id:>4}: {out.finish_reason:<8} {out.tokens}  {type(out.error).__name__ if out.error else ''}")
summary = engine.summary()
print({k: summary[k] for k in ("output_tok_per_s", "peak_concurrency", "aborted", "errors", "integrity_checks")})
ahead = engine.decode.lookahead_stats
print(f"decode steps launched ahead of the previous step's tokens: used {ahead['used']}, dropped {ahead['dropped']} "
      "(dropped: the next step's rows or inputs differed, e.g. after the fault)")
print(f"KV pages: {engine.num_pages} ({engine.kv_dtype}); all free again: "
      f"{engine.allocator.num_free == engine.num_pages - 1}")

# The same 32-token prompt (two whole pages) twice: the second is cached to its last page, which is copied into its
# own page, and its last token runs in the decode step (engine.decode_hit_suffix): no prefill launch.
engine.fault_hooks.clear()
prompt = list(range(100, 132))
engine.generate([ps.Request(id="first", prompt=prompt, max_tokens=6, ignore_eos=True)])
before = engine.metrics.prefill_tokens
again = engine.generate([ps.Request(id="again", prompt=prompt, max_tokens=6, ignore_eos=True)])[0]
print(f"again: {again.metrics.prefix_hit_tokens} prompt tokens from the prefix cache, "
      f"{engine.metrics.prefill_tokens - before} prefilled, tokens {again.tokens}")
