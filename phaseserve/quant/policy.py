"""Quantization policies: which tensor class gets which weight representation, per serving phase.

Every parameter leaf belongs to one **tensor class** (:func:`tensor_class`):

===============  ========================================================================================
class            leaves
===============  ========================================================================================
attention        q/k/v/o projections, MLA ``wq_a``/``wq_b``/``wkv_a``/``wkv_b``, DSA indexer projections
                 (and GQA biases, which stay in the base dtype)
routed_experts   ``mlp.w_gate/w_up/w_down`` of MoE layers (``[E, in, out]``)
shared_experts   ``mlp.shared.*`` of MoE layers
dense_mlp        ``mlp.w_*`` of dense layers
router           ``mlp.router`` and ``mlp.correction_bias`` (the bias always stays float32)
embeddings       ``embed``
lm_head          ``lm_head``
norms            every RMSNorm / LayerNorm weight and bias
===============  ========================================================================================

A **representation** (:class:`Rep`) is one of ``float32``, ``bfloat16`` (plain arrays), ``fp8`` (e4m3 with
128x128 block scales or per-output-channel scales, ``Fp8Weight``) and ``int4`` (symmetric, groups of 32 or
128 along the input dim, f32 or bf16 scales, ``Int4Weight``; rounding by ``rtn`` or calibrated ``gptq``).
Vectors (1-D leaves) are never quantized: they take the policy's ``base`` dtype. Embeddings, norms and the
router are consumed by the model as plain arrays, so they accept only ``float32``/``bfloat16``.

Config format. A policy is written as a string (Hydra- and CLI-friendly) or built in code:

- a preset name: ``"bfloat16"``, ``"float32"``, ``"kimi-int4"`` (routed experts INT4 g32 with bf16 scales,
  the rest bf16, as Kimi K2-Thinking/K2.5/K2.6 ship), ``"glm-fp8"`` (everything FP8 block 128 except
  embeddings, norms, router and lm head, as GLM-5-FP8 / DeepSeek-V3 ship), ``"all-fp8"``, ``"all-int4"``
  (every matmul weight incl. the lm head);
- a preset (or ``base=<dtype>``) followed by overrides: ``"kimi-int4,routed_experts=int4:g32:bf16:gptq"``,
  ``"base=float32,attention=fp8:channel,routed_experts=int4:g128"``;
- representation strings: ``float32 | bfloat16 | fp8[:b128|:b<k>x<n>|:channel] |
  int4[:g32|:g128][:f32|:bf16][:rtn|:gptq]``.

Per phase (``QuantConfig.prefill_weights`` / ``decode_weights``), :func:`phase_policy` also accepts the
short kinds ``"fp8"`` (= ``glm-fp8`` with ``QuantConfig.fp8_block``) and ``"int4"`` (= routed experts INT4
with ``QuantConfig.int4_group_size``, bf16 scales, the rest bf16 — the GLM-INT4 / Kimi layout).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from phaseserve.config import ConfigError, QuantConfig, canonical_dtype

TENSOR_CLASSES = ("attention", "routed_experts", "shared_experts", "dense_mlp", "router", "embeddings", "lm_head",
                  "norms")
PLAIN_KINDS = ("float32", "bfloat16")
KINDS = PLAIN_KINDS + ("fp8", "int4")
_PLAIN_ONLY = ("router", "embeddings", "norms")  # the model reads these as arrays (take, einsum, scale)


class PolicyError(ConfigError):
    """A quantization policy is malformed or asks for a representation a tensor cannot take."""


@dataclass(frozen=True)
class Rep:
    """One weight representation."""

    kind: str  # "float32" | "bfloat16" | "fp8" | "int4"
    group_size: int = 128  # int4: values per scale along the input dim
    scale_dtype: str = "float32"  # int4: dtype of the group scales ("float32" | "bfloat16")
    block: tuple[int, int] | None = (128, 128)  # fp8: (in, out) block of one scale; None = per output channel
    method: str = "rtn"  # int4: "rtn" (round to nearest) | "gptq" (calibrated, needs activations)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PolicyError(f"unknown representation {self.kind!r}; expected one of {KINDS}")
        if self.kind == "int4":
            if self.group_size <= 0 or self.group_size % 2:
                raise PolicyError(f"int4 group size must be a positive even number, got {self.group_size}")
            if self.method not in ("rtn", "gptq"):
                raise PolicyError(f"int4 method must be 'rtn' or 'gptq', got {self.method!r}")
            object.__setattr__(self, "scale_dtype", canonical_dtype(self.scale_dtype))
        if self.block is not None:
            object.__setattr__(self, "block", tuple(int(b) for b in self.block))

    @property
    def quantized(self) -> bool:
        return self.kind in ("fp8", "int4")

    @classmethod
    def parse(cls, text: str) -> Rep:
        """``"int4:g32:bf16:gptq"`` / ``"fp8:channel"`` / ``"bf16"`` -> :class:`Rep`."""
        head, *opts = [t.strip() for t in str(text).strip().lower().split(":")]
        if head in ("fp8", "int4"):
            kw: dict = {}
            for o in opts:
                if head == "int4" and re.fullmatch(r"g\d+", o):
                    kw["group_size"] = int(o[1:])
                elif head == "int4" and o in ("f32", "float32", "bf16", "bfloat16"):
                    kw["scale_dtype"] = canonical_dtype(o)
                elif head == "int4" and o in ("rtn", "gptq"):
                    kw["method"] = o
                elif head == "fp8" and o == "channel":
                    kw["block"] = None
                elif head == "fp8" and re.fullmatch(r"b\d+(x\d+)?", o):
                    sizes = [int(s) for s in o[1:].split("x")]
                    kw["block"] = (sizes[0], sizes[-1])
                else:
                    raise PolicyError(f"unknown option {o!r} in representation {text!r}")
            return cls(head, **kw)
        if opts:
            raise PolicyError(f"plain representation {text!r} takes no options")
        try:
            return cls(canonical_dtype(head))
        except ConfigError as e:
            raise PolicyError(f"unknown representation {text!r}") from e

    def __str__(self) -> str:
        if self.kind == "int4":
            sd = "bf16" if self.scale_dtype == "bfloat16" else "f32"
            return f"int4:g{self.group_size}:{sd}:{self.method}"
        if self.kind == "fp8":
            return "fp8:channel" if self.block is None else f"fp8:b{self.block[0]}x{self.block[1]}"
        return self.kind


@dataclass(frozen=True)
class QuantPolicy:
    """Representation per tensor class; ``None`` means the plain ``base`` dtype."""

    name: str = "custom"
    base: str = "bfloat16"  # dtype of every leaf a class does not quantize, and of all vectors
    attention: Rep | None = None
    routed_experts: Rep | None = None
    shared_experts: Rep | None = None
    dense_mlp: Rep | None = None
    router: Rep | None = None
    embeddings: Rep | None = None
    lm_head: Rep | None = None
    norms: Rep | None = None

    def __post_init__(self):
        object.__setattr__(self, "base", canonical_dtype(self.base))
        if self.base not in PLAIN_KINDS:
            raise PolicyError(f"base dtype must be float32 or bfloat16, got {self.base!r}")
        for cls_name in TENSOR_CLASSES:
            rep = getattr(self, cls_name)
            if isinstance(rep, str):
                rep = Rep.parse(rep)
                object.__setattr__(self, cls_name, rep)
            if rep is not None and cls_name in _PLAIN_ONLY and rep.quantized:
                raise PolicyError(f"{cls_name} must stay float32/bfloat16 (the model reads them as plain arrays), "
                                  f"got {rep}")

    def rep(self, tensor_cls: str) -> Rep:
        """The representation of a class (the base dtype where the policy leaves it unset)."""
        if tensor_cls not in TENSOR_CLASSES:
            raise PolicyError(f"unknown tensor class {tensor_cls!r}; expected one of {TENSOR_CLASSES}")
        return getattr(self, tensor_cls) or Rep(self.base)

    def replace(self, **kw) -> QuantPolicy:
        return dataclasses.replace(self, **kw)

    def with_base(self, base: str) -> QuantPolicy:
        """Same quantized classes; plain classes (and vectors) in ``base`` — e.g. float32 parity runs."""
        kw = {c: None for c in TENSOR_CLASSES if getattr(self, c) is not None and not getattr(self, c).quantized}
        return dataclasses.replace(self, base=base, **kw)

    def uses(self, method: str) -> bool:
        return any(r is not None and r.kind == "int4" and r.method == method
                   for r in (getattr(self, c) for c in TENSOR_CLASSES))

    def describe(self) -> str:
        """The string form (round-trips through :func:`resolve_policy`)."""
        parts = [f"base={self.base}"]
        parts += [f"{c}={getattr(self, c)}" for c in TENSOR_CLASSES if getattr(self, c) is not None]
        return ",".join(parts)


def _presets() -> dict[str, QuantPolicy]:
    fp8 = Rep("fp8", block=(128, 128))
    int4_g32 = Rep("int4", group_size=32, scale_dtype="bfloat16")
    int4_g128 = Rep("int4", group_size=128)
    matmuls = ("attention", "routed_experts", "shared_experts", "dense_mlp")
    return {
        "float32": QuantPolicy("float32", base="float32"),
        "bfloat16": QuantPolicy("bfloat16"),
        "kimi-int4": QuantPolicy("kimi-int4", routed_experts=int4_g32),
        "glm-fp8": QuantPolicy("glm-fp8", **{c: fp8 for c in matmuls}),
        "all-fp8": QuantPolicy("all-fp8", lm_head=fp8, **{c: fp8 for c in matmuls}),
        "all-int4": QuantPolicy("all-int4", lm_head=int4_g128, **{c: int4_g128 for c in matmuls}),
    }


PRESET_POLICIES: dict[str, QuantPolicy] = _presets()


def resolve_policy(spec: str | dict | QuantPolicy | None, base: str | None = None) -> QuantPolicy:
    """A policy from a preset name, an override string, a dict of class -> rep, or a policy.

    ``base`` (optional) replaces the plain dtype afterwards (``resolve_policy("kimi-int4", base="float32")``).
    """
    if spec is None:
        spec = "bfloat16"
    if isinstance(spec, QuantPolicy):
        pol = spec
    elif isinstance(spec, dict):
        kw = dict(spec)
        name = kw.pop("name", "custom")
        start = resolve_policy(kw.pop("preset")) if "preset" in kw else QuantPolicy(name, base=kw.pop("base", "bf16"))
        pol = _override(start, kw, name)
    else:
        items = [t.strip() for t in str(spec).split(",") if t.strip()]
        if not items:
            raise PolicyError("empty quantization policy")
        start_name = items[0] if "=" not in items[0] else None
        if start_name is not None:
            key = start_name.lower()
            key = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(key, key)
            if key not in PRESET_POLICIES:
                raise PolicyError(f"unknown quantization policy {start_name!r}; expected 'fp8' or 'int4' (the "
                                  f"QuantConfig.prefill_weights / decode_weights names), a preset "
                                  f"{sorted(PRESET_POLICIES)}, or a preset with per-class overrides such as "
                                  f"'kimi-int4,routed_experts=int4:g32'")
            start = PRESET_POLICIES[key]
            items = items[1:]
        else:
            start = QuantPolicy("custom")
        kw = {}
        for it in items:
            if "=" not in it:
                raise PolicyError(f"expected class=representation, got {it!r} in {spec!r}")
            k, v = (s.strip() for s in it.split("=", 1))
            kw[k] = v
        pol = _override(start, kw, start.name if not kw else str(spec))
    return pol.with_base(base) if base is not None else pol


def _override(start: QuantPolicy, kw: dict, name: str) -> QuantPolicy:
    upd: dict = {"name": name}
    for k, v in kw.items():
        if k == "base":
            upd["base"] = v
        elif k in TENSOR_CLASSES:
            upd[k] = v if isinstance(v, Rep) else Rep.parse(v)
        else:
            raise PolicyError(f"unknown tensor class {k!r}; expected 'base' or one of {TENSOR_CLASSES}")
    return dataclasses.replace(start, **upd)


def phase_policy(quant: QuantConfig, phase: str) -> QuantPolicy:
    """The weight policy of ``phase`` ("prefill" | "decode") from a :class:`QuantConfig`."""
    if phase not in ("prefill", "decode"):
        raise PolicyError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    spec = quant.prefill_weights if phase == "prefill" else quant.decode_weights
    if isinstance(spec, str) and spec.strip().lower() == "fp8":
        fp8 = Rep("fp8", block=quant.fp8_block)
        return QuantPolicy(f"{phase}-fp8", attention=fp8, routed_experts=fp8, shared_experts=fp8, dense_mlp=fp8)
    if isinstance(spec, str) and spec.strip().lower() == "int4":
        return QuantPolicy(f"{phase}-int4", routed_experts=Rep("int4", group_size=quant.int4_group_size,
                                                               scale_dtype="bfloat16"))
    return resolve_policy(spec)
