"""Checkpoint size report: bytes by tensor class and representation.

The same counting rule applies to abstract trees (``ArrayInfo`` leaves, nothing allocated — real model
shapes) and to real trees (arrays): every stored array counts ``prod(shape) * itemsize`` — fp8 bytes,
packed INT4 nibbles (half a byte per value) *and* their scales. Nothing else (no file headers, no index
json). ``params`` counts logical weight values (``K * N`` for a quantized ``[K, N]`` weight, not packed bytes).

:func:`checkpoint_report` counts what a published checkpoint holds for a config and a policy, including the
multi-token-prediction (MTP) layers checkpoints ship beyond ``num_hidden_layers`` (DeepSeek-V3, GLM-4.5,
GLM-5): each is one more MoE decoder layer plus ``eh_proj`` ``[2D, D]`` (counted in the base dtype) and
three norms, and — DeepSeek-V3 only — its own copy of the embedding and output head.
:func:`preset_report` does this for the presets of ``phaseserve.presets``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from phaseserve.config import ModelConfig, to_dtype
from phaseserve.model.params import ArrayInfo, is_info
from phaseserve.qarrays import stored_arrays
from phaseserve.quant.policy import QuantPolicy, Rep, resolve_policy
from phaseserve.quant.quantize import (
    abstract_leaf,
    abstract_quantized,
    leaf_rep,
    named_leaves,
    tensor_class,
)

GIB = 2**30


@dataclass(frozen=True)
class SizeRow:
    tensor_class: str
    rep: str
    params: int  # logical weight values
    bytes: int  # stored bytes incl. scales


@dataclass(frozen=True)
class SizeReport:
    rows: tuple[SizeRow, ...]

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def total_params(self) -> int:
        return sum(r.params for r in self.rows)

    @property
    def gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def gb(self) -> float:
        return self.total_bytes / 1e9

    def by_class(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.rows:
            out[r.tensor_class] += r.bytes
        return dict(out)

    def by_rep(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.rows:
            out[r.rep] += r.bytes
        return dict(out)

    def bytes_of(self, tensor_class: str | None = None, rep: str | None = None) -> int:
        return sum(r.bytes for r in self.rows if tensor_class in (None, r.tensor_class) and rep in (None, r.rep))

    def table(self) -> str:
        """Markdown table, largest rows first, with a total."""
        lines = ["| tensor class | representation | params (B) | GiB | share |", "|---|---|---:|---:|---:|"]
        total = max(self.total_bytes, 1)
        for r in sorted(self.rows, key=lambda r: -r.bytes):
            lines.append(f"| {r.tensor_class} | {r.rep} | {r.params / 1e9:.3f} | {r.bytes / GIB:.3f} | "
                         f"{100 * r.bytes / total:.2f}% |")
        lines.append(f"| **total** | | {self.total_params / 1e9:.3f} | {self.gib:.3f} | 100% |")
        return "\n".join(lines)


def _nbytes(x: Any) -> int:
    if is_info(x):
        return math.prod(x.shape) * to_dtype(x.dtype).itemsize
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _values(x: Any) -> int:
    return int(np.prod(x.shape))  # containers report their logical shape


def size_report(tree: Any) -> SizeReport:
    """Bytes of every stored array of an abstract (ArrayInfo) or real params tree, by class and rep."""
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for path, x in named_leaves(tree):
        if x is None:
            continue
        key = (tensor_class(path, len(x.shape)), leaf_rep(x))
        fields = stored_arrays(x)
        acc[key][0] += _values(x)
        acc[key][1] += sum(_nbytes(f) for f in fields)
    return SizeReport(tuple(SizeRow(c, r, p, b) for (c, r), (p, b) in sorted(acc.items())))


def _mtp_extras(cfg: ModelConfig, policy: QuantPolicy, n: int, embed_copies: bool) -> dict:
    d, v = cfg.hidden_size, cfg.vocab_size
    extras: dict[str, Any] = {}
    for i in range(n):
        extras[f"mtp.{i}.eh_proj"] = ArrayInfo((2 * d, d), policy.base, ("embed", "embed"))
        for norm in ("enorm", "hnorm", "head_norm"):
            extras[f"mtp.{i}.{norm}"] = ArrayInfo((d,), policy.base, ("norm",), "ones")
        if embed_copies:
            extras[f"mtp.{i}.embed"] = abstract_leaf(ArrayInfo((v, d), "float32", ("vocab", "embed")),
                                                     policy.rep("embeddings"))
            extras[f"mtp.{i}.lm_head"] = abstract_leaf(ArrayInfo((d, v), "float32", ("embed", "vocab")),
                                                       policy.rep("lm_head"), "mtp.lm_head")
    return extras


def checkpoint_report(cfg: ModelConfig, policy: str | QuantPolicy, mtp_layers: int = 0,
                      mtp_embed_copies: bool = False) -> SizeReport:
    """Count (never allocate) a checkpoint of ``cfg`` in ``policy``'s representations, MTP layers included."""
    policy = resolve_policy(policy)
    full = cfg
    if mtp_layers:
        full = cfg.replace(num_layers=cfg.num_layers + mtp_layers, moe_layers=cfg.moe_layers + (True,) * mtp_layers,
                           indexer_types=cfg.indexer_types + ("full",) * mtp_layers if cfg.indexer_types else ())
    report = size_report(abstract_quantized(full, policy))
    if not mtp_layers:
        return report
    rows = {(r.tensor_class, r.rep): [r.params, r.bytes] for r in report.rows}
    for name, x in _mtp_extras(cfg, policy, mtp_layers, mtp_embed_copies).items():
        cls = "mtp" if name.endswith(("eh_proj", "norm")) else tensor_class(name.rsplit(".", 1)[-1], 2)
        key = (cls, leaf_rep(x))
        fields = stored_arrays(x)
        cur = rows.setdefault(key, [0, 0])
        cur[0] += _values(x)
        cur[1] += sum(_nbytes(f) for f in fields)
    return SizeReport(tuple(SizeRow(c, r, p, b) for (c, r), (p, b) in sorted(rows.items())))


def preset_report(name: str, policy: str | QuantPolicy) -> SizeReport:
    """:func:`checkpoint_report` of a ``phaseserve.presets`` model, with its MTP layers as it ships them."""
    from phaseserve import presets

    return checkpoint_report(presets.preset_config(name), policy, presets.mtp_layers(name),
                             presets.MTP_EMBEDDING_COPIES.get(name, False))


def rep_bytes_per_value(rep: Rep | str, k: int = 7168, n: int = 2048) -> float:
    """Stored bytes per weight value of ``rep`` for a ``[k, n]`` weight (scales included)."""
    rep = Rep.parse(rep) if isinstance(rep, str) else rep
    x = abstract_leaf(ArrayInfo((k, n), "float32", (None, None)), rep)
    fields = stored_arrays(x)
    return sum(_nbytes(f) for f in fields) / (k * n)
