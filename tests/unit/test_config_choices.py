"""Every enum-like config field accepts exactly its listed names: each listed name builds, anything else (a dtype the
pools cannot hold, a misspelt policy) is a ``ConfigError`` that names the field and the names it takes, before
anything is built. (``QuantConfig(kv_dtype="int32")`` used to be accepted, and then every request errored.)

Weight representations (``QuantConfig.prefill_weights`` / ``decode_weights``) are policy strings with their own
parser (``phaseserve.quant.policy``), checked when the engine builds its weights; not here."""

from __future__ import annotations

import dataclasses

import pytest

import phaseserve as ps
from phaseserve import config as C
from phaseserve.presets import preset

MODEL = C.ModelConfig.from_hf_config(preset("tiny-mla-moe"))

# (field, build with that value, the names it accepts)
FIELDS = [
    ("RopeConfig.kind", lambda v: C.RopeConfig(kind=v), C.ROPE_KINDS),
    ("ModelConfig.attention", lambda v: MODEL.replace(attention=v), C.ATTENTION_KINDS),
    ("ModelConfig.scoring_func", lambda v: MODEL.replace(scoring_func=v), C.SCORING_FUNCS),
    ("QuantConfig.kv_dtype", lambda v: ps.QuantConfig(kv_dtype=v), C.KV_DTYPES),
    ("QuantConfig.prefill_kv_dtype", lambda v: ps.QuantConfig(prefill_kv_dtype=v), C.PREFILL_KV_DTYPES),
    ("CacheConfig.admission", lambda v: ps.CacheConfig(admission=v), C.ADMISSIONS),
    ("CacheConfig.preemption", lambda v: ps.CacheConfig(preemption=v), C.PREEMPTIONS),
    ("ServeConfig.mode", lambda v: ps.ServeConfig(mode=v), C.SERVE_MODES),
    ("MeshConfig.replica_devices", lambda v: ps.MeshConfig(replica_devices=v), C.REPLICA_DEVICES),
]
BAD = ["", "int32", "float16", "uint8", "Reserve", "mla ", "none"]


@pytest.mark.parametrize("name,make,choices", FIELDS, ids=[f[0] for f in FIELDS])
def test_listed_names_build_and_nothing_else_does(name, make, choices):
    attr = name.split(".")[1]
    for v in choices:
        got = make(v)
        assert getattr(got, attr) == v
    for v in [b for b in BAD if b not in choices]:
        with pytest.raises(ps.ConfigError) as e:
            make(v)
        assert name in str(e.value) and all(repr(c) in str(e.value) for c in choices), str(e.value)


def test_dtype_aliases_resolve_before_the_check():
    assert ps.QuantConfig(kv_dtype="fp8", prefill_kv_dtype="bf16").kv_dtype == "fp8"
    with pytest.raises(ps.ConfigError, match="QuantConfig.prefill_kv_dtype"):
        ps.QuantConfig(prefill_kv_dtype="fp8")  # a valid dtype, but not one prefill computes KV in


def test_indexer_types_take_full_and_shared_only():
    glm = C.ModelConfig.from_hf_config({**preset("glm-5"), "num_hidden_layers": 2})
    assert glm.replace(indexer_types=("full", "shared")).indexer_types == ("full", "shared")
    for bad in (("full", "sparse"), ("shared", "full"), ("full",)):
        with pytest.raises(ps.ConfigError, match="indexer_types"):
            glm.replace(indexer_types=bad)


def test_every_str_field_with_a_fixed_set_of_names_is_listed_here():
    """A new enum-like field must join FIELDS: the str fields of the serving configs are the listed ones plus the
    weight policies (parsed elsewhere) and the free-form names."""
    free = {"ModelConfig.architecture", "QuantConfig.prefill_weights", "QuantConfig.decode_weights"}
    listed = {f[0] for f in FIELDS}
    for cls in (C.RopeConfig, C.ModelConfig, C.QuantConfig, C.CacheConfig, C.MeshConfig, C.ServeConfig):
        for f in dataclasses.fields(cls):
            if f.type in ("str", str):
                assert f"{cls.__name__}.{f.name}" in listed | free, f"{cls.__name__}.{f.name} is not checked here"
