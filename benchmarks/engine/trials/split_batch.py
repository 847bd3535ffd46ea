"""Trial (not engine code): can the CPU's second core speed up one decode step by splitting the batch?

The engine's compiled decode step (``profile_decode.compiled_step``: integrity hooks on, pool donated) on the 15M
shape, context 160 per row, three arms interleaved per repeat:

- ``one device``: the whole batch in one call on one CPU device (what the engine does);
- ``one jit, two halves``: one jitted call that runs the step on each half of the batch (separate pools), two
  independent subgraphs XLA's thunk executor may run concurrently;
- ``two devices``: the step on each half on its own simulated CPU device (``--xla_force_host_platform_device_count=2``,
  weights copied to both, one pool per device), both dispatched before either is awaited: data-parallel replicas.

    python benchmarks/engine/trials/split_batch.py > benchmarks/engine/trials/split_batch.md
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lab.bench.measure import environment, stats  # noqa: E402
from lab.bench.profile_decode import compiled_step, model_config, setup  # noqa: E402
from lab.bench.report import environment_section, spread  # noqa: E402

REPEATS = 25


def point(cfg, batch: int) -> dict[str, list[float]]:
    d0, d1 = jax.devices()[:2]
    full, halves = setup(cfg, batch), [setup(cfg, batch // 2, seed=s) for s in (1, 2)]
    step = compiled_step(cfg)
    both = jax.jit(lambda p, pa, pb, ba, bb, ok: (step(p, pa, ba, ok), step(p, pb, bb, ok)), donate_argnums=(1, 2))
    ok, okh = jnp.ones(batch, bool), jnp.ones(batch // 2, bool)
    on = [jax.device_put(x, d) for x, d in ((full["params"], d0), (full["params"], d1))]
    st = {"full": full["pool"], "a": halves[0]["pool"], "b": halves[1]["pool"],
          # copies: the one-jit arm donates halves' pools, and a device_put to their own device would alias them
          "a1": jax.device_put(jax.tree.map(jnp.copy, halves[0]["pool"]), d0),
          "b1": jax.device_put(jax.tree.map(jnp.copy, halves[1]["pool"]), d1)}
    ba1, bb1 = jax.device_put(halves[0]["batch"], d0), jax.device_put(halves[1]["batch"], d1)
    oka, okb = jax.device_put(okh, d0), jax.device_put(okh, d1)

    def one_device():
        nxt, st["full"], _ = step(full["params"], st["full"], full["batch"], ok)
        nxt.block_until_ready()

    def one_jit_two_halves():
        (a, st["a"], _), (b, st["b"], _) = both(full["params"], st["a"], st["b"], halves[0]["batch"],
                                               halves[1]["batch"], okh)
        jax.block_until_ready((a, b))

    def two_devices():
        a, st["a1"], _ = step(on[0], st["a1"], ba1, oka)
        b, st["b1"], _ = step(on[1], st["b1"], bb1, okb)
        jax.block_until_ready((a, b))

    arms = {"one device": one_device, "one jit, two halves": one_jit_two_halves, "two devices": two_devices}
    for f in arms.values():
        for _ in range(3):
            f()
    ms: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(REPEATS):
        for k in (list(arms) if r % 2 else list(arms)[::-1]):
            t = time.perf_counter()
            arms[k]()
            ms[k].append(1e3 * (time.perf_counter() - t))
    return ms


def main() -> None:
    cfg = model_config("dsv3-15m")
    print("# Trial: one decode step split over the CPU's two cores (15M shape)\n")
    what, arms = __doc__.split("\n\n")[1:3]
    print(what.replace("\n", " ") + "\n\n" + arms.replace("\n  ", " ") + "\n")
    print(f"ms per step, median [min, max] of {REPEATS} interleaved repeats; ratio: paired per repeat, over "
          "`one device`.\n")
    print("| batch | arm | ms per step | ratio |\n|---|---|---|---|")
    for batch in (8, 32, 64):
        ms = point(cfg, batch)
        base = np.array(ms["one device"])
        for k, v in ms.items():
            print(f"| {batch} | {k} | {spread(stats(v))} | {spread(stats(list(np.array(v) / base)))} |", flush=True)
    print("\n" + environment_section(environment()))


if __name__ == "__main__":
    main()
