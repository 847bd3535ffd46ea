"""Byte-level tokenizer of the default model: the 256 byte values plus a handful of special tokens.

Token ids::

    0 .. 255     the UTF-8 bytes of the text
    256 <bos>    start of a document / request
    257 <eos>    end of a document / of the model's answer (the stop token)
    258 <pad>    padding (never a training target)
    259 <tool_call>   opens a JSON tool call
    260 </tool_call>  closes it
    261 .. 263   reserved (the vocabulary is padded to a multiple of 8)

``encode`` never produces special ids from text: a literal ``"<tool_call>"`` in the input is encoded as its
bytes, so ``decode(encode(s)) == s`` for every string. ``decode`` renders special ids by their names (or
drops them with ``skip_special=True``) and replaces invalid UTF-8 (a model can emit any byte sequence).

The description written next to a checkpoint (``tokenizer.json``, see :meth:`ByteTokenizer.to_json`) is
all a user needs to rebuild the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NUM_BYTES = 256
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<tool_call>", "</tool_call>")
VOCAB_SIZE = 264  # 256 bytes + 5 specials, padded to a multiple of 8


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes plus special tokens (ids in the module docstring)."""

    vocab_size: int = VOCAB_SIZE

    bos_id: int = NUM_BYTES
    eos_id: int = NUM_BYTES + 1
    pad_id: int = NUM_BYTES + 2
    tool_start_id: int = NUM_BYTES + 3
    tool_end_id: int = NUM_BYTES + 4

    def __post_init__(self):
        if self.vocab_size < NUM_BYTES + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size={self.vocab_size} cannot hold 256 bytes and {len(SPECIAL_TOKENS)} specials")

    @property
    def special_ids(self) -> dict[str, int]:
        return {name: NUM_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, optionally wrapped in ``<bos>`` / ``<eos>``."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for long text: u8 bytes widened to i32[len]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids, skip_special: bool = False) -> str:
        """ids (any int sequence) -> text. Each run of bytes between special tokens is decoded as UTF-8 on its
        own (invalid sequences become U+FFFD), also when the specials are skipped."""
        names = {v: k for k, v in self.special_ids.items()}
        out: list[str] = []
        run = bytearray()
        for i in (int(t) for t in ids):
            if 0 <= i < NUM_BYTES:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if not skip_special:
                out.append(names.get(i, f"<unused{i}>"))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    # ---- description stored with checkpoints --------------------------------------------------
    def to_json(self) -> dict:
        return {
            "type": "byte_level",
            "vocab_size": self.vocab_size,
            "bytes": "ids 0..255 are the UTF-8 byte values",
            "special_tokens": self.special_ids,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "prompt_format": "<bos>{request}\\n -> <tool_call>{json}</tool_call><eos>",
        }

    @classmethod
    def from_json(cls, d: dict) -> ByteTokenizer:
        if d.get("type") != "byte_level":
            raise ValueError(f"not a byte-level tokenizer description: type={d.get('type')!r}")
        tok = cls(vocab_size=int(d["vocab_size"]))
        if d.get("special_tokens", tok.special_ids) != tok.special_ids:
            raise ValueError(f"special token ids {d['special_tokens']} differ from {tok.special_ids}")
        return tok

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "tokenizer.json"
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        return cls.from_json(json.loads((Path(directory) / "tokenizer.json").read_text()))
