"""Data-parallel engine replicas (``phaseserve.engine.replicas``): each replica is an engine on its own device
block (or all on one, sharing their compiled steps), the requests are split by load, and the outputs equal one
engine's; bad requests, duplicates, early-closed
streams and configuration errors behave as on one engine."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import phaseserve as ps
from phaseserve.config import ConfigError
from phaseserve.engine import CancelledError, DuplicateRequestError, EmptyPromptError, ReplicatedEngine, Request
from phaseserve.engine.replicas import replica_devices, route
from tests.e2e.engine_utils import make_checkpoint, random_requests, serve_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, cfg, params = make_checkpoint("deepseek_v3_grouped", tmp_path_factory.mktemp("ckpt"), seed=4)
    return cfg, params


@pytest.fixture(scope="module")
def replicas(model):
    cfg, params = model
    eng = ReplicatedEngine(cfg, params, serve_config("colocated", mesh=ps.MeshConfig(replicas=2)))
    yield eng
    eng.close()


def test_replicas_equal_one_engine_on_their_own_devices(model, replicas):
    cfg, params = model
    reqs = random_requests(cfg.vocab_size, 7, seed=5)
    single = ps.Engine(cfg, params, serve_config("colocated", max_batch=8)).generate(reqs)
    replicas.reset_metrics()
    outs = replicas.generate(reqs)
    assert [o.id for o in outs] == [r.id for r in reqs]
    assert [o.tokens for o in outs] == [o.tokens for o in single]
    assert all(o.finish_reason == "length" for o in outs)
    devs = [{d.id for d in e.decode_mesh.devices.flat} for e in replicas.engines]
    assert devs == [{0}, {1}]
    for e, dev in zip(replicas.engines, jax.devices()[:2], strict=True):
        assert all(w.devices() == {dev} for w in jax.tree.leaves(e.decode_params))
    s = replicas.summary()
    per = [p["requests"] for p in s["replicas"]]
    assert all(n > 0 for n in per) and sum(per) == s["requests"] == len(reqs)
    assert s["output_tokens"] == sum(len(o.tokens) for o in outs) == sum(r.max_tokens for r in reqs)
    assert s["output_tok_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
    for e in replicas.engines:
        assert e.allocator.num_free == e.num_pages - 1
    replicas.check_invariants()


def test_bad_and_duplicate_requests_end_alone(model, replicas):
    cfg, _ = model
    good = random_requests(cfg.vocab_size, 4, seed=6)
    reqs = [good[0], Request(id="empty", prompt=[], max_tokens=3), good[1], good[0].replace(prompt=[1, 2]),
            good[2], good[3]]
    outs = replicas.generate(reqs)
    assert [o.id for o in outs] == [r.id for r in reqs]
    assert isinstance(outs[1].error, EmptyPromptError) and outs[1].finish_reason == "error"
    assert isinstance(outs[3].error, DuplicateRequestError) and outs[3].finish_reason == "error"
    for i in (0, 2, 4, 5):
        assert outs[i].finish_reason == "length" and len(outs[i].tokens) == reqs[i].max_tokens


def test_stream_equals_generate_and_early_close_cancels(model, replicas):
    cfg, _ = model
    reqs = random_requests(cfg.vocab_size, 6, seed=7, max_tokens=(6, 10))
    ref = {o.id: o.tokens for o in replicas.generate(reqs)}
    got: dict[str, list[int]] = {}
    for rid, tok in replicas.stream([r.replace(id=r.id + "s") for r in reqs]):
        got.setdefault(rid[:-1], []).append(tok)
    assert got == ref
    gen = replicas.stream([r.replace(id=r.id + "c") for r in reqs])
    first = [next(gen) for _ in range(3)]
    gen.close()
    assert len(first) == 3
    outs = {k: v for k, v in replicas.outputs.items() if k.endswith("c")}
    assert len(outs) == len(reqs) and all(o.finish_reason is not None for o in outs.values())
    assert any(isinstance(o.error, CancelledError) for o in outs.values())
    for e in replicas.engines:
        assert e.allocator.num_free == e.num_pages - 1
    assert replicas.generate(reqs[:2])[0].tokens == ref[reqs[0].id]  # still serving


def test_shared_replicas_run_one_executable_per_shape_and_equal_one_engine(model):
    cfg, params = model
    reqs = random_requests(cfg.vocab_size, 7, seed=8)
    single = ps.Engine(cfg, params, serve_config("disaggregated", max_batch=8)).generate(reqs)
    eng = ReplicatedEngine(cfg, params, serve_config("disaggregated",
                                                     mesh=ps.MeshConfig(replicas=2, replica_devices="shared")))
    try:
        first, second = eng.engines
        assert second.prefill.steps is first.prefill.steps and second.decode.steps is first.decode.steps
        assert [{d.id for d in e.decode_mesh.devices.flat} for e in eng.engines] == [{1}, {1}]
        outs = eng.generate(reqs)
        assert [o.tokens for o in outs] == [o.tokens for o in single]
        assert all(p["requests"] > 0 for p in eng.summary()["replicas"])
        compiled = len(first.decode.steps._ready) + len(first.prefill.steps._ready)
        assert compiled > 0
        second.decode.warm(*next(iter(first.decode.steps._ready)))  # compiled by the first: run, not compiled again
        assert len(first.decode.steps._ready) + len(first.prefill.steps._ready) == compiled
        for e in eng.engines:
            assert e.allocator.num_free == e.num_pages - 1
        eng.check_invariants()
    finally:
        eng.close()


def test_replica_configuration_errors(model):
    cfg, params = model
    with pytest.raises(ConfigError, match="ReplicatedEngine"):
        ps.Engine(cfg, params, serve_config("colocated", mesh=ps.MeshConfig(replicas=2)))
    with pytest.raises(ConfigError, match="replicas"):
        ps.MeshConfig(replicas=2, decode_devices=(0,))
    with pytest.raises(ConfigError, match="needs 9 devices"):
        replica_devices(jax.devices(), ps.MeshConfig(replicas=3, decode_tp=3), "colocated")
    mesh = ps.MeshConfig(replicas=2)  # disaggregated on two devices: each replica's phases share its device
    assert [[d.id for d in b] for b in replica_devices(jax.devices()[:2], mesh, "disaggregated")] == [[0], [1]]
    assert [[d.id for d in b] for b in replica_devices(jax.devices(), mesh, "disaggregated")] == [[0, 1], [2, 3]]
    shared = dataclasses.replace(mesh, replicas=3, replica_devices="shared")
    assert [[d.id for d in b] for b in replica_devices(jax.devices()[:2], shared, "disaggregated")] == [[0, 1]] * 3
    with pytest.raises(ConfigError, match="replica_devices"):
        ps.MeshConfig(replicas=2, replica_devices="spread")
    two_tp = dataclasses.replace(mesh, decode_tp=2)
    assert [[d.id for d in b] for b in replica_devices(jax.devices(), two_tp, "colocated")] == [[0, 1], [2, 3]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=30), st.integers(1, 4))
def test_route_balances_load(sizes, n):
    reqs = [Request(id=f"q{i}", prompt=[1] * p, max_tokens=m) for i, (p, m) in enumerate(sizes)]
    where = route(reqs, n)
    load = [sum(p + m for (p, m), w in zip(sizes, where, strict=True) if w == i) for i in range(n)]
    assert all(0 <= w < n for w in where)
    assert max(load) - min(load) <= max(p + m for p, m in sizes)  # greedy least-loaded: within one request
    dup = route(reqs + [reqs[0].replace(prompt=[1])], n)
    assert dup[-1] == dup[0]


def test_replicas_from_hydra_config():
    from hydra import compose, initialize_config_dir

    import lab.bench  # noqa: F401  (registers the structured configs the yaml files extend)

    configs = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs")
    with initialize_config_dir(config_dir=configs, version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny_mla", "mesh=single", "mesh.replicas=2",
                                                       "engine.mode=colocated"])
    eng = ReplicatedEngine.from_hydra(cfg)
    assert len(eng.engines) == 2 and eng.serve.mesh.replicas == 2
    assert [{d.id for d in e.decode_mesh.devices.flat} for e in eng.engines] == [{0}, {1}]
    outs = eng.generate([Request(id=f"h{i}", prompt=[1, 2, 3 + i], max_tokens=4, ignore_eos=True) for i in range(2)])
    assert all(o.finish_reason == "length" and len(o.tokens) == 4 for o in outs)
    assert [p["requests"] for p in eng.summary()["replicas"]] == [1, 1]
    eng.close()
