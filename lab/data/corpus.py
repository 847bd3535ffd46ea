"""Training text: the Python standard library's own source (available offline on every machine), and the
seeded mixture of that text with tool-call examples that the default model is trained on.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` in sorted order, without test suites,
``site-packages`` and demo/tool directories. A file is held out when the SHA-1 of its relative path is
0 mod 20 (about 5% of files), so the split is stable without a stored list. The file set depends on the
Python minor version; the split rule does not.

Each file becomes ``<bos> bytes <eos>`` in one long token stream per split.

:class:`Mixture` draws training batches: each row is, with probability ``tool_fraction``, a pack of
consecutive tool-call examples (padded with ``<pad>``), otherwise a random window of the text stream.
Batch ``step`` depends only on ``(seed, step)``, so a resumed run sees exactly the batches it would have. Tool
rows can weight the answer above the request (:class:`Mixture`), so the loss concentrates on copying arguments.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import iter_examples

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip",
              "__pycache__", "tkinter", "pydoc_data", "Tools"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of_file(relpath: str) -> str:
    """``"heldout"`` for about 5% of files (by SHA-1 of the relative path), else ``"train"``."""
    return "heldout" if int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % 20 == 0 else "train"


def stdlib_files(split: str = "train", root: Path | None = None) -> list[Path]:
    """Sorted source files of one split (``"train"``, ``"heldout"`` or ``"all"``)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if split == "all" or split_of_file(rel.as_posix()) == split:
            out.append(p)
    if not out:
        raise FileNotFoundError(f"no standard-library sources under {root}")
    return out


@lru_cache(maxsize=4)
def text_stream(split: str = "train") -> np.ndarray:
    """i32[N]: every file of the split as ``<bos> bytes <eos>``, concatenated (cached per process)."""
    tok = ByteTokenizer()
    parts = []
    for p in stdlib_files(split):
        data = p.read_bytes()
        parts += [np.array([tok.bos_id], np.int32), np.frombuffer(data, np.uint8).astype(np.int32),
                  np.array([tok.eos_id], np.int32)]
    return np.concatenate(parts)


def eval_windows(split: str = "heldout", seq_len: int = 256, num: int = 64) -> np.ndarray:
    """i32[num, seq_len + 1]: evenly spaced windows of a split's stream (inputs are ``[:, :-1]``, targets
    ``[:, 1:]``), the fixed text the perplexity of a model is reported on."""
    stream = text_stream(split)
    starts = np.linspace(0, len(stream) - seq_len - 2, num).astype(np.int64)
    return np.stack([stream[s: s + seq_len + 1] for s in starts])


class Peekable:
    """An iterator of token lists with one item of look-ahead (what :func:`pack_examples` consumes)."""

    def __init__(self, it):
        self._it, self._head = iter(it), None

    def peek(self) -> list[int]:
        if self._head is None:
            self._head = next(self._it)
        return self._head

    def __next__(self) -> list[int]:
        head = self.peek()
        self._head = None
        return head


def pack_examples(examples: Peekable, seq_len: int, tok: ByteTokenizer) -> np.ndarray:
    """i32[seq_len + 1]: whole examples until the next one does not fit, then ``<pad>``.

    A first example longer than the row is cut (never happens with the shipped templates at seq_len >= 192).
    """
    row = np.full(seq_len + 1, tok.pad_id, np.int32)
    pos = 0
    while pos < seq_len + 1:
        ids = examples.peek()
        if pos and pos + len(ids) > seq_len + 1:
            break
        ids = ids[: seq_len + 1 - pos]
        row[pos: pos + len(ids)] = ids
        pos += len(ids)
        next(examples)
    return row


def answer_mask(tokens: np.ndarray, tok: ByteTokenizer) -> np.ndarray:
    """bool[..., T]: the tokens of answers, ``<tool_call>`` through its ``<eos>`` (inclusive). tokens i32[..., T]."""
    starts = np.cumsum(tokens == tok.tool_start_id, axis=-1)
    ends_before = np.cumsum(tokens == tok.eos_id, axis=-1) - (tokens == tok.eos_id)
    return (starts - np.minimum(ends_before, starts)) > 0 if tokens.size else np.zeros(tokens.shape, bool)


@dataclass
class Mixture:
    """Seeded training batches of text windows and packed tool-call examples (see module docstring).

    The loss weight of a target is 1 in text rows; in tool rows ``answer_weight`` for answer tokens
    (``<tool_call>`` .. ``<eos>``, where arguments are copied) and ``prompt_weight`` for the requests (random
    words, not worth predicting); 0 where the target is ``<pad>``."""

    batch_size: int = 16
    seq_len: int = 256
    tool_fraction: float = 0.3
    seed: int = 0
    tool_mix: str = "basic"  # phaseserve.data.toolcalls.MIXES
    answer_weight: float = 1.0
    prompt_weight: float = 1.0
    tok: ByteTokenizer = ByteTokenizer()

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens i32[B, T + 1], loss weights f32[B, T]) for one step."""
        rng = np.random.default_rng([self.seed, step])
        stream = text_stream("train")
        is_tool = rng.random(self.batch_size) < self.tool_fraction
        tools = Peekable(ex.ids(self.tok) for ex in iter_examples("train", seed=int(rng.integers(2**31)),
                                                                   mix=self.tool_mix))
        rows = []
        for t in is_tool:
            if t:
                rows.append(pack_examples(tools, self.seq_len, self.tok))
            else:
                s = int(rng.integers(0, len(stream) - self.seq_len - 1))
                rows.append(stream[s: s + self.seq_len + 1])
        tokens = np.stack(rows).astype(np.int32)
        targets = tokens[:, 1:]
        tool_w = np.where(answer_mask(targets, self.tok), self.answer_weight, self.prompt_weight)
        weights = np.where(is_tool[:, None], tool_w, 1.0) * (targets != self.tok.pad_id)
        return tokens, weights.astype(np.float32)
