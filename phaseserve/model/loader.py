"""Hugging Face checkpoint loading: ``config.json`` plus single or sharded safetensors, in the hub's own
tensor naming (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), into a :class:`Params` pytree.

Every parameter leaf of :func:`abstract_params` names the HF tensor(s) it comes from (routed experts
are stacked from their per-expert tensors; ``nn.Linear`` weights are transposed to ``[in, out]``). A missing
tensor, an unexpected one or a shape mismatch raises a :class:`CheckpointError` subclass naming it.
Tensors of layers beyond ``num_hidden_layers`` (DeepSeek-V3/GLM multi-token-prediction layers) and
rotary ``inv_freq`` buffers are ignored, as transformers ignores them; a multimodal wrapper's vision tensors are
not read. Any other tensor no leaf consumed is an error naming it (``strict=True``, the default), or is skipped
and listed in a :class:`SkippedTensorsWarning` (``strict=False``).

What would load silently wrong, hang, exhaust memory or escape as a parser's own exception is refused with a
:class:`CheckpointError` subclass naming the file, tensor or ``config.json`` field. ``config.json`` and the index
are read only if they are regular files of bounded size (a FIFO or a link to ``/dev/zero`` is refused by ``fstat``
before a byte is read) and must be valid JSON without NaN; a ``weight_map`` entry must be a relative path without
``..`` (links inside the directory are followed, as the hub cache needs); every shard must be a regular file and a
readable safetensors file. ``config.json``'s sizes must be integers in range and are checked against the tensor
headers (layers, embedding shape, experts) before any parameter tree is built. A float weight must be stored as a
float (not an integer or bool) and be finite once cast to the load dtype (:class:`CorruptTensorError` names the
tensor and its first bad element, in HF layout).

This module reads plain (float) checkpoints; :mod:`phaseserve.quant.loader` plugs the quantized formats into
:func:`read_checkpoint`'s reader hook and is the public ``phaseserve.load_checkpoint``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import warnings
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from phaseserve.config import ConfigError, ModelConfig, UnsupportedArchitectureError, canonical_dtype, to_dtype
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


class CheckpointConfigError(CheckpointError, ConfigError):
    """``config.json`` (or its ``quantization_config``) is malformed, lacks a field, holds a value out of range, or
    disagrees with the tensor headers; the message names the field. Also a :class:`ConfigError`."""


class CheckpointArchitectureError(CheckpointConfigError, UnsupportedArchitectureError):
    """``config.json`` names an architecture phaseserve does not implement."""


class MalformedCheckpointError(CheckpointError):
    """A file of the checkpoint cannot be parsed: JSON that is not valid, a truncated or corrupt safetensors file."""


class UnsafePathError(CheckpointError):
    """The index names a file outside the checkpoint directory, or a file the loader would read is not a regular
    file (a FIFO, a device, a directory): refused before it is opened for reading."""


class TensorDtypeError(CheckpointError):
    """A tensor is stored in a dtype its role does not allow (an integer or bool tensor where floats are read)."""


class CorruptTensorError(CheckpointError):
    """A tensor's values cannot be right: NaN or Inf weights, scales that are not finite and positive, NaN FP8
    bytes. The message names the tensor and its first bad element."""


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


# safetensors dtypes -> numpy (with ml_dtypes): tensors of these are read from the file's bytes (little-endian), at
# the offsets of the header safetensors validated when it opened the file; any other dtype goes through safetensors.
_RAW_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
               "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
               "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
               "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
               "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
               "BOOL": np.dtype(np.bool_)}
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})  # what a float weight may be stored as
INT_DTYPES = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})
_LM_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # config.json and the index (a 1T-parameter model's index is a few MB)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _refuse_irregular(path: Path, st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a regular file ({_file_kind(st.st_mode)}); refused unread")


def read_json_file(path: Path, what: str) -> Any:
    """A small JSON file of the checkpoint (``config.json``, the index): opened without blocking (a FIFO's open
    would wait for a writer), refused unless ``fstat`` says it is a regular file of at most ``MAX_JSON_BYTES``,
    parsed with NaN / Infinity refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise MalformedCheckpointError(f"{what} {path} cannot be opened: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        _refuse_irregular(path, st, what)
        if st.st_size > MAX_JSON_BYTES:
            raise MalformedCheckpointError(f"{what} {path} is {st.st_size} bytes (more than {MAX_JSON_BYTES})")
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_JSON_BYTES:
                raise MalformedCheckpointError(f"{what} {path} is longer than {MAX_JSON_BYTES} bytes")
    finally:
        os.close(fd)

    def no_constant(c: str):
        raise MalformedCheckpointError(f"{what} {path} contains {c}: a non-finite number is not a valid value")

    try:
        return json.loads(b"".join(chunks).decode("utf-8"), parse_constant=no_constant)
    except CheckpointError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedCheckpointError(f"{what} {path} is not valid JSON: {e}") from e


def _inside(fname: Any) -> bool:
    """A ``weight_map`` file name that stays inside the checkpoint directory: relative, no ``..``, no drive."""
    if not isinstance(fname, str) or not fname or "\x00" in fname or "\\" in fname:
        return False
    p = PurePosixPath(fname)
    return not p.is_absolute() and ".." not in p.parts and not PureWindowsPath(fname).drive


class TensorStore:
    """Lazy access to the tensors of one HF checkpoint directory (single file or sharded index).

    Names are *logical*: a multimodal wrapper's ``language_model.`` prefix (Kimi K2.5/K2.6
    ``KimiK25ForConditionalGeneration``) is dropped and its vision tensors (``vision_tower.``, ``mm_projector.``,
    ``multi_modal_projector.``) are listed in :attr:`vision` and never read. Opening reads only the index or the
    files' headers; every file is checked (inside the directory, regular, a valid safetensors file) before use."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (offset of its data, its header)
        index = self.dir / INDEX_FILE
        if os.path.lexists(index):
            doc = read_json_file(index, "index")
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict):
                raise MalformedCheckpointError(f"index {index} has no weight_map object")
            for n, f in weight_map.items():
                if not isinstance(f, str):
                    raise MalformedCheckpointError(f"index {index} maps tensor {n!r} to {f!r}, not a file name")
                if not _inside(f):
                    raise UnsafePathError(f"index {index} maps tensor {n!r} to {f!r}, a path outside the checkpoint "
                                          f"directory (file names must be relative, without '..')")
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                weight_map.update(dict.fromkeys(self._open(f.name).keys(), f.name))
        self.weight_map: dict[str, str] = {}  # logical name -> file
        self.file_name: dict[str, str] = {}  # logical name -> name in the file
        self.vision: list[str] = []
        for n, f in weight_map.items():
            if n.startswith(_VISION_PREFIXES):
                self.vision.append(n)
                continue
            logical = n[len(_LM_PREFIX):] if n.startswith(_LM_PREFIX) else n
            self.weight_map[logical], self.file_name[logical] = f, n

    def _open(self, fname: str, tensor: str | None = None):
        """The safetensors handle of ``fname``: ``stat`` first (a FIFO or device is refused unopened)."""
        if fname not in self._handles:
            path = self.dir / fname
            try:
                st = os.stat(path)  # follows links: the hub cache's links to regular blobs are fine
            except FileNotFoundError:
                who = f", which the index names for tensor {tensor!r}" if tensor else ""
                raise MissingTensorError(f"checkpoint {self.dir} lacks file {fname!r}{who}") from None
            except OSError as e:
                raise MalformedCheckpointError(f"{path} cannot be read: {e.strerror or e}") from e
            _refuse_irregular(path, st, "tensor file")
            try:
                self._handles[fname] = safe_open(path, "flax")
            except (SafetensorError, OSError) as e:
                raise MalformedCheckpointError(f"{path} is not a readable safetensors file: {e}") from e
        return self._handles[fname]

    def _handle(self, name: str):
        return self._open(self.weight_map[name], name)

    def _slice(self, name: str):
        try:
            return self._handle(name).get_slice(self.file_name[name])
        except SafetensorError as e:
            raise MissingTensorError(f"the index maps tensor {self.file_name[name]!r} to {self.weight_map[name]!r}, "
                                     f"which does not hold it ({e})") from e

    def names(self) -> set[str]:
        return set(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string: ``BF16``, ``F32``, ``F8_E4M3``, ``I32``, ..."""
        return self._slice(name).get_dtype()

    def _header(self, fname: str) -> tuple[int, dict]:
        """The JSON header of a file already opened (so validated) by safetensors; read once per file."""
        if fname not in self._headers:
            path = self.dir / fname
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    if n > MAX_HEADER_BYTES:
                        raise MalformedCheckpointError(f"{path}: safetensors header of {n} bytes")
                    self._headers[fname] = 8 + n, json.loads(f.read(n))
            except (OSError, ValueError) as e:
                raise MalformedCheckpointError(f"{path} is not a readable safetensors file: {e}") from e
        return self._headers[fname]

    def get(self, name: str) -> np.ndarray:
        """Host numpy array: bf16 and the float8 types (``F8_E4M3``, ``F8_E5M2``, ``F8_E8M0``) as ml_dtypes.
        Read from the file's bytes (safetensors' numpy reader decodes neither bf16 nor float8, and its flax reader
        costs a few JAX dispatches per tensor)."""
        dtype = self.dtype(name)
        if dtype not in _RAW_DTYPES:
            try:
                with jax.default_device(jax.devices("cpu")[0]):
                    return np.asarray(self._handle(name).get_tensor(self.file_name[name]))
            except SafetensorError as e:
                raise MalformedCheckpointError(f"tensor {name!r} cannot be read: {e}") from e
        fname = self.weight_map[name]
        base, header = self._header(fname)
        meta = header[self.file_name[name]]
        start, end = meta["data_offsets"]
        raw = np.fromfile(self.dir / fname, np.uint8, count=end - start, offset=base + start)
        return raw.view(_RAW_DTYPES[dtype]).reshape(meta["shape"])  # dtype[*shape]


# ---- config.json: read, checked field by field, then against the tensor headers --------------------------------
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")  # ints >= 1
_SIZES = ("intermediate_size", "num_key_value_heads", "head_dim", "moe_intermediate_size", "n_routed_experts",
          "num_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
          "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
          "moe_layer_freq", "decoder_sparse_step", "max_position_embeddings", "index_topk", "index_n_heads",
          "index_head_dim", "index_topk_freq")  # ints >= 0 when present and not null
_OBJECTS = ("rope_scaling", "rope_parameters", "quantization_config", "text_config")  # objects or null
_MAX_SIZE = 1 << 40  # far beyond any real dimension; anything larger is refused before it is used
_EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _int_field(hf: dict, key: str, minimum: int) -> None:
    v = hf[key]
    ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if not ok or not minimum <= v <= _MAX_SIZE:
        raise CheckpointConfigError(f"config.json field {key}={v!r}: expected an integer from {minimum} to "
                                    f"{_MAX_SIZE}")


def text_config(hf: Any) -> dict:
    """Check ``config.json``'s object: the types and ranges of the fields the loader sizes arrays by. Returns the
    dict the model is described by (a multimodal wrapper's ``text_config``, as ``ModelConfig.from_hf_config``)."""
    if not isinstance(hf, dict):
        raise CheckpointConfigError(f"config.json holds a JSON {type(hf).__name__}, not an object")
    text = hf
    for d in (hf, hf.get("text_config") if "text_config" in hf and not hf.get("hidden_size") else None):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise CheckpointConfigError(f"config.json field text_config is of type {type(d).__name__}, not an object")
        for key in _OBJECTS:
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise CheckpointConfigError(f"config.json field {key} is of type {type(d[key]).__name__}, not an "
                                            "object")
        text = d
    for key in _REQUIRED:
        if text.get(key) is None:
            raise CheckpointConfigError(f"config.json lacks the field {key!r}" if key not in text
                                        else f"config.json field {key} is null")
        _int_field(text, key, 1)
    for key in _SIZES:
        if text.get(key) is not None:
            _int_field(text, key, 0)
    return text


def check_against_headers(text: dict, store: TensorStore) -> None:
    """The sizes that scale the parameter tree, checked against the tensor names and the embedding's header (no
    tensor data read) before the model config or the tree is built: ``num_hidden_layers``, ``vocab_size``,
    ``hidden_size``."""
    names = store.names()
    layers = {int(m.group(1)) for n in names if (m := _LAYER_RE.match(n))}
    n = int(text["num_hidden_layers"])
    if n > len(layers) or not all(i in layers for i in range(n)):
        first = next(i for i in range(len(layers) + 1) if i not in layers)
        raise CheckpointConfigError(f"config.json num_hidden_layers={n}, but the checkpoint's tensors hold "
                                    f"{len(layers)} layers (none of layer {first})")
    embed = "model.embed_tokens.weight"
    if embed in store:
        shape = store.shape(embed)
        for i, key in enumerate(("vocab_size", "hidden_size")):
            if len(shape) != 2 or shape[i] != int(text[key]):
                raise CheckpointConfigError(f"config.json {key}={text[key]}, but tensor {embed!r} [vocab_size, "
                                            f"hidden_size] has shape {shape}")


def check_experts(cfg: ModelConfig, text: dict, store: TensorStore) -> None:
    """The routed-expert count against the expert tensors' names (before the tree lists one name per expert)."""
    if not any(cfg.moe_layers):
        return
    held = {int(m.group(1)) for n in store.names() if (m := _EXPERT_RE.match(n))}
    if cfg.num_experts > len(held):
        key = next((k for k in _EXPERT_FIELDS if text.get(k)), "n_routed_experts")
        raise CheckpointConfigError(f"config.json {key}={cfg.num_experts}, but the checkpoint's tensors hold "
                                    f"{len(held)} routed experts")


def read_hf_config(directory: str | Path) -> dict:
    """``config.json`` as a dict, checked by :func:`text_config` (a NotACheckpointError if there is none)."""
    path = Path(directory) / "config.json"
    if not path.exists():
        why = "no such directory" if not Path(directory).is_dir() else "it has no config.json"
        raise NotACheckpointError(f"{directory} is not a checkpoint directory ({why}); expected a Hugging Face "
                                  f"model directory with config.json and *.safetensors")
    hf = read_json_file(path, "config")
    text_config(hf)
    return hf


def model_config(hf: dict) -> ModelConfig:
    """``ModelConfig.from_hf_config`` with its failures as :class:`CheckpointConfigError` naming the field."""
    try:
        return ModelConfig.from_hf_config(hf)
    except UnsupportedArchitectureError as e:
        raise CheckpointArchitectureError(str(e)) from e
    except ConfigError as e:
        raise CheckpointConfigError(f"config.json: {e}") from e
    except KeyError as e:
        raise CheckpointConfigError(f"config.json lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError, IndexError) as e:
        raise CheckpointConfigError(f"config.json has a value of the wrong kind ({type(e).__name__}: {e})") from e


def read_config(directory: str | Path) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, config.json dict)``, every failure a :class:`CheckpointError` (not checked against the
    tensors: :func:`read_checkpoint` does that before it builds the config)."""
    hf = read_hf_config(directory)
    return model_config(hf), hf


def quantization_config(hf: dict) -> dict:
    """``config.json``'s ``quantization_config`` (a multimodal wrapper may keep it in ``text_config``); {} if none."""
    inner = hf.get("text_config")
    qcfg = hf.get("quantization_config") or (inner.get("quantization_config") if isinstance(inner, dict) else None)
    if qcfg is not None and not isinstance(qcfg, dict):
        raise CheckpointConfigError(f"config.json field quantization_config is of type {type(qcfg).__name__}, not "
                                    "an object")
    return qcfg or {}


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
        dtype = store.dtype(n)
        if dtype.startswith("F8"):
            raise QuantizedCheckpointError(f"tensor {n!r} is {dtype}: a quantized weight, which this "
                                           f"reader does not dequantize; load the checkpoint with "
                                           f"phaseserve.load_checkpoint")
        if dtype not in FLOAT_DTYPES:
            raise TensorDtypeError(f"tensor {n!r} is {dtype}: a float weight (F32, F16 or BF16) is expected, not an "
                                   "integer or bool tensor")
        a = store.get(n)
        arrays.append(a.T if transpose else a)
    return (np.stack(arrays) if len(names) > 1 else arrays[0]), set(names)


class SkippedTensorsWarning(UserWarning):
    """``strict=False``: the checkpoint had tensors the loader did not use (listed in ``.names``)."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names


def read_checkpoint(path: str | Path, dtype: str = "float32", reader: LeafReader = read_plain, *,
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
    hf = read_hf_config(path)
    qcfg = quantization_config(hf)
    if qcfg and reader is read_plain:
        raise QuantizedCheckpointError(f"{path} declares quantization_config (quant_method "
                                       f"{qcfg.get('quant_method')!r}): load it with phaseserve.load_checkpoint")
    store = TensorStore(Path(path))
    text = text_config(hf)
    check_against_headers(text, store)  # before anything is sized by config.json
    cfg = model_config(hf)
    check_experts(cfg, text, store)
    abstract = abstract_params(cfg, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_info)
    used: set[str] = set()
    leaves = []
    for kp, info in flat:
        names, transpose = hf_sources(leaf_path(kp), info)
        arr, consumed = reader(store, names, transpose, info, qcfg)
        used |= consumed
        if isinstance(arr, np.ndarray):
            with np.errstate(over="ignore"):  # an overflow to Inf is reported by check_finite, naming the tensor
                cast = arr.astype(to_dtype(info.dtype), copy=False)
            arr = jnp.asarray(check_finite(cast, arr, names, transpose))
        leaves.append(arr)
    extra = sorted(n for n in store.names() - used if not _ignorable(n, cfg))
    if extra and strict:
        raise UnexpectedTensorError(f"checkpoint {path} has unexpected tensor {extra[0]!r}{_hint(extra[0])}"
                                    + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                                    + "; strict=False skips unused tensors and lists them")
    if extra:
        warnings.warn(SkippedTensorsWarning(f"checkpoint {path}: skipped {len(extra)} unused tensors: "
                                            + ", ".join(extra), extra), stacklevel=2)
    return cfg, jax.tree.unflatten(treedef, leaves)


def check_finite(x: np.ndarray, stored: np.ndarray, names: list[str], transpose: bool) -> np.ndarray:
    """``x`` (a leaf as loaded, from ``stored``: one tensor, or one per expert stacked on axis 0), refused with a
    :class:`CorruptTensorError` naming the tensor and its first NaN / Inf element in HF layout (a finite stored value
    that overflows the load dtype, e.g. float16, is named as such). One ``isfinite`` pass per leaf."""
    if np.isfinite(x).all():
        return x
    bad = np.argwhere(~np.isfinite(x))
    first = tuple(int(i) for i in bad[0])
    name, at = (names[first[0]], first[1:]) if len(names) > 1 else (names[0], first)
    at = at[::-1] if transpose else at
    value = stored[first]
    why = (f"the stored value {float(value):g} overflows {x.dtype}" if np.isfinite(value)
           else f"stored as {float(value)}")
    raise CorruptTensorError(f"tensor {name!r} has {len(bad)} value(s) that are NaN or Inf when loaded as {x.dtype} "
                             f"(first at {at}: {why})")


def _hint(name: str) -> str:
    if name.endswith(("weight_scale", "weight_scale_inv")):
        return " (a scale beside a weight that is not stored quantized, e.g. a BF16 weight: it was not applied)"
    return ""


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    if _IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= cfg.num_layers
