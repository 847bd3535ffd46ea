"""The shipped model's tokenizer files are a real Hugging Face tokenizer: ``AutoTokenizer.from_pretrained`` loads
``models/default`` and gives exactly the ids and text of :class:`phaseserve.data.tokenizer.ByteTokenizer` (the
tokenizer the model was trained with and the server uses), on drawn text and drawn id sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from phaseserve.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer, byte_chars

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models/default"
TOK = ByteTokenizer()
HF = AutoTokenizer.from_pretrained(str(MODEL))

# text with multi-byte characters, whitespace runs, and the special tokens spelled out (encoded as bytes)
TEXT = st.lists(st.one_of(st.text(max_size=12), st.sampled_from([*SPECIAL_TOKENS, "  ", "\n\t", "é✓😀", "\x00"])),
                max_size=6).map("".join)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(TEXT)
def test_encode_agrees_with_the_training_tokenizer(text):
    assert HF(text)["input_ids"] == TOK.encode(text, bos=True)  # <bos> first, as the model was trained
    assert HF(text, add_special_tokens=False)["input_ids"] == TOK.encode(text)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40))
def test_decode_agrees_with_the_training_tokenizer(ids):
    """Any id sequence, invalid UTF-8 and specials included, decodes to the same text."""
    assert HF.decode(ids) == TOK.decode(ids)
    assert HF.decode(ids, skip_special_tokens=True) == TOK.decode(ids, skip_special=True)


def test_specials_and_limits_as_configured():
    assert (HF.bos_token_id, HF.eos_token_id, HF.pad_token_id) == (TOK.bos_id, TOK.eos_id, TOK.pad_id)
    assert len(HF) == TOK.vocab_size == json.loads((MODEL / "config.json").read_text())["vocab_size"]
    assert HF.model_max_length == json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
    assert ByteTokenizer.load(MODEL) == TOK


def test_byte_table_is_a_bijection_onto_printable_characters():
    chars = byte_chars()
    assert len(set(chars)) == 256 and all(c.isprintable() and not c.isspace() for c in chars)
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "\u0120"  # GPT-2's table: space is U+0120


def test_other_tokenizer_files_are_refused(tmp_path):
    d = json.loads((MODEL / "tokenizer.json").read_text())
    merged = d | {"model": d["model"] | {"merges": [["a", "b"]]}}
    with pytest.raises(ValueError, match="merges"):
        ByteTokenizer.from_json(merged)
    shifted = d | {"model": d["model"] | {"vocab": {c: (i + 1) % 256 for c, i in d["model"]["vocab"].items()}}}
    with pytest.raises(ValueError, match="byte values"):
        ByteTokenizer.from_json(shifted)
