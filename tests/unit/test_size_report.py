"""Checkpoint size report: counted from ArrayInfo trees at real shapes (nothing allocated) and measured on real
trees with one rule; the GLM-5 and Kimi K2.6 figures land within 1% of the published checkpoint sizes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lab import figures
from lab.planner.published import PUBLISHED
from phaseserve import presets
from phaseserve.model.params import abstract_params, map_infos
from phaseserve.quant import abstract_quantized, quantize_params
from phaseserve.quant.size_report import (
    GIB,
    checkpoint_report,
    preset_report,
    rep_bytes_per_value,
    size_report,
)

# (preset, policy) -> what is measured against PUBLISHED; the policies are the ones the checkpoints ship:
# GLM-5-FP8 = "glm-fp8"; GLM-5 INT4 and Kimi K2.6 = "kimi-int4" (routed experts int4 g32 bf16 scales, rest bf16).
PINNED = [("glm-5", "glm-fp8"), ("glm-5", "kimi-int4"), ("kimi-k2.6", "kimi-int4"), ("glm-5", "bfloat16")]
DECIMAL_ONLY = [("kimi-k2.6", "kimi-int4"), ("glm-5", "bfloat16")]  # Kimi 595 GB, GLM-5.2 BF16 1507 GB


@pytest.mark.parametrize("model,policy", PINNED)
def test_published_checkpoint_sizes_within_one_percent(model, policy):
    report = preset_report(model, policy)
    published = PUBLISHED[(model, policy)]
    err = report.gib / published.gib - 1  # published "GB" read as GiB: the one rule (lab.figures)
    note = published.reading_note(report.gib)
    print(f"\n[{model} / {policy}] measured {report.gib:.2f} GiB ({report.gb:.2f} GB), published {published.gib} GiB "
          f"({published.source}): {100 * err:+.2f}% {note}\n{report.table()}")
    if (model, policy) in DECIMAL_ONLY:  # reported as fitting only the decimal reading, never re-read to fit
        decimal = figures.gib(published.figure, "decimal")
        assert abs(err) > 0.05 and "fits only the decimal reading" in note and abs(report.gib / decimal - 1) < 0.01
    else:
        assert abs(err) < 0.01 and note == ""


def test_mtp_layer_is_part_of_the_published_size():
    """Without GLM-5's MTP layer (one more MoE layer) the FP8 count misses the published size by >1%."""
    cfg = presets.preset_config("glm-5")
    without = checkpoint_report(cfg, "glm-fp8", mtp_layers=0)
    with_mtp = preset_report("glm-5", "glm-fp8")
    assert without.gib < 0.99 * PUBLISHED[("glm-5", "glm-fp8")].gib
    assert 9.5e9 < with_mtp.total_params - without.total_params < 10.5e9
    assert round(without.total_params / 1e9) == 744  # GLM-5's published 744B parameters
    # DeepSeek-V3: 671B main model + MTP layer that repeats embed and head, 685B published in all.
    ds_cfg = presets.preset_config("deepseek-v3")
    assert round(checkpoint_report(ds_cfg, "glm-fp8").total_params / 1e9) == 671
    assert abs(preset_report("deepseek-v3", "glm-fp8").total_params / 685e9 - 1) < 0.005


def test_breakdown_by_class_and_representation():
    r = preset_report("kimi-k2.6", "kimi-int4")
    by_rep = r.by_rep()
    assert set(by_rep) == {"int4:g32:bf16", "bfloat16", "float32"}
    experts = r.bytes_of("routed_experts", "int4:g32:bf16")
    e, d, f = 384, 7168, 2048
    assert experts == 60 * e * 3 * d * f * (0.5 + 2 / 32)  # 60 MoE layers, 4.5 bits per value
    assert r.bytes_of("routed_experts") == experts and r.bytes_of("attention", "bfloat16") > 0
    assert r.bytes_of("router", "float32") == 60 * e * 4  # the correction bias always stays float32
    assert sum(r.by_class().values()) == r.total_bytes == sum(by_rep.values())
    assert experts / r.total_bytes > 0.95


def test_bytes_per_value_by_representation():
    assert rep_bytes_per_value("bfloat16") == 2 and rep_bytes_per_value("float32") == 4
    assert rep_bytes_per_value("int4:g32:bf16") == 0.5 + 2 / 32
    assert rep_bytes_per_value("int4:g128") == 0.5 + 4 / 128
    assert rep_bytes_per_value("fp8") == 1 + 4 / (128 * 128)
    assert rep_bytes_per_value("fp8:channel", k=7168) == 1 + 4 / 7168
    assert rep_bytes_per_value("fp8", k=100, n=100) == 1 + 4 / 100**2  # one partial block


@pytest.mark.parametrize("policy", ["bfloat16", "kimi-int4", "glm-fp8", "all-int4,attention=fp8:channel"])
def test_counted_equals_measured_on_a_real_tree(policy):
    cfg = presets.preset_config("tiny-mla-moe")
    rng = np.random.default_rng(0)
    params = map_infos(lambda i: jnp.asarray(rng.standard_normal(i.shape) + 0.5, jnp.float32), abstract_params(cfg))
    measured = size_report(quantize_params(params, policy))
    counted = size_report(abstract_quantized(cfg, policy))
    assert measured.rows == counted.rows and measured.total_bytes > 0
    stored = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax_leaves(quantize_params(params, policy)))
    assert measured.total_bytes == stored
    assert counted.total_params == sum(int(np.prod(i.shape)) for i in jax_leaves(abstract_params(cfg)))
    assert measured.gib == measured.total_bytes / GIB


def jax_leaves(tree):
    import jax

    from phaseserve.model.params import is_info

    return jax.tree.leaves(tree, is_leaf=is_info)
