"""Data for the default model: byte tokenizer round trips, corpus split and batch determinism, the tool-call
generator and held-out split, the JSON Schema validator (accepts every generated call, rejects mutated ones),
and reading calls back out of generated tokens."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.data.corpus import Mixture, Peekable, answer_mask, eval_windows, pack_examples, split_of_file, stdlib_files
from phaseserve.data import (
    TOOLS,
    VOCAB_SIZE,
    ByteTokenizer,
    ToolExample,
    examples,
    extract_call,
    parse_call,
    sample_example,
    validate,
    validate_call,
)
from phaseserve.data.toolcalls import BASIC_TOOLS, FAR_TOKENS, KINDS, MAX_PROMPT_TOKENS, split_of

TOK = ByteTokenizer()


# ---- tokenizer ----------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    wrapped = TOK.encode(text, bos=True, eos=True)
    assert wrapped[0] == TOK.bos_id and wrapped[-1] == TOK.eos_id
    assert TOK.decode(wrapped, skip_special=True) == text
    assert TOK.encode_array(text).tolist() == ids


def test_special_markers_in_text_stay_bytes():
    text = "a <tool_call>{}</tool_call> <eos>"
    ids = TOK.encode(text)
    assert max(ids) < 256 and TOK.decode(ids) == text
    mixed = [TOK.bos_id, *TOK.encode("x"), TOK.tool_start_id, *TOK.encode("{}"), TOK.tool_end_id, TOK.eos_id]
    assert TOK.decode(mixed) == "<bos>x<tool_call>{}</tool_call><eos>"
    assert TOK.decode(mixed, skip_special=True) == "x{}"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=64))
def test_decode_never_fails_on_model_output(ids):
    """A model can emit any id sequence, including invalid UTF-8; decode must still return text."""
    out = TOK.decode(ids)
    assert isinstance(out, str)
    runs, run = [], bytearray()  # byte runs between special tokens decode separately
    for i in ids:
        if i < 256:
            run.append(i)
        else:
            runs.append(bytes(run))
            run = bytearray()
    runs.append(bytes(run))
    assert "".join(TOK.decode(r) for r in runs) == "".join(r.decode("utf-8", errors="replace") for r in runs)
    # skipping the specials joins the runs around them (as transformers' decode with skip_special_tokens)
    assert TOK.decode(ids, skip_special=True) == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    if all(i < 256 for i in ids):
        assert out == bytes(ids).decode("utf-8", errors="replace")


def test_vocab_and_description(tmp_path):
    assert VOCAB_SIZE % 8 == 0 and VOCAB_SIZE >= 256 + 5
    assert len(set(TOK.special_ids.values())) == 5 and min(TOK.special_ids.values()) == 256
    TOK.save(tmp_path)
    assert ByteTokenizer.load(tmp_path) == TOK
    with pytest.raises(ValueError, match="byte-level"):
        ByteTokenizer.from_json({"type": "bpe"})
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=260)


# ---- corpus -------------------------------------------------------------------------------------------
def test_stdlib_split_is_disjoint_and_complete():
    train, held, every = stdlib_files("train"), stdlib_files("heldout"), stdlib_files("all")
    assert set(train).isdisjoint(held) and sorted(set(train) | set(held)) == every
    assert 0.02 < len(held) / len(every) < 0.1
    assert stdlib_files("heldout") == held  # deterministic order
    assert all(split_of_file(p.name) in ("train", "heldout") for p in held[:3])
    with pytest.raises(ValueError):
        stdlib_files("validation")


def test_mixture_batches_are_deterministic_per_step():
    seed = random.randrange(1000)
    mix = Mixture(batch_size=8, seq_len=128, tool_fraction=0.5, seed=seed)
    a, ma = mix.batch(7)
    b, mb = Mixture(batch_size=8, seq_len=128, tool_fraction=0.5, seed=seed).batch(7)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ma, mb)
    assert a.shape == (8, 129) and ma.shape == (8, 128) and a.dtype == np.int32
    assert not np.array_equal(a, mix.batch(8)[0])
    assert not np.array_equal(a, Mixture(batch_size=8, seq_len=128, tool_fraction=0.5, seed=seed + 1).batch(7)[0])
    np.testing.assert_array_equal(ma, (a[:, 1:] != TOK.pad_id).astype(np.float32))
    assert a.min() >= 0 and a.max() < VOCAB_SIZE


def test_tool_rows_hold_whole_examples_then_padding():
    rng = random.Random(random.randrange(10**6))
    exs = [sample_example(rng) for _ in range(20)]
    row = pack_examples(Peekable(ex.ids(TOK) for ex in exs), 256, TOK)
    assert row.shape == (257,)
    used = int(np.argmax(row == TOK.pad_id)) if (row == TOK.pad_id).any() else len(row)
    assert (row[used:] == TOK.pad_id).all()
    k, total = 0, 0
    while total + len(exs[k].ids(TOK)) <= used:
        total += len(exs[k].ids(TOK))
        k += 1
    assert k >= 1 and total == used  # exactly the first k examples, none cut
    assert row[:used].tolist() == sum((ex.ids(TOK) for ex in exs[:k]), [])
    assert used + len(exs[k].ids(TOK)) > 257  # the next one would not have fit


def test_eval_windows_are_fixed():
    w = eval_windows("heldout", 64, num=8)
    assert w.shape == (8, 65)
    np.testing.assert_array_equal(w, eval_windows("heldout", 64, num=8))


# ---- tool-call examples and split ---------------------------------------------------------------------
def test_examples_deterministic_and_heldout_never_in_training():
    seed = random.randrange(10**6)
    held = examples(50, "heldout", seed)
    assert [e.request for e in held] == [e.request for e in examples(50, "heldout", seed)]
    assert len({e.request for e in held}) == 50
    assert all(split_of(e.request) == "heldout" for e in held)
    train = examples(500, "train", seed + 1, unique=False)
    assert {e.request for e in train}.isdisjoint(e.request for e in held)
    assert {e.call["name"] for e in train} == set(BASIC_TOOLS)  # the basic mix: the five original tools
    full = examples(400, "train", seed + 2, unique=False, mix="full")
    assert {e.call["name"] for e in full} == set(TOOLS) and {e.kind for e in full} == set(KINDS)
    held_full = examples(30, "heldout", seed, mix="full")
    assert all(split_of(e.key) == "heldout" for e in held_full)
    assert {e.key for e in full}.isdisjoint(e.key for e in held_full)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["single", "multi_turn"]))
def test_harder_kinds_are_valid_and_stress_what_they_name(seed, mix):
    """Every call of the new kinds is schema-valid and its argument values are written in the conversation; long
    arguments have >= 40 characters; a multi-turn argument lies >= FAR_TOKENS tokens before the answer, and the
    prompt leaves room for the answer in 1,024 positions."""
    ex = sample_example(random.Random(seed), mix)
    assert validate_call(ex.call) == [], ex
    text = TOK.decode(ex.prompt_ids(TOK))
    leaves = [v for v in ex.call["arguments"].values() if not isinstance(v, dict)]
    leaves += [v for d in ex.call["arguments"].values() if isinstance(d, dict) for v in d.values()]
    for v in leaves:
        if ex.call["name"] != "convert_currency" or not isinstance(v, str):  # currency codes may be named
            assert (json.dumps(v) if not isinstance(v, str) else v) in text, (v, text)
    if ex.kind == "long":
        assert max(len(v) for v in leaves if isinstance(v, str)) >= 40
    if ex.kind == "nested":
        assert set(ex.call["arguments"]["when"]) == {"date", "time"}
    if ex.kind == "multi_arg":
        assert len(ex.call["arguments"]) == 5
    if mix == "multi_turn":
        assert ex.kind == "multi_turn" and len(ex.prompt_ids(TOK)) <= MAX_PROMPT_TOKENS
        ids = ex.prompt_ids(TOK)
        noted = [(m, str(v)) for m, c in ex.history if c is None for v in leaves
                 if f'"{v}"' in m or f"is {v} minutes" in m]
        assert len(noted) == 1, (noted, ex.history[:2])
        note, value = noted[0]
        where = 1 + TOK.decode(ids[1:]).index(note) + note.index(value)  # notes come first: byte = token index
        assert len(ids) - where >= FAR_TOKENS
    call, errors = parse_call(ex.completion_ids(TOK), TOK)
    assert errors == [] and call == ex.call


def test_answer_mask_and_weights():
    exs = [sample_example(random.Random(random.randrange(10**6)), "single") for _ in range(3)]
    ids = np.array(sum((e.ids(TOK) for e in exs), []))
    mask = answer_mask(ids, TOK)
    want = np.concatenate([np.r_[np.zeros(len(e.prompt_ids(TOK))), np.ones(len(e.completion_ids(TOK)))]
                           for e in exs]).astype(bool)
    np.testing.assert_array_equal(mask, want)
    # 32 rows: with tool_fraction 0.5 both kinds of row appear but with probability 2 * 2**-32 (6 rows: ~3%)
    mix = Mixture(batch_size=32, seq_len=128, tool_fraction=0.5, seed=random.randrange(1000), tool_mix="single",
                  answer_weight=2.0, prompt_weight=0.25)
    tokens, w = mix.batch(3)
    tgt = tokens[:, 1:]
    tool_rows = (tgt == TOK.tool_start_id).any(1)
    assert tool_rows.any() and (~tool_rows).any()
    assert set(np.unique(w[tool_rows]).tolist()) <= {0.0, 0.25, 2.0} and (w[~tool_rows] == 1.0).all()
    np.testing.assert_array_equal(w[tool_rows] == 2.0, answer_mask(tgt[tool_rows], TOK))
    np.testing.assert_array_equal(w == 0.0, tgt == TOK.pad_id)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_every_generated_call_is_valid_and_round_trips(seed):
    ex = sample_example(random.Random(seed))
    assert validate_call(ex.call) == []
    ids = ex.ids(TOK)
    assert ids[: len(ex.prompt_ids(TOK))] == ex.prompt_ids(TOK)
    call, errors = parse_call(ex.completion_ids(TOK), TOK)
    assert errors == [] and call == ex.call
    assert json.loads(extract_call(ids, TOK)) == ex.call


# ---- validator --------------------------------------------------------------------------------------
def _mutations(call: dict, rng: random.Random) -> list[dict]:
    """Invalid variants of a valid call, one schema rule broken in each."""
    args, schema = call["arguments"], TOOLS[call["name"]]
    out = []
    required = rng.choice(schema["required"])
    c = copy.deepcopy(call)
    del c["arguments"][required]
    out.append(c)
    c = copy.deepcopy(call)
    c["arguments"]["extra_" + str(rng.randrange(100))] = 1
    out.append(c)
    c = copy.deepcopy(call)
    c["name"] = call["name"] + "_v2"
    out.append(c)
    key = rng.choice(sorted(args))
    c = copy.deepcopy(call)
    c["arguments"][key] = [args[key]] if rng.random() < 0.5 else None  # wrong type
    out.append(c)
    out.append({"name": call["name"]})
    out.append([call])
    out.append({**copy.deepcopy(call), "id": 3})
    return out


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_validator_rejects_mutated_calls(seed):
    rng = random.Random(seed)
    ex = sample_example(rng)
    for bad in _mutations(ex.call, rng):
        assert validate_call(bad), bad


@pytest.mark.parametrize("args, ok", [
    ({"minutes": 5}, True), ({"minutes": 5.0}, True), ({"minutes": 5.5}, False), ({"minutes": True}, False),
    ({"minutes": 0}, False), ({"minutes": 1441}, False), ({"minutes": "5"}, False), ({}, False),
])
def test_validator_integer_rules(args, ok):
    assert (validate_call({"name": "set_timer", "arguments": args}) == []) == ok


@pytest.mark.parametrize("value, ok", [
    ("bob@example.com", True), ("li.wei@mail.org", True), ("Bob@example.com", False), ("bob@example", False),
    ("bob example.com", False), ("", False), ("bob@example.com\n", False), ("x bob@example.com", False),
])
def test_validator_pattern(value, ok):
    call = {"name": "send_email", "arguments": {"to": value, "subject": "hi"}}
    assert (validate_call(call) == []) == ok


def test_validator_enum_number_and_unsupported_type():
    schema = TOOLS["convert_currency"]
    assert validate({"amount": 12.5, "from": "USD", "to": "EUR"}, schema) == []
    assert validate({"amount": -1, "from": "USD", "to": "EUR"}, schema)
    assert validate({"amount": 3, "from": "usd", "to": "EUR"}, schema)
    assert validate({"amount": "3", "from": "USD", "to": "EUR"}, schema)
    with pytest.raises(jsonschema.SchemaError):
        validate([], {"type": "arrayy"})


def test_validator_refuses_what_a_keyword_subset_would_miss():
    """The old hand-written subset ignored keywords it did not know (maxLength, exclusiveMinimum, const, items,
    anyOf, ...), so a call breaking them passed as valid; jsonschema applies the whole specification."""
    rng = random.Random(int(np.random.SeedSequence().entropy % 2**31))
    tools = copy.deepcopy(TOOLS)
    tools["send_email"]["properties"]["subject"]["maxLength"] = 20
    tools["convert_currency"]["properties"]["amount"]["exclusiveMinimum"] = 0
    tools["search_web"]["properties"]["tags"] = {"type": "array", "items": {"type": "string"}, "maxItems": 3}
    subject = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(21, 60)))
    bad = [{"name": "send_email", "arguments": {"to": "bob@example.com", "subject": subject}},
           {"name": "convert_currency", "arguments": {"amount": 0, "from": "USD", "to": "EUR"}},
           {"name": "search_web", "arguments": {"query": "jax", "tags": ["a", rng.randint(0, 9)]}},
           {"name": "search_web", "arguments": {"query": "jax", "tags": ["a", "b", "c", "d"]}}]
    for call in bad:
        errors = validate_call(call, tools)
        assert errors and all(e.startswith("$.arguments") for e in errors), (call, errors)
    good = [{"name": "send_email", "arguments": {"to": "bob@example.com", "subject": subject[:20]}},
            {"name": "convert_currency", "arguments": {"amount": 0.5, "from": "USD", "to": "EUR"}},
            {"name": "search_web", "arguments": {"query": "jax", "tags": ["a", "b", "c"]}}]
    for call in good:
        assert validate_call(call, tools) == [], call


def test_parse_call_errors():
    assert parse_call(TOK.encode("no call here"), TOK)[1] == ["no <tool_call> in the generation"]
    bad = [TOK.tool_start_id, *TOK.encode('{"name": "set_timer", "argu'), TOK.eos_id]
    call, errors = parse_call(bad, TOK)
    assert call is None and errors[0].startswith("not JSON")
    unterminated = [TOK.tool_start_id, *TOK.encode('{"name": "set_timer", "arguments": {"minutes": 3}}')]
    assert parse_call(unterminated, TOK) == ({"name": "set_timer", "arguments": {"minutes": 3}}, [])
    ex = ToolExample("x", {"name": "search_web", "arguments": {"query": "q"}})
    assert parse_call([*TOK.encode("preamble "), *ex.completion_ids(TOK)], TOK) == (ex.call, [])
