"""Two engine replicas behind one OpenAI-compatible endpoint, driven by the official ``openai`` client.

The shipped default model is loaded once; a :class:`phaseserve.ReplicatedEngine` builds two engines over the same
(simulated CPU) device layout sharing their compiled steps (``MeshConfig(replica_devices="shared")``: on a CPU the
simulated devices are one pool of cores, so the replicas' threads are what runs them at once), and the HTTP server
runs each replica's engine loop in its own thread behind one endpoint (``python -m phaseserve.server mesh.replicas=2
mesh.replica_devices=shared engine.mode=colocated`` does the same from the command line). Eight streamed
completions are sent at once; the balancer sends a prompt to the replica that holds its cached prefix
(``phaseserve.server.routing``; these eight share no page) and otherwise spreads them by the tokens each replica has
in flight. The script checks the streamed text against the replicas' own in-process greedy output and prints
how many requests each replica served and the server's Prometheus token counter. Then it serves the same eight
again with ``replica_fill=8`` (``experiment.replica_fill=8`` on the command line): the first replica takes requests
until it runs eight, so all eight go to it (one batch of eight rows, where a step's fixed cost dominates, as on a
CPU).

Run: ``python examples/server_replicas.py`` (CPU is fine; it simulates 2 devices).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import asyncio  # noqa: E402
import urllib.request  # noqa: E402

import openai  # noqa: E402

import phaseserve as ps  # noqa: E402
from lab.eval.demo import default_model_path  # noqa: E402
from phaseserve.data.tokenizer import ByteTokenizer  # noqa: E402
from phaseserve.server import EngineBackend, create_app  # noqa: E402
from phaseserve.server.launch import start_in_thread  # noqa: E402

MODEL, TOKENS = "phaseserve-default", 16
tok = ByteTokenizer()
cfg, params = ps.load_checkpoint(default_model_path(), "float32")
f32 = ps.QuantConfig(prefill_weights="float32", decode_weights="float32", kv_dtype="float32",
                     prefill_kv_dtype="float32")
serve = ps.ServeConfig(mode="colocated", quant=f32, max_batch=8,
                       mesh=ps.MeshConfig(replicas=2, replica_devices="shared"),
                       cache=ps.CacheConfig(page_size=16, num_pages=128, max_pages_per_seq=8))
replicas = ps.ReplicatedEngine(cfg, params, serve)
prompts = [f"def {name}(items):\n    \"\"\"Return the {what} of the items.\"\"\"\n    return "
           for name, what in (("total", "sum"), ("mean", "average"), ("largest", "maximum"), ("smallest", "minimum"),
                              ("unique", "distinct values"), ("first", "first one"), ("last", "last one"),
                              ("count", "number"))]
reference = replicas.generate([ps.Request(id=f"ref{i}", prompt=tok.encode(p, bos=True), max_tokens=TOKENS,
                                          ignore_eos=True)  # <bos>: as the server encodes a string prompt
                               for i, p in enumerate(prompts)])  # in-process, greedy (also compiles the shapes)
for engine in replicas.engines:
    engine.reset_metrics()

app = create_app([EngineBackend(engine) for engine in replicas.engines], tok, MODEL)
server, thread, base = start_in_thread(app)


async def complete_all() -> list[str]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused")

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


texts = asyncio.run(complete_all())
for prompt, text in zip(prompts, texts, strict=True):
    print(repr(prompt.splitlines()[0]), "->", repr(text))
same = texts == [tok.decode(o.tokens, skip_special=True) for o in reference]
print("streamed text equals the in-process tokens:", same)
print("requests per replica:", [len(engine.outputs) for engine in replicas.engines])
metrics = urllib.request.urlopen(base + "/metrics").read().decode()
print(next(line for line in metrics.splitlines() if line.startswith("phaseserve:generation_tokens_total")))
server.should_exit = True
thread.join(30)

for engine in replicas.engines:
    engine.reset_metrics()
app = create_app([EngineBackend(engine) for engine in replicas.engines], tok, MODEL, replica_fill=8)
server, thread, base = start_in_thread(app)
packed = asyncio.run(complete_all())
print("packed (replica_fill=8): same text:", packed == texts,
      "requests per replica:", [len(engine.outputs) for engine in replicas.engines])
server.should_exit = True
thread.join(30)
replicas.close()
