"""Hugging Face checkpoint loading: ``config.json`` plus single or sharded safetensors, in the hub's own
tensor naming (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), into a :class:`Params` pytree.

Every parameter leaf of :func:`abstract_params` names the HF tensor(s) it comes from (routed experts
are stacked from their per-expert tensors; ``nn.Linear`` weights are transposed to ``[in, out]``). A missing
tensor, an unexpected one or a shape mismatch raises a :class:`CheckpointError` subclass naming it.
Tensors of layers beyond ``num_hidden_layers`` (DeepSeek-V3/GLM multi-token-prediction layers) and
rotary ``inv_freq`` buffers are ignored, as transformers ignores them; a multimodal wrapper's vision tensors are
not read. Any other tensor no leaf consumed is an error naming it (``strict=True``, the default), or is skipped
and listed in a :class:`SkippedTensorsWarning` (``strict=False``).

This module reads plain (float) checkpoints; :mod:`phaseserve.quant.loader` plugs the quantized formats into
:func:`load_checkpoint`'s reader hook and is the public ``phaseserve.load_checkpoint``.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from phaseserve.config import ModelConfig, canonical_dtype, to_dtype
from phaseserve.model.params import ArrayInfo, Params, abstract_params, is_info


class CheckpointError(ValueError):
    """A checkpoint does not match the model it claims to be."""


class NotACheckpointError(CheckpointError):
    """The path is not a Hugging Face checkpoint directory (no such directory, or no ``config.json`` in it)."""


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class QuantizedCheckpointError(CheckpointError):
    """A quantized checkpoint (or tensor) given to a reader that does not decode quantized formats."""


# our leaf path (after "layers.{i}.") -> HF suffix (after "model.layers.{i}."); "T" marks nn.Linear weights.
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "attn.wq": ("self_attn.q_proj.weight", True),
    "attn.wk": ("self_attn.k_proj.weight", True),
    "attn.wv": ("self_attn.v_proj.weight", True),
    "attn.wo": ("self_attn.o_proj.weight", True),
    "attn.bq": ("self_attn.q_proj.bias", False),
    "attn.bk": ("self_attn.k_proj.bias", False),
    "attn.bv": ("self_attn.v_proj.bias", False),
    "attn.q_norm": ("self_attn.q_norm.weight", False),
    "attn.k_norm": ("self_attn.k_norm.weight", False),
    "attn.wq_a": ("self_attn.q_a_proj.weight", True),
    "attn.q_a_norm": ("self_attn.q_a_layernorm.weight", False),
    "attn.wq_b": ("self_attn.q_b_proj.weight", True),
    "attn.wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
    "attn.kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
    "attn.wkv_b": ("self_attn.kv_b_proj.weight", True),
    "attn.indexer.wq_b": ("self_attn.indexer.wq_b.weight", True),
    "attn.indexer.wk": ("self_attn.indexer.wk.weight", True),
    "attn.indexer.k_norm_w": ("self_attn.indexer.k_norm.weight", False),
    "attn.indexer.k_norm_b": ("self_attn.indexer.k_norm.bias", False),
    "attn.indexer.weights_proj": ("self_attn.indexer.weights_proj.weight", True),
    "mlp.w_gate": ("mlp.gate_proj.weight", True),
    "mlp.w_up": ("mlp.up_proj.weight", True),
    "mlp.w_down": ("mlp.down_proj.weight", True),
    "mlp.router": ("mlp.gate.weight", True),
    "mlp.correction_bias": ("mlp.gate.e_score_correction_bias", False),
    "mlp.shared.w_gate": ("mlp.shared_experts.gate_proj.weight", True),
    "mlp.shared.w_up": ("mlp.shared_experts.up_proj.weight", True),
    "mlp.shared.w_down": ("mlp.shared_experts.down_proj.weight", True),
}
_EXPERT_NAMES = {"mlp.w_gate": "gate_proj", "mlp.w_up": "up_proj", "mlp.w_down": "down_proj"}
_TOP_NAMES = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
              "lm_head": ("lm_head.weight", True)}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$)")


def leaf_path(path) -> str:
    """A jax key path -> 'layers.3.attn.wq'."""
    parts = []
    for k in path:
        parts.append(str(k.idx) if hasattr(k, "idx") else str(getattr(k, "name", getattr(k, "key", k))))
    return ".".join(parts)


def hf_sources(path: str, info: ArrayInfo) -> tuple[list[str], bool]:
    """HF tensor names a leaf is built from (several for stacked experts) and whether they are transposed."""
    if path in _TOP_NAMES:
        name, t = _TOP_NAMES[path]
        return [name], t
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
    if not m:
        raise KeyError(path)
    i, rest = m.group(1), m.group(2)
    if rest in _EXPERT_NAMES and len(info.shape) == 3:
        return [f"model.layers.{i}.mlp.experts.{e}.{_EXPERT_NAMES[rest]}.weight" for e in range(info.shape[0])], True
    name, t = _LAYER_NAMES[rest]
    return [f"model.layers.{i}.{name}"], t


# safetensors dtypes that its numpy/flax readers do not decode: read from the file's bytes with ml_dtypes.
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
               "F8_E8M0": ml_dtypes.float8_e8m0fnu}
_LM_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


class TensorStore:
    """Lazy access to the tensors of one HF checkpoint directory (single file or sharded index).

    Names are *logical*: a multimodal wrapper's ``language_model.`` prefix (Kimi K2.5/K2.6
    ``KimiK25ForConditionalGeneration``) is dropped and its vision tensors (``vision_tower.``, ``mm_projector.``,
    ``multi_modal_projector.``) are listed in :attr:`vision` and never read."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                with safe_open(f, "numpy") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self.weight_map: dict[str, str] = {}  # logical name -> file
        self.file_name: dict[str, str] = {}  # logical name -> name in the file
        self.vision: list[str] = []
        for n, f in weight_map.items():
            if n.startswith(_VISION_PREFIXES):
                self.vision.append(n)
                continue
            logical = n[len(_LM_PREFIX):] if n.startswith(_LM_PREFIX) else n
            self.weight_map[logical], self.file_name[logical] = f, n
        self._handles: dict[str, Any] = {}

    def _handle(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.dir / fname, "flax")
        return self._handles[fname]

    def _slice(self, name: str):
        return self._handle(name).get_slice(self.file_name[name])

    def names(self) -> set[str]:
        return set(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string: ``BF16``, ``F32``, ``F8_E4M3``, ``I32``, ..."""
        return self._slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        """Host numpy array: bf16 and the float8 types (``F8_E4M3``, ``F8_E5M2``, ``F8_E8M0``) as ml_dtypes.
        The float8 types, which safetensors' readers do not decode, are read from the file's bytes."""
        dtype = self.dtype(name)
        if dtype not in _RAW_DTYPES:
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(self._handle(name).get_tensor(self.file_name[name]))
        path = self.dir / self.weight_map[name]
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n))[self.file_name[name]]
        start, end = meta["data_offsets"]
        raw = np.fromfile(path, np.uint8, count=end - start, offset=8 + n + start)
        return raw.view(_RAW_DTYPES[dtype]).reshape(meta["shape"])


def read_config(directory: str | Path) -> tuple[ModelConfig, dict]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        why = "no such directory" if not Path(directory).is_dir() else "it has no config.json"
        raise NotACheckpointError(f"{directory} is not a checkpoint directory ({why}); expected a Hugging Face "
                                  f"model directory with config.json and *.safetensors")
    hf = json.loads(path.read_text())
    return ModelConfig.from_hf_config(hf), hf


def quantization_config(hf: dict) -> dict:
    """``config.json``'s ``quantization_config`` (a multimodal wrapper may keep it in ``text_config``); {} if none."""
    return hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config") or {}


# (store, HF names of the leaf, transpose?, the leaf's ArrayInfo, quantization_config) -> (leaf, tensors consumed)
LeafReader = Callable[[TensorStore, list[str], bool, ArrayInfo, dict], tuple[Any, set[str]]]


def read_plain(store: TensorStore, names: list[str], transpose: bool, info: ArrayInfo, qcfg: dict,
               ) -> tuple[np.ndarray, set[str]]:
    """Read (and stack/transpose) a leaf's tensors, checking every name, shape and dtype against ``info``."""
    expect = info.shape[1:] if len(names) > 1 else info.shape
    expect_hf = tuple(reversed(expect)) if transpose else expect
    arrays = []
    for n in names:
        if n not in store:
            raise MissingTensorError(f"checkpoint {store.dir} lacks tensor {n!r}")
        got = store.shape(n)
        if got != expect_hf:
            raise ShapeMismatchError(f"tensor {n!r} has shape {got}, expected {expect_hf}")
        if store.dtype(n).startswith("F8"):
            raise QuantizedCheckpointError(f"tensor {n!r} is {store.dtype(n)}: a quantized weight, which this "
                                           f"reader does not dequantize; load the checkpoint with "
                                           f"phaseserve.load_checkpoint")
        a = store.get(n)
        arrays.append(a.T if transpose else a)
    return (np.stack(arrays) if len(names) > 1 else arrays[0]), set(names)


class SkippedTensorsWarning(UserWarning):
    """``strict=False``: the checkpoint had tensors the loader did not use (listed in ``.names``)."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names


def load_checkpoint(path: str | Path, dtype: str = "float32", reader: LeafReader = read_plain, *,
                    strict: bool = True) -> tuple[ModelConfig, Params]:
    """Read an HF checkpoint directory into ``(cfg, params)`` with every floating leaf cast to ``dtype``
    (routers and correction biases stay float32).

    This is the reading machinery; the public loader is ``phaseserve.load_checkpoint``
    (:mod:`phaseserve.quant.loader`), which passes the reader of the quantized formats. With the default plain
    reader a checkpoint that declares a ``quantization_config`` is refused (:class:`QuantizedCheckpointError`).
    ``reader`` returns each leaf (an ``np.ndarray`` is cast to ``dtype``, anything else is kept as returned) and
    the tensors it consumed. ``strict``: a tensor nobody consumed is an :class:`UnexpectedTensorError` naming
    it; ``strict=False`` skips such tensors and lists them in a :class:`SkippedTensorsWarning`."""
    dtype = canonical_dtype(dtype)
    cfg, hf = read_config(path)
    qcfg = quantization_config(hf)
    if qcfg and reader is read_plain:
        raise QuantizedCheckpointError(f"{path} declares quantization_config (quant_method "
                                       f"{qcfg.get('quant_method')!r}): load it with phaseserve.load_checkpoint")
    store = TensorStore(Path(path))
    abstract = abstract_params(cfg, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_info)
    used: set[str] = set()
    leaves = []
    for kp, info in flat:
        names, transpose = hf_sources(leaf_path(kp), info)
        arr, consumed = reader(store, names, transpose, info, qcfg)
        used |= consumed
        leaves.append(arr if not isinstance(arr, np.ndarray) else jnp.asarray(arr.astype(to_dtype(info.dtype))))
    extra = sorted(n for n in store.names() - used if not _ignorable(n, cfg))
    if extra and strict:
        raise UnexpectedTensorError(f"checkpoint {path} has unexpected tensor {extra[0]!r}{_hint(extra[0])}"
                                    + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                                    + "; strict=False skips unused tensors and lists them")
    if extra:
        warnings.warn(SkippedTensorsWarning(f"checkpoint {path}: skipped {len(extra)} unused tensors: "
                                            + ", ".join(extra), extra), stacklevel=2)
    return cfg, jax.tree.unflatten(treedef, leaves)


def _hint(name: str) -> str:
    if name.endswith(("weight_scale", "weight_scale_inv")):
        return " (a scale beside a weight that is not stored quantized, e.g. a BF16 weight: it was not applied)"
    return ""


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    if _IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= cfg.num_layers
