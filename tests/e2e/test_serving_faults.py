"""Server-side inputs, in process (no child processes): transfer descriptors authenticated (signed by the control
plane, issue #42) and verified field by field on the prefill side (defect 4), and a decode server that survives any
control message -- malformed, wrongly typed, forged descriptors, unknown requests -- ending only the request a
message names, leaking no page (Hypothesis properties).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from phaseserve.engine import Request
from phaseserve.serving import ForgedDescriptorError, ModelSpec, ServerSpec, StaleDescriptorError, TransferDescriptor
from phaseserve.serving.protocol import rebuild_error
from phaseserve.serving.transfer import DescriptorAuth, Puller, StagingArea, start_endpoint
from tests.e2e.engine_utils import F32, make_checkpoint, serve_config


def examples(ci: int) -> int:
    """Hypothesis examples per property: ``ci`` (bounded for CI), or ``PHASESERVE_HYPOTHESIS_EXAMPLES`` (the soak
    benchmark's longer run)."""
    return int(os.environ.get("PHASESERVE_HYPOTHESIS_EXAMPLES", ci))


FP8_KV = dataclasses.replace(F32, kv_dtype="float8_e4m3fn")
ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=4),
                st.binary(max_size=3), st.tuples(st.integers(0, 9)), st.lists(st.integers(0, 9), max_size=3))
FIELDS = [f.name for f in dataclasses.fields(TransferDescriptor)]


@pytest.fixture(scope="module")
def staged():
    staging = StagingArea(start_endpoint(), num_pages=8, page_size=4, ttl_s=600.0)
    vals = jax.random.normal(jax.random.key(1), (8, 3)).astype(jnp.float8_e4m3fn)
    leaves = [vals, jax.random.uniform(jax.random.key(2), (8,), jnp.float32)]
    return staging, staging.stage("a", leaves, 7, "float8_e4m3fn"), staging.stage("b", leaves, 5, "float8_e4m3fn")


@pytest.mark.parametrize("field", ["length", "address", "kv_dtype", "page_size"])
def test_each_descriptor_field_is_verified(staged, field):
    """Defect 4: verify() ignored length, address, kv_dtype and page_size (a forged length gave wrong tokens)."""
    staging, d, _ = staged
    forged = {"length": d.length + 1, "address": "10.0.0.1:1", "kv_dtype": "bfloat16", "page_size": 8}[field]
    with pytest.raises(ForgedDescriptorError):  # altered after signing: the MAC no longer verifies
        staging.verify(d.replace(**{field: forged}))
    with pytest.raises(StaleDescriptorError, match=field) as e:  # re-signed by a key holder: still checked by field
        staging.verify(staging.auth.sign(d.replace(**{field: forged})))
    assert e.value.kind == "mismatch"
    assert staging.verify(d).descriptor == d


def test_a_forged_descriptor_arms_nothing_and_loses_nothing(staged):
    """Item 5 of issue #42: a descriptor naming a staged uuid but not signed with this deployment's secret (or
    altered, or expired) is refused typed before anything is armed; the genuine entry is still served after."""
    staging, _, _ = staged
    vals = jnp.ones((4, 3), jnp.float8_e4m3fn)
    d = staging.stage("forge-me", [vals, jnp.ones((4,), jnp.float32)], 3, "float8_e4m3fn")
    entry, used = staging.entries[d.uuid], staging.pages_in_use
    foreign = DescriptorAuth("another-deployment's-secret")
    for bad, kind in ((d.replace(mac=""), "forged"), (foreign.sign(d), "forged"), (d.replace(length=4), "forged"),
                      (staging.auth.sign(d, ttl_s=-1.0), "expired")):
        with pytest.raises(ForgedDescriptorError) as e:
            staging.serve(bad)
        assert e.value.kind == kind
        assert not entry.served and staging.entries[d.uuid] is entry and staging.pages_in_use == used
    with pytest.raises(ForgedDescriptorError):  # the decode side refuses it too, before connecting anywhere
        Puller(start_endpoint(), jax.devices()[0]).pull(d.replace(address="10.255.255.1:1", mac=""))
    staging.serve(d)
    got = Puller(start_endpoint(), jax.devices()[0]).pull(d)
    assert np.array_equal(np.asarray(got[0], np.float32), np.asarray(vals, np.float32))
    assert staging.refused["forged"] >= 3 and staging.refused["expired"] >= 1
    assert staging.release(d.uuid) and staging.pages_in_use == used - 1


@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(FIELDS), ANY, st.booleans())
def test_property_no_altered_descriptor_is_honoured(staged, field, value, other):
    staging, a, b = staged
    genuine = b if other else a
    forged = genuine.replace(**{field: value})
    try:  # the same signed bytes (7 == 7.0, but they are different descriptors)
        same = forged.canonical_bytes() == genuine.canonical_bytes() and forged.mac == genuine.mac
    except Exception:
        same = False
    if same:
        assert staging.verify(forged) is staging.entries[genuine.uuid]
        return
    with pytest.raises(StaleDescriptorError):
        staging.verify(forged)
    with pytest.raises(StaleDescriptorError):
        staging.verify(genuine, requester=a.request_id if other else b.request_id)  # another request's KV


@pytest.fixture(scope="module")
def decode_server(tmp_path_factory):
    from phaseserve.serving.decode_server import DecodeServer

    path = tmp_path_factory.mktemp("llama")
    _, cfg, _ = make_checkpoint("llama", path, seed=3)
    spec = ServerSpec(model=ModelSpec(checkpoint=str(path)), serve=serve_config(quant=FP8_KV, num_pages=24),
                      transfer_timeout_s=0.05)
    out: queue.Queue = queue.Queue()
    return DecodeServer(spec, queue.Queue(), out), out, cfg


def _genuine(server, rid: str, n: int) -> tuple[Request, TransferDescriptor]:
    """A request and a descriptor that pass every decode-side check (nothing is ever staged for it)."""
    req = Request(id=rid, prompt=list(range(1, n + 1)), max_tokens=3)
    pages = -(-n // server.page_size)
    t = pages * server.page_size
    leaves = tuple(((t, 1, server.cfg.kv_cache_width) if d != "float32" else (t, 1), d) for d in server._leaf_dtypes)
    desc = TransferDescriptor(request_id=rid, uuid=7, address="127.0.0.1:1", server_id=3, pages=tuple(range(pages)),
                              tags=(1,) * pages, length=n, page_size=server.page_size, kv_dtype=server.kv_dtype,
                              leaves=leaves)
    return req, desc


def _messages(server):
    req, desc = _genuine(server, "g", 6)
    descs = st.one_of(ANY, st.sampled_from(FIELDS).flatmap(lambda f: ANY.map(lambda v: desc.replace(**{f: v}))))
    reqs = st.one_of(ANY, st.just(req), st.builds(lambda p, m: req.replace(prompt=p, max_tokens=m), ANY, ANY))
    return st.one_of(
        ANY, st.tuples(), st.tuples(st.text(max_size=5)),
        st.tuples(st.just("kv_ready"), reqs, st.one_of(st.integers(-1, 200), ANY), descs),
        st.tuples(st.just("serve_reply"), ANY, ANY, st.one_of(ANY, st.tuples(ANY, ANY, ANY))),
        st.tuples(st.just("cancel"), st.one_of(ANY, st.just("g"))), st.tuples(st.just("kv_ready")),
        st.tuples(st.sampled_from(["tokens", "prompt", "release", "serve"]), ANY, ANY))


def test_property_the_decode_server_survives_any_control_message(decode_server):
    server, out, _ = decode_server

    @settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(_messages(server), min_size=1, max_size=6))
    def run(msgs):
        for m in msgs:
            server.handle(m)
            server.admit()
        time.sleep(0.06)  # every armed pull passes its (0.05 s) deadline: nothing can land without a prefill peer
        server.poll_transfers()
        assert not server.running and not server.pulls and not server.waiting
        assert server.allocator.num_used == 0
        server.tables.check_invariants()
        while not out.empty():
            m = out.get_nowait()
            if m[0] == "finished":
                assert m[2] in ("error", "aborted") and rebuild_error(m[3]) is not None

    run()
    assert server.alive and server.stats["bad_messages"] > 0


def test_a_forged_length_or_shape_is_refused_before_any_page_is_allocated(decode_server):
    server, out, _ = decode_server
    while not out.empty():
        out.get_nowait()
    req, desc = _genuine(server, "f", 6)
    for bad in (desc.replace(length=5), desc.replace(length=8), desc.replace(page_size=8),
                desc.replace(leaves=desc.leaves[:-1]), desc.replace(kv_dtype="bfloat16"),
                desc.replace(request_id="other")):
        server.handle(("kv_ready", req, 3, bad))
        msg = out.get_nowait()
        assert msg[0] == "finished" and msg[1] == "f" and msg[2] == "error"
        err = rebuild_error(msg[3])
        assert isinstance(err, StaleDescriptorError) and err.kind == "mismatch"
        assert server.allocator.num_used == 0 and not server.waiting
    server.handle(("kv_ready", req, 3, desc))  # the genuine one is accepted
    assert len(server.waiting) == 1
    server.admit()
    assert out.get_nowait()[0] == "serve" and server.allocator.num_used == 2
    time.sleep(0.06)
    server.poll_transfers()  # no grant ever comes: a typed timeout, pages back
    assert server.allocator.num_used == 0 and np.all(server.allocator.refcount == 0)


class _ErroredBuffer:
    """Stands in for a pulled array whose transfer failed: it reports ready, and waiting on it raises."""

    def is_ready(self) -> bool:
        return True

    def block_until_ready(self):
        raise RuntimeError("transfer aborted: peer closed the connection")


def test_an_errored_pull_ends_its_request_alone_and_the_server_lives(decode_server):
    """Defect 5: an errored pull reported ready, landing it raised and the decode process died."""
    from phaseserve.serving.protocol import TransferError

    server, out, _ = decode_server
    while not out.empty():
        out.get_nowait()
    req, desc = _genuine(server, "e", 5)
    server.spec = dataclasses.replace(server.spec, transfer_timeout_s=60.0)
    try:
        server.handle(("kv_ready", req, 3, desc))
        server.admit()
        server.pulls["e"][1].state, server.pulls["e"][1].arrays = "pulling", [_ErroredBuffer()]
        server.poll_transfers()
    finally:
        server.spec = dataclasses.replace(server.spec, transfer_timeout_s=0.05)
    msgs = [out.get_nowait() for _ in range(out.qsize())]
    fin = [m for m in msgs if m[0] == "finished"]
    assert [(m[1], m[2]) for m in fin] == [("e", "aborted")] and isinstance(rebuild_error(fin[0][3]), TransferError)
    assert ("release", desc.uuid) in msgs  # the prefill side may free its staging
    assert server.allocator.num_used == 0 and not server.pulls and server.stats["transfer_errors"] >= 1
    server.tables.check_invariants()
