"""One name per concept, each module one concern: where the central names live (read from the source, so a
move that leaves a second copy behind fails here)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _definitions() -> dict[str, list[str]]:
    """Every top-level name (class, function or assignment) of the library's modules -> the files defining it."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "phaseserve").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = getattr(node, "targets", [])
            for name in [getattr(node, "name", None)] + [t.id for t in targets if isinstance(t, ast.Name)]:
                if name is not None:
                    out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def top_level_defs(name: str) -> list[str]:
    """The library modules (``phaseserve``) that define ``name`` at top level."""
    return _definitions().get(name, [])


def test_the_request_state_lives_with_the_request():
    from phaseserve.engine import request

    assert request.Sequence.__module__ == "phaseserve.engine.request"
    assert top_level_defs("Sequence") == ["phaseserve/engine/request.py"]
    assert top_level_defs("stop_reason") == ["phaseserve/engine/request.py"]  # the finish rule


def test_the_workers_module_holds_the_workers():
    """Bucketing and pool sizes in ``engine.shapes``, batch building in ``engine.batches``, the paged export and
    import with the rest of the handoff; ``engine.workers`` keeps the two workers and their jitted steps."""
    where = {"shapes": ("bucket", "width_bucket", "chunk_bucket", "cache_pages", "prefill_pages", "chunk_groups",
                        "prefill_shapes", "decode_shapes"),
             "batches": ("sampling_rows", "chunk_batch", "decode_inputs", "warm_chunk_batch", "warm_decode_inputs"),
             "handoff": ("export_paged", "import_paged"),
             "workers": ("PrefillWorker", "DecodeWorker", "chunk_step_jit", "decode_step_jit", "local_workers")}
    for module, names in where.items():
        for name in names:
            assert top_level_defs(name) == [f"phaseserve/engine/{module}.py"], name


def test_one_package_for_cross_process_serving():
    """The Ray backend and its KV transfer plane are ``phaseserve.distributed``; the HTTP layer is
    ``phaseserve.server``: no ``serving`` package beside ``server``."""
    import phaseserve.distributed as dist

    assert not (ROOT / "phaseserve" / "serving").exists()
    for name in ("StagingArea", "Puller", "DescriptorAuth"):
        assert top_level_defs(name) == ["phaseserve/distributed/transfer.py"], name
    for name in ("TransferDescriptor", "ModelSource", "PeerDeadError"):
        assert getattr(dist, name).__module__ == "phaseserve.distributed.protocol", name
    # how a process gets its weights is ModelSource; ModelSpec is the Hydra model group's schema alone
    assert top_level_defs("ModelSpec") == ["phaseserve/config_hydra.py"]


def test_one_checkpoint_loader():
    """``load_checkpoint`` is the one loader (``phaseserve.load_checkpoint``: plain, FP8, INT4); the plain reading
    machinery under it is ``model.loader.read_checkpoint``."""
    import phaseserve as ps
    from phaseserve.quant import loader

    assert top_level_defs("load_checkpoint") == ["phaseserve/quant/loader.py"]
    assert ps.load_checkpoint is loader.load_checkpoint
    assert top_level_defs("read_checkpoint") == ["phaseserve/model/loader.py"]


def test_the_phase_steps_are_named_as_steps():
    """``engine.prefill`` / ``engine.decode`` are the engine's workers (``Engine.prefill``, ``Engine.decode``), not
    modules: the jitted steps live in ``engine.prefill_step`` and ``engine.decode_step``."""
    engine = ROOT / "phaseserve" / "engine"
    assert not (engine / "prefill.py").exists() and not (engine / "decode.py").exists()
    assert top_level_defs("chunk_step") == ["phaseserve/engine/prefill_step.py"]
    assert top_level_defs("DecodeBatch") == ["phaseserve/engine/decode_step.py"]


def test_the_kv_dtype_has_one_name_in_config_and_code():
    """The Hydra ``quant`` group spells the KV dtypes as :class:`~phaseserve.config.QuantConfig` does
    (``quant.kv_dtype``, ``quant.prefill_kv_dtype``), and every shipped quant config sets them under those names."""
    import dataclasses

    import yaml

    import phaseserve as ps
    from phaseserve.config_hydra import QuantSpec

    spec = {f.name for f in dataclasses.fields(QuantSpec)}
    assert {"kv_dtype", "prefill_kv_dtype"} <= spec and not {"kv", "prefill_kv"} & spec
    assert {"kv_dtype", "prefill_kv_dtype"} <= {f.name for f in dataclasses.fields(ps.QuantConfig)}
    for path in sorted((ROOT / "configs" / "quant").glob("*.yaml")):
        assert {"kv_dtype", "prefill_kv_dtype"} <= set(yaml.safe_load(path.read_text())), path.name
