"""KV transfer pieces that every cross-process path uses, checked in process (no Ray): the staging area's
descriptor checks one field at a time (the prefill side of ``jax.experimental.transfer``: wrong server, unknown
uuid, mismatched fields, stale tags, a replay, a genuine descriptor asked for by another request), a real pull of
staged FP8 KV, release and TTL expiry without leaks; and a two-process ``jax.distributed`` mesh on CPU (the
bring-up a phase spanning hosts needs, ``phaseserve.distributed.multihost``). Children are spawned (never forked) with
``JAX_PLATFORMS=cpu``; every wait has a timeout.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from phaseserve.distributed import StaleDescriptorError


def test_staging_area_checks_each_descriptor_field():
    from phaseserve.distributed.protocol import ForgedDescriptorError
    from phaseserve.distributed.transfer import Puller, StagingArea, start_endpoint

    staging = StagingArea(start_endpoint(), num_pages=4, page_size=4, ttl_s=60.0)
    vals = jax.random.normal(jax.random.key(0), (8, 3)).astype(jnp.float8_e4m3fn)
    leaves = [vals, jnp.arange(8, dtype=jnp.float32)]
    d1 = staging.stage("a", leaves, 7, "float8_e4m3fn")
    d2 = staging.stage("b", leaves, 8, "float8_e4m3fn")
    assert staging.stage("c", leaves, 8, "float8_e4m3fn") is None and staging.pages_in_use == 4  # full
    kinds = {}
    for name, bad in [("wrong_server", d1.replace(server_id=d1.server_id + 1)),
                      ("unknown", d1.replace(uuid=d1.uuid + 100)), ("mismatch", d1.replace(request_id="b")),
                      ("stale_tag", d1.replace(tags=d2.tags))]:
        with pytest.raises(ForgedDescriptorError):  # altered after signing: refused before any field is looked at
            staging.serve(bad)
        with pytest.raises(StaleDescriptorError) as e:  # signed by the control plane: the field checks beneath
            staging.serve(staging.auth.sign(bad))
        assert not isinstance(e.value, ForgedDescriptorError)
        kinds[name] = e.value.kind
    assert kinds == {k: k for k in kinds}
    with pytest.raises(StaleDescriptorError) as e:  # a genuine descriptor asked for by another request
        staging.serve(d1, requester="b")
    assert e.value.kind == "mismatch"
    staging.serve(d1)
    with pytest.raises(StaleDescriptorError, match="already served"):
        staging.serve(d1)
    got = Puller(start_endpoint(), jax.devices()[0]).pull(d1)
    assert got[0].dtype == jnp.float8_e4m3fn and np.array_equal(np.asarray(got[0], np.float32),
                                                                 np.asarray(vals, np.float32))
    assert staging.release(d1.uuid) and not staging.release(d1.uuid)
    with pytest.raises(StaleDescriptorError) as e:
        staging.serve(d1)
    assert e.value.kind == "unknown"
    assert staging.expire(now=time.monotonic() + 61) == ["b"] and staging.pages_in_use == 0
    staging.allocator.check_invariants()


def test_two_process_jax_distributed_mesh_on_cpu():
    import multiprocessing as mp

    from phaseserve.distributed.multihost import free_port, selfcheck_worker
    from phaseserve.distributed.protocol import child_env

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    coord = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=selfcheck_worker, args=(i, 2, coord, q), daemon=True) for i in range(2)]
    with child_env(1):  # the child imports jax while unpickling its target: set its environment first
        for p in procs:
            p.start()
    try:
        results = [q.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(r[0] == "ok" for r in results), results
    expected = float(sum(x * x for x in [0, 1, 2, 3, 10, 11, 12, 13]))
    assert [r[1] for r in results] == [expected, expected]
    assert sorted(r[2]["process_index"] for r in results) == [0, 1]
    assert all(r[2]["global_devices"] == 2 and r[2]["local_devices"] == 1 and r[2]["spans"] == [0, 1]
               for r in results)
