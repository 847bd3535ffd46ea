"""Checkpoints that would load silently wrong, escape as an untyped error, hang or exhaust memory are refused with
a :class:`~phaseserve.model.loader.CheckpointError` naming the tensor, file or ``config.json`` field (issue 42,
item 3).

Every case starts from one tiny random transformers DeepSeek-V3 (MLA + MoE, ``tests.parity.hf_models``) written by
``save_pretrained`` and changes one thing: a scale or weight value, a tensor's dtype, an index entry, a file's
kind, a config field, or bytes of ``config.json`` / a safetensors header. Quantized variants are written here
with torch + safetensors (FP8 block scales as DeepSeek-V3 stores them; INT4 as compressed-tensors packs it), never
by phaseserve. Clean variants are loaded too, so a refusal is the changed thing's doing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import phaseserve as ps
from phaseserve.model import loader as plain_loader
from phaseserve.model.loader import (
    CheckpointConfigError,
    CheckpointError,
    CorruptTensorError,
    TensorDtypeError,
    UnsafePathError,
)
from tests.parity.hf_models import build
from tests.unit.quant_writers import pack_int32

WO = "model.layers.0.self_attn.o_proj.weight"  # HF [out 32, in 48]
NORM = "model.norm.weight"  # [32]
EMBED = "model.embed_tokens.weight"  # [96, 32]
DOWN5 = "model.layers.1.mlp.experts.5.down_proj.weight"  # [32, 16], one of 8 stacked experts
FP8_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT4_CFG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 16}}}}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("safety") / "base"
    build("deepseek_v3_grouped", d)
    return d


def variant(hf: Path, dst: Path, edit=None, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of the base checkpoint with ``edit(tensors)`` applied to its torch tensors and ``config`` merged into
    (``drop`` removed from) its ``config.json``."""
    dst.mkdir(parents=True)
    hf_cfg = json.loads((hf / "config.json").read_text())
    hf_cfg.update(config or {})
    for k in drop:
        hf_cfg.pop(k)
    (dst / "config.json").write_text(json.dumps(hf_cfg))
    tensors = load_file(str(hf / "model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def fp8_wo(scale: float | torch.Tensor = 0.01, nan_byte: int | None = None):
    """``WO`` as DeepSeek-V3 block FP8 (one 128x128 block covers it: ``weight_scale_inv`` [1, 1])."""
    def edit(t):
        q = (torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * 60).to(torch.float8_e4m3fn)
        if nan_byte is not None:
            q.view(torch.uint8)[3, 7] = nan_byte
        t[WO] = q
        t[WO + "_scale_inv"] = scale if isinstance(scale, torch.Tensor) else torch.tensor([[scale]])
    return edit


def int4_wo(scale_value: float | None = None):
    """``WO`` as compressed-tensors pack-quantized INT4, groups of 16 (``weight_scale`` bf16 [32, 3])."""
    def edit(t):
        g = torch.Generator().manual_seed(2)
        q = torch.randint(-8, 8, (32, 48), generator=g, dtype=torch.int8)
        s = (torch.rand(32, 3, generator=g) + 0.05).to(torch.bfloat16)
        if scale_value is not None:
            s[4, 1] = scale_value
        del t[WO]
        t[WO + "_packed"], t[WO + "_scale"] = pack_int32(q), s
        t[WO + "_shape"] = torch.tensor([32, 48], dtype=torch.int32)
    return edit


def set_value(name: str, index: tuple[int, ...], value: float, dtype: torch.dtype | None = None):
    def edit(t):
        w = t[name].clone() if dtype is None else t[name].to(dtype)
        w[index] = value
        t[name] = w
    return edit


# ---- 1. scales: NaN, Inf, negative, zero ----------------------------------------------------------------------
def test_clean_fp8_and_int4_variants_load(hf, tmp_path):
    _, p = ps.load_checkpoint(variant(hf, tmp_path / "f", fp8_wo(), {"quantization_config": FP8_CFG}))
    assert type(p.layers[0].attn.wo).__name__ == "Fp8Weight"
    _, p = ps.load_checkpoint(variant(hf, tmp_path / "i", int4_wo(), {"quantization_config": INT4_CFG}))
    assert type(p.layers[0].attn.wo).__name__ == "Int4Weight"


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), -0.01, 0.0, "e8m0-nan"])
def test_fp8_scale_must_be_finite_and_positive(hf, tmp_path, scale):
    if scale == "e8m0-nan":  # F8_E8M0 (transformers' ue8m0 scales): 0xff is its NaN
        scale = torch.tensor([[255]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = variant(hf, tmp_path / "s", fp8_wo(scale), {"quantization_config": FP8_CFG})
    with pytest.raises(CorruptTensorError, match=r"o_proj\.weight_scale_inv.*finite and positive"):
        ps.load_checkpoint(d)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -0.5, 0.0])
def test_int4_scale_must_be_finite_and_positive(hf, tmp_path, scale):
    d = variant(hf, tmp_path / "s", int4_wo(scale), {"quantization_config": INT4_CFG})
    with pytest.raises(CorruptTensorError, match=r"o_proj\.weight_scale.*\(4, 1\)"):
        ps.load_checkpoint(d)


# ---- 2. NaN e4m3 bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_fp8_nan_bytes_are_refused(hf, tmp_path, byte):
    d = variant(hf, tmp_path / "b", fp8_wo(nan_byte=byte), {"quantization_config": FP8_CFG})
    with pytest.raises(CorruptTensorError, match=r"o_proj\.weight'.*NaN.*\(3, 7\)"):
        ps.load_checkpoint(d)


# ---- 3. non-finite float weights ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,index,value,dtype", [
    (WO, (1, 2), float("nan"), None), (EMBED, (5, 0), float("inf"), None), (NORM, (3,), float("nan"), torch.bfloat16),
    (WO, (0, 0), float("-inf"), torch.bfloat16), (DOWN5, (7, 3), float("nan"), torch.float16)])
def test_non_finite_weights_are_refused(hf, tmp_path, name, index, value, dtype):
    d = variant(hf, tmp_path / "w", set_value(name, index, value, dtype))
    with pytest.raises(CorruptTensorError, match=name.replace(".", r"\.") + ".*NaN or Inf"):
        ps.load_checkpoint(d)


def test_a_weight_that_overflows_the_load_dtype_is_refused(hf, tmp_path):
    """A finite float32 value past float16's range would load as Inf."""
    d = variant(hf, tmp_path / "o", set_value(WO, (2, 2), 1e6))
    ps.load_checkpoint(d, "float32")
    with pytest.raises(CorruptTensorError, match=r"o_proj\.weight.*float16"):
        ps.load_checkpoint(d, "float16")


# ---- 4. integer and bool tensors where floats are expected ----------------------------------------------------
@pytest.mark.parametrize("name,dtype", [(NORM, torch.int32), (WO, torch.int64), (NORM, torch.bool),
                                        (EMBED, torch.uint8), (DOWN5, torch.int16)])
def test_integer_and_bool_weights_are_refused(hf, tmp_path, name, dtype):
    def edit(t):
        t[name] = (t[name] * 10).to(dtype)
    with pytest.raises(TensorDtypeError, match=name.replace(".", r"\.") + ".*float"):
        ps.load_checkpoint(variant(hf, tmp_path / "i", edit))


@pytest.mark.parametrize("case", ["fp8-scale-int", "int4-scale-int", "int4-packed-float", "int4-shape-float"])
def test_quantized_tensors_of_the_wrong_dtype_are_refused(hf, tmp_path, case):
    kind, tensor, _ = case.split("-")
    base_edit = fp8_wo() if kind == "fp8" else int4_wo()
    suffix = {"scale": "_scale_inv" if kind == "fp8" else "_scale", "packed": "_packed", "shape": "_shape"}[tensor]

    def edit(t):
        base_edit(t)
        t[WO + suffix] = t[WO + suffix].to(torch.int32 if case.endswith("int") else torch.float32)
    d = variant(hf, tmp_path / "q", edit, {"quantization_config": FP8_CFG if kind == "fp8" else INT4_CFG})
    with pytest.raises(TensorDtypeError, match=r"o_proj\.weight" + suffix):
        ps.load_checkpoint(d)


# ---- 5. index entries outside the checkpoint directory --------------------------------------------------------
@pytest.mark.parametrize("where", ["../elsewhere/x.safetensors", "ABS", "sub/../../elsewhere/x.safetensors"])
def test_weight_map_entries_outside_the_directory_are_refused(hf, tmp_path, where):
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(hf / "model.safetensors", tmp_path / "elsewhere" / "x.safetensors")
    where = str(tmp_path / "elsewhere" / "x.safetensors") if where == "ABS" else where
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(hf / "config.json", d / "config.json")
    names = sorted(load_file(str(hf / "model.safetensors")))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, where)}))
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        ps.load_checkpoint(d)


def test_hub_cache_symlinks_still_load(hf, tmp_path):
    """The hub cache keeps a snapshot's files as symlinks into ``../../blobs``: links to regular files are followed."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(hf / f, blobs / f"sha-{f}")
        (snap / f).symlink_to(Path("../../blobs") / f"sha-{f}")
    cfg, _ = ps.load_checkpoint(snap)
    assert cfg.num_layers == 3


# ---- 6. files that are not regular files: refused before they are opened (no hang, no endless read) ----------
_LOADER = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # an endless read ends in MemoryError, not the box's
    import phaseserve as ps
    for d in sys.argv[1:]:
        try:
            ps.load_checkpoint(d)
            print(d, "LOADED", flush=True)
        except Exception as e:
            why = str(e).replace(chr(10), " ")[:200]
            print(d, type(e).__name__, isinstance(e, ps.CheckpointError), why, flush=True)
""")


def test_non_regular_files_are_refused_without_reading_them(hf, tmp_path):
    """An index or shard that is a link to ``/dev/zero`` or ``/dev/null``, a FIFO or a directory: each is refused
    by ``stat`` before any read (a FIFO's open blocks forever; ``/dev/zero`` is read until memory runs out)."""
    names = sorted(load_file(str(hf / "model.safetensors")))
    cases = {}

    def case(name: str, make) -> None:
        d = tmp_path / name
        d.mkdir()
        shutil.copy(hf / "config.json", d / "config.json")
        make(d)
        cases[name] = d

    index = json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")})
    case("index-dev-zero", lambda d: (d / "model.safetensors.index.json").symlink_to("/dev/zero"))
    case("index-fifo", lambda d: os.mkfifo(d / "model.safetensors.index.json"))
    case("shard-fifo", lambda d: ((d / "model.safetensors.index.json").write_text(index),
                                  os.mkfifo(d / "model.safetensors")))
    case("shard-dev-zero", lambda d: ((d / "model.safetensors.index.json").write_text(index),
                                      (d / "model.safetensors").symlink_to("/dev/zero")))
    case("single-dev-null", lambda d: (d / "model.safetensors").symlink_to("/dev/null"))
    case("single-directory", lambda d: (d / "model.safetensors").mkdir())
    case("config-fifo", lambda d: ((d / "config.json").unlink(), os.mkfifo(d / "config.json"),
                                   shutil.copy(hf / "model.safetensors", d / "model.safetensors")))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _LOADER, *map(str, cases.values())], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = {Path(line.split()[0]).name: line for line in out.stdout.splitlines() if line.startswith(str(tmp_path))}
    assert set(lines) == set(cases), out.stdout + out.stderr[-2000:]
    for line in lines.values():
        assert line.split()[1:3] == ["UnsafePathError", "True"] and "not a regular file" in line, line


# ---- 7. absurd configs: checked against the tensor headers before any tree is built ---------------------------
@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**6), ("hidden_size", 10**7),
                                         ("vocab_size", 10**9), ("n_routed_experts", 10**6)])
def test_absurd_config_is_refused_before_any_tree(hf, tmp_path, monkeypatch, field, value):
    d = variant(hf, tmp_path / "a", config={field: value})

    def no_tree(*a, **kw):
        raise AssertionError("abstract_params was called before config.json was checked against the tensor headers")

    monkeypatch.setattr(plain_loader, "abstract_params", no_tree)
    t = time.perf_counter()
    with pytest.raises(CheckpointConfigError, match=f"{field}={value}"):
        ps.load_checkpoint(d)
    assert time.perf_counter() - t < 5


# ---- 8. malformed inputs: each a CheckpointError, never the parser's own exception ---------------------------
def _write(rel: str, data: bytes | str):
    def make(d: Path):
        (d / rel).write_bytes(data if isinstance(data, bytes) else data.encode())
    return make


def _cfg(**kw):
    def make(d: Path):
        hf_cfg = json.loads((d / "config.json").read_text())
        for k, v in kw.items():
            if v is _DROP:
                hf_cfg.pop(k)
            else:
                hf_cfg[k] = v
        (d / "config.json").write_text(json.dumps(hf_cfg))
    return make


def _safetensors(fn):
    def make(d: Path):
        (d / "model.safetensors").write_bytes(fn((d / "model.safetensors").read_bytes()))
    return make


def _index(weight_map_fn):
    def make(d: Path):
        names = sorted(load_file(str(d / "model.safetensors")))
        body = weight_map_fn(dict.fromkeys(names, "model.safetensors"))
        (d / "model.safetensors.index.json").write_text(body if isinstance(body, str) else json.dumps(body))
    return make


def _not_in_shard(d: Path) -> None:
    """The index maps ``NORM`` to a shard that does not hold it."""
    _index(lambda wm: {"weight_map": wm})(d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors[NORM]
    save_file(tensors, str(d / "model.safetensors"))


def _int4_scalar_scale(d: Path) -> None:
    """``WO`` as INT4 with a 0-d ``weight_scale`` (a group count cannot be read from it)."""
    tensors = load_file(str(d / "model.safetensors"))
    int4_wo()(tensors)
    tensors[WO + "_scale"] = torch.tensor(0.5, dtype=torch.bfloat16)
    save_file(tensors, str(d / "model.safetensors"))
    _cfg(quantization_config=INT4_CFG)(d)


_DROP = object()
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MALFORMED = {  # name: (change, what the error must name); the comment is what escaped before
    "config-bad-json": (_write("config.json", "{"), "config.json"),  # JSONDecodeError
    "config-not-utf8": (_write("config.json", b"\xff\xfe{}"), "config.json"),  # UnicodeDecodeError
    "config-a-list": (_write("config.json", "[1, 2]"), "config.json"),  # AttributeError
    "config-lacks-layers": (_cfg(num_hidden_layers=_DROP), "num_hidden_layers"),  # KeyError
    "config-layers-a-string": (_cfg(num_hidden_layers="three"), "num_hidden_layers"),  # ValueError (int())
    "config-layers-null": (_cfg(num_hidden_layers=None), "num_hidden_layers"),  # TypeError
    "config-zero-heads": (_cfg(**_LLAMA, num_attention_heads=0, head_dim=_DROP), "num_attention_heads"),  # ZeroDiv.
    "config-lacks-mla-field": (_cfg(kv_lora_rank=_DROP), "kv_lora_rank"),  # KeyError
    "config-nan-eps": (_cfg(rms_norm_eps=float("nan")), "NaN"),  # loaded: a NaN norm epsilon
    "config-rope-scaling-a-list": (_cfg(rope_scaling=[1]), "rope_scaling"),  # TypeError
    "config-text-config-an-int": (_cfg(hidden_size=_DROP, text_config=5), "text_config"),  # TypeError
    "quant-config-a-string": (_cfg(quantization_config="fp8"), "quantization_config"),  # AttributeError
    "quant-block-zero": (_cfg(quantization_config={**FP8_CFG, "weight_block_size": [0, 128]}),
                         "weight_block_size"),  # loaded (ZeroDivisionError once an FP8 tensor is read)
    "quant-group-size-missing": (_cfg(quantization_config={**INT4_CFG, "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}, "format": "pack-quantized"}}}), "group_size"),  # KeyError
    "safetensors-truncated-header": (_safetensors(lambda b: b[:5]), "model.safetensors"),  # SafetensorError
    "safetensors-truncated-data": (_safetensors(lambda b: b[: len(b) // 2]), "model.safetensors"),  # SafetensorError
    "safetensors-header-junk": (_safetensors(lambda b: b[:8] + b"x" * 20 + b[28:]), "model.safetensors"),
    "index-bad-json": (_index(lambda wm: "{"), "index"),  # JSONDecodeError
    "index-lacks-weight-map": (_index(lambda wm: {"metadata": {}}), "weight_map"),  # KeyError
    "index-file-not-a-string": (_index(lambda wm: {"weight_map": {**wm, NORM: 5}}), NORM),  # TypeError
    "index-missing-shard": (_index(lambda wm: {"weight_map": {**wm, NORM: "nope.safetensors"}}),
                            "nope.safetensors"),  # FileNotFoundError
    "index-tensor-not-in-its-shard": (_not_in_shard, NORM),  # SafetensorError
    "int4-scale-a-scalar": (_int4_scalar_scale, WO + "_scale"),  # IndexError
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_is_a_checkpoint_error(hf, tmp_path, name):
    change, named = MALFORMED[name]
    d = tmp_path / name
    shutil.copytree(hf, d)
    change(d)
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        ps.load_checkpoint(d)


def test_config_refusals_are_checkpoint_errors_and_still_config_errors(hf, tmp_path):
    """A config.py refusal (an unknown architecture, a bad rope type) is a CheckpointError too, and callers that
    catch ``ConfigError`` / ``UnsupportedArchitectureError`` still catch it."""
    d = tmp_path / "arch"
    shutil.copytree(hf, d)
    _cfg(architectures=["MambaForCausalLM"], model_type="mamba")(d)
    with pytest.raises(CheckpointError, match="MambaForCausalLM") as e:
        ps.load_checkpoint(d)
    assert isinstance(e.value, ps.UnsupportedArchitectureError)
    d = tmp_path / "rope"
    shutil.copytree(hf, d)
    _cfg(rope_parameters={"rope_type": "dynamic-ntk", "rope_theta": 10000.0})(d)
    with pytest.raises(CheckpointConfigError, match="dynamic-ntk") as e:
        ps.load_checkpoint(d)
    assert isinstance(e.value, ps.ConfigError)


# ---- 9. properties: any byte corruption loads or is refused with a CheckpointError ----------------------------
_edits = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)


def _corrupt(data: bytes, edits, cut: int | None, limit: int) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % min(limit, len(b))] = val
    return bytes(b[:cut] if cut is not None and cut < len(b) else b)


def _loads_or_refuses(d: Path) -> None:
    try:
        _, params = ps.load_checkpoint(d)
    except CheckpointError:
        return
    import jax
    for leaf in jax.tree.leaves(params):
        assert np.isfinite(np.asarray(leaf, np.float32)).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=_edits, cut=st.none() | st.integers(0, 2000))
def test_any_config_json_corruption_loads_or_is_a_checkpoint_error(hf, edits, cut):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "c"
        shutil.copytree(hf, d)
        data = (d / "config.json").read_bytes()
        (d / "config.json").write_bytes(_corrupt(data, edits, cut, len(data)))
        _loads_or_refuses(d)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=_edits, cut=st.none() | st.integers(0, 10**5))
def test_any_safetensors_header_corruption_loads_or_is_a_checkpoint_error(hf, edits, cut):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "c"
        shutil.copytree(hf, d)
        data = (d / "model.safetensors").read_bytes()
        header = 8 + int.from_bytes(data[:8], "little")
        (d / "model.safetensors").write_bytes(_corrupt(data, edits, cut, header + 64))
        _loads_or_refuses(d)

