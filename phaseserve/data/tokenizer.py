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

Next to a checkpoint it is stored as Hugging Face tokenizer files (:meth:`ByteTokenizer.save`: ``tokenizer.json``
and ``tokenizer_config.json``), so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads the same ids:
``<bos>`` prepended for ``add_special_tokens=True`` (the training format), text spelling a special token encoded
as bytes (``split_special_tokens``).

:class:`HFTokenizer` is the same interface (``encode_prompt``, ``decode``, ``is_special``, ``token_bytes``,
``info``) over a checkpoint's own Hugging Face tokenizer files (read with ``tokenizers``, no ``transformers``), with
its chat template (``chat_ids``, rendered with jinja2): what the server uses for a checkpoint whose
``tokenizer.json`` is not this byte-level one (Kimi, GLM, Qwen, ...). :func:`load_tokenizer` picks one for a
checkpoint directory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

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

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model was trained: ``<bos>`` then the bytes (Hugging Face's ``add_special_tokens``)."""
        return self.encode(text, bos=True)

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for long text: u8 bytes widened to i32[len]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def is_special(self, t: int) -> bool:
        return not 0 <= t < NUM_BYTES

    def token_bytes(self, t: int) -> bytes:
        """Token ``t``'s bytes: its byte, or a special token's name in UTF-8."""
        return bytes([t]) if 0 <= t < NUM_BYTES else self.decode([t]).encode("utf-8")

    def decode(self, ids, skip_special: bool = False) -> str:
        """ids (any int sequence) -> text. Each run of bytes between special tokens is decoded as UTF-8 on its
        own (invalid sequences become U+FFFD); skipped specials (``skip_special``) leave the bytes around them one
        run, as ``transformers``' ``decode(..., skip_special_tokens=True)`` does."""
        names = {v: k for k, v in self.special_ids.items()}
        out: list[str] = []
        run = bytearray()
        for i in (int(t) for t in ids):
            if 0 <= i < NUM_BYTES:
                run.append(i)
                continue
            if skip_special:  # a skipped special does not split the bytes around it (as Hugging Face's decode)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if not skip_special:
                out.append(names.get(i, f"<unused{i}>"))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    # ---- Hugging Face tokenizer files stored with checkpoints ----------------------------------------
    def hf_tokenizer(self) -> Tokenizer:
        """The same tokenizer as a Hugging Face ``tokenizers.Tokenizer``: byte-level pre-tokenization (GPT-2's
        byte-to-character table) onto ids 0..255 = the byte values, the specials at their ids, ``<bos>`` prepended
        when special tokens are added (as the model was trained), the byte-level decoder."""
        vocab = {ch: b for b, ch in enumerate(byte_chars())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        names = [*SPECIAL_TOKENS, *(f"<unused{i}>" for i in range(NUM_BYTES + len(SPECIAL_TOKENS), self.vocab_size))]
        tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", self.bos_id)])
        return tok

    def hf_config(self, model_max_length: int | None = None) -> dict:
        """``tokenizer_config.json``: specials by name, and ``split_special_tokens`` so that text spelling a special
        token is encoded as its bytes (as :meth:`encode` does)."""
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
               "pad_token": "<pad>", "split_special_tokens": True, "clean_up_tokenization_spaces": False}
        return cfg | ({"model_max_length": int(model_max_length)} if model_max_length else {})

    def save(self, directory: str | Path, model_max_length: int | None = None) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (what ``AutoTokenizer.from_pretrained`` reads)."""
        directory = Path(directory)
        self.hf_tokenizer().save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(
            json.dumps(self.hf_config(model_max_length), indent=2) + "\n")
        return directory / "tokenizer.json"

    @classmethod
    def from_json(cls, d: dict) -> ByteTokenizer:
        """The tokenizer a Hugging Face ``tokenizer.json`` describes, if it is this byte-level one (ValueError else);
        also the project's own earlier format (``{"type": "byte_level", "vocab_size", "special_tokens"}``)."""
        if d.get("type") == "byte_level":
            tok = cls(vocab_size=int(d.get("vocab_size", VOCAB_SIZE)))
            if d.get("special_tokens") != tok.special_ids:
                raise ValueError(f"special token ids {d.get('special_tokens')} differ from {tok.special_ids}")
            return tok
        model, pre = d.get("model") or {}, d.get("pre_tokenizer") or {}
        if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or model.get("merges"):
            raise ValueError(f"not a byte-level tokenizer.json: model {model.get('type')!r}, pre-tokenizer "
                             f"{pre.get('type')!r}, {len(model.get('merges') or [])} merges")
        added = {t["content"]: t["id"] for t in d.get("added_tokens", [])}
        tok = cls(vocab_size=len(model.get("vocab", {})) + len(added))
        if model.get("vocab") != {ch: b for b, ch in enumerate(byte_chars())}:
            raise ValueError("not a byte-level tokenizer.json: ids 0..255 are not the byte values")
        if {k: added.get(k) for k in tok.special_ids} != tok.special_ids:
            raise ValueError(f"special token ids {added} differ from {tok.special_ids}")
        return tok

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        return cls.from_json(json.loads((Path(directory) / "tokenizer.json").read_text()))

    def info(self) -> dict:
        """What ``/tokenizer_info`` reports (the fields of ``tokenizer_config.json``, vLLM's shape)."""
        return {"tokenizer_class": "ByteTokenizer", "vocab_size": self.vocab_size, "bos_token": "<bos>",
                "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True, "chat_template": None,
                "special_tokens": self.special_ids}


class HFTokenizer:
    """A checkpoint's Hugging Face tokenizer behind the server's tokenizer interface, read with the ``tokenizers``
    library (``tokenizer.json``) and ``tokenizer_config.json`` alone -- no ``transformers`` -- so serving any
    checkpoint needs only the package's own dependencies. ``encode_prompt`` adds the special tokens the tokenizer
    adds by default (its post-processor: ``<bos>``, as the model was trained); ``chat_ids`` renders messages (and
    offered ``tools``) with the checkpoint's chat template (:mod:`phaseserve.data.chat_template`) and the
    generation prompt, then encodes the text without adding special tokens, as ``apply_chat_template`` does."""

    def __init__(self, tok: Tokenizer, config: dict | None = None, chat_template: str | None = None):
        self.tok, self.config = tok, dict(config or {})
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.names = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                   "pad_token")}
        self.bos_id, self.eos_id = (self._id(self.names[k]) for k in ("bos_token", "eos_token"))
        state = json.loads(tok.to_str())
        added = {int(i): v for i, v in (self.config.get("added_tokens_decoder") or {}).items()}
        self._special = {t["id"] for t in state.get("added_tokens", []) if t.get("special")}
        self._special |= {i for i, v in added.items() if v.get("special")}
        extra = [_token_text(t) for t in self.config.get("additional_special_tokens") or []]
        self._special |= {i for i in map(self._id, [*self.names.values(), *extra]) if i is not None}
        self._bytes: dict[int, bytes] = {}
        self._byte_level = "ByteLevel" in json.dumps([state.get("pre_tokenizer"), state.get("decoder")])
        self._inverse = {ch: b for b, ch in enumerate(byte_chars())}
        self._cleanup = bool(self.config.get("clean_up_tokenization_spaces", False))
        self.chat_template = chat_template

    def _id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        """``tokenizer.json`` (required), ``tokenizer_config.json`` and the chat template (``chat_template.jinja``,
        ``chat_template.json``, or ``tokenizer_config.json``'s ``chat_template``; the ``default`` one of a named
        list)."""
        from phaseserve.data.chat_template import read_chat_template

        d = Path(directory)
        cfg_path = d / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        try:
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception for a missing or unreadable file
            raise OSError(f"cannot read {d / 'tokenizer.json'}: {e}") from None
        return cls(tok, config, read_chat_template(d, config))

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=bos).ids)

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text, bos=True)

    def decode(self, ids, skip_special: bool = False) -> str:
        text = self.tok.decode([int(t) for t in ids], skip_special_tokens=skip_special)
        return clean_up_tokenization(text) if self._cleanup else text

    def is_special(self, t: int) -> bool:
        return t in self._special

    def token_bytes(self, t: int) -> bytes:
        """Token ``t``'s bytes: byte-level BPE pieces through GPT-2's byte table, SentencePiece pieces with
        ``<0xNN>`` byte fallback and ``▁`` as a space; a special token: its text."""
        out = self._bytes.get(t)
        if out is None:
            piece = self.tok.id_to_token(int(t))
            if piece is None:
                out = b""
            elif t in self._special:
                out = piece.encode("utf-8")
            elif self._byte_level and all(ch in self._inverse for ch in piece):
                out = bytes(self._inverse[ch] for ch in piece)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                out = bytes([int(piece[3:5], 16)])
            else:
                out = piece.replace("\u2581", " ").encode("utf-8")
            self._bytes[t] = out
        return out

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt of a chat: the checkpoint's chat template with the generation prompt (ValueError when the
        tokenizer has no template, or the template raises)."""
        from phaseserve.data.chat_template import render

        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template")
        text = render(self.chat_template, messages, tools=tools, add_generation_prompt=True,
                      **{k: v for k, v in self.names.items() if v is not None})
        return self.encode(text, bos=False)

    def info(self) -> dict:
        return {"tokenizer_class": str(self.config.get("tokenizer_class") or "PreTrainedTokenizerFast"),
                "vocab_size": self.vocab_size, "bos_token": self.names["bos_token"],
                "eos_token": self.names["eos_token"], "pad_token": self.names["pad_token"],
                "add_bos_token": bool(self.bos_id is not None and self.encode("x", bos=True)[:1] == [self.bos_id]),
                "chat_template": self.chat_template,
                "model_max_length": self.config.get("model_max_length", int(1e30))}


def _token_text(t: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it: a string, or an AddedToken dict with ``content``."""
    return t.get("content") if isinstance(t, dict) else t


def clean_up_tokenization(text: str) -> str:
    """Hugging Face's ``clean_up_tokenization_spaces``: no space before punctuation and English contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def load_tokenizer(directory: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a checkpoint directory: the byte-level one when its ``tokenizer.json`` is that (the
    default model, in either of the formats it has shipped in), else its own Hugging Face tokenizer
    (:class:`HFTokenizer`)."""
    path = Path(directory) / "tokenizer.json"
    try:
        return ByteTokenizer.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return HFTokenizer.load(directory)


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255 (what Hugging Face's byte-level pre-tokenizer maps
    bytes to): printable Latin-1 bytes stand for themselves, the rest take code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
