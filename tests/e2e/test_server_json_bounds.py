"""JSON bounds of the HTTP server (issue 61, item 2): every JSON value it parses is within
:mod:`phaseserve.server.jsonbounds`' limits or refused with a 400 in OpenAI's shape, never a 5xx.

A 100k-deep tool-call ``arguments`` value was a 500 ``RecursionError`` (and so was a tool ``parameters`` schema
a few hundred levels deep, in ``jsonschema``); now the request body, each ``arguments`` string and a generated tool
call are measured before anything recurses into them. One server (uvicorn in a thread) over a model-free stub
backend (every generated token is ``a``); a hypothesis fuzz posts random bodies (deep nesting, huge and non-finite
numbers, lone surrogates, repeated keys, random JSON in every field) to every POST route. The scanner itself is
checked against a character-by-character reference.
"""

from __future__ import annotations

import copy
import http.client
import json
import logging
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lab.bench.http_cost import StubBackend
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.engine.request import Logprob, Request, RequestOutput
from phaseserve.server import create_app
from phaseserve.server.chat import tool_calls_of
from phaseserve.server.jsonbounds import MAX_DEPTH, JsonBoundsError, check_value, loads, too_deep
from phaseserve.server.launch import start_in_thread
from phaseserve.server.schemas import ChatCompletionRequest, CompletionRequest
from tests.e2e.test_server_safety import Tracebacks

MODEL = "stub"
TOK = ByteTokenizer()
DEEP = 100_000


class LogprobStub(StubBackend):
    """The model-free stub with logprobs (the fuzz asks for them): every generated token ``a`` with log-probability
    0 (its own top alternative), each prompt token but the first likewise; ``max_tokens=0`` scores the prompt."""

    def submit(self, req: Request) -> RequestOutput:
        out = super().submit(req)
        out.seed = req.seed
        if req.logprobs is not None:
            out.logprobs = []
        if req.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [Logprob(t, 0.0, ((t, 0.0),) * req.prompt_logprobs) for t in req.prompt[1:]]
        if req.max_tokens == 0:
            out.finish_reason = "length"
            del self.running[req.id]
        return out

    def advance(self, deliver=None) -> None:
        outs = [(req, out) for req, out in self.running.values()]
        super().advance(deliver)
        for req, out in outs:
            if out.logprobs is not None:
                out.logprobs.append(Logprob(self.token, 0.0, ((self.token, 0.0),) * req.logprobs))


@pytest.fixture(scope="module")
def server():
    app = create_app(LogprobStub(step_s=0.0), TOK, MODEL)
    logs = Tracebacks()
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).addHandler(logs)
    srv, thread, base = start_in_thread(app)
    yield {"port": int(base.rsplit(":", 1)[1]), "logs": logs}
    srv.should_exit = True
    thread.join(30)
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).removeHandler(logs)


def _post(port: int, path: str, body: str | bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    conn.request("POST", path, body=data, headers={"content-type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.read().decode("utf-8", "replace")
    conn.close()
    return out


def _error(text: str) -> dict:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def _nest(depth: int, leaf: str = "") -> str:
    """JSON text of ``depth`` nested arrays around ``leaf``."""
    return "[" * depth + leaf + "]" * depth


def _chat_with_arguments(arguments: str) -> str:
    return json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})


def _chat_with(fields: str) -> str:
    """A chat body with the raw JSON members ``fields`` added."""
    return '{"model": "stub", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], ' + fields + "}"


def _served(port: int) -> None:
    status, text = _post(port, "/v1/chat/completions", _chat_with('"temperature": 0'))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == "aa"


# ---- the issue's body ------------------------------------------------------------------------------------------
def test_a_100k_deep_tool_call_arguments_value_is_a_400_naming_the_limit_and_the_server_serves_on(server):
    """Item 2 of issue 61: was ``500 internal server error: RecursionError`` (``json.loads`` in the schema's
    ``arguments`` validator)."""
    before = len(server["logs"].records)
    status, text = _post(server["port"], "/v1/chat/completions", _chat_with_arguments(_nest(DEEP)))
    assert status == 400, text
    err = _error(text)
    assert err["type"] == "invalid_request_error"
    assert f"nested deeper than {MAX_DEPTH} levels" in err["message"], err
    assert err["param"] == "messages.1.tool_calls.0.function.arguments"
    assert len(server["logs"].records) == before, [r.getMessage() for r in server["logs"].records[before:]]
    _served(server["port"])


def _items_schema(depth: int) -> str:
    return '{"items": ' * (depth - 1) + "{}" + "}" * (depth - 1)


DEEP_BODIES = [  # (what, path, raw body): each nested past MAX_DEPTH somewhere
    ("the body's messages", "/v1/chat/completions", '{"messages": ' + _nest(DEEP) + "}"),
    ("a completion prompt", "/v1/completions", '{"prompt": ' + _nest(DEEP, "1") + "}"),
    ("response_format", "/v1/chat/completions", _chat_with('"response_format": {"type": "json_schema", '
                                                           '"json_schema": ' + '{"a": ' * DEEP + "1" + "}" * DEEP
                                                           + "}")),
    ("tool parameters, 400 levels (jsonschema's RecursionError before)", "/v1/chat/completions",
     _chat_with('"tools": [{"type": "function", "function": {"name": "f", "parameters": '
                + '{"properties": {"a": ' * 200 + "{}" + "}}" * 200 + "}}]")),
    ("tool parameters, one level past the limit", "/v1/chat/completions",
     _chat_with('"tools": [{"type": "function", "function": {"name": "f", "parameters": '
                + _items_schema(MAX_DEPTH - 3) + "}}]")),  # body, tools, tool, function: 4 levels above it
    ("arguments, one level past the limit", "/v1/chat/completions", _chat_with_arguments(_nest(MAX_DEPTH + 1))),
    ("a /tokenize chat", "/tokenize", '{"messages": [{"role": "user", "content": ' + _nest(DEEP) + "}]}"),
    ("a /detokenize body", "/detokenize", '{"tokens": ' + _nest(DEEP) + "}"),
]


@pytest.mark.parametrize("what,path,body", DEEP_BODIES, ids=[d[0] for d in DEEP_BODIES])
def test_deep_nesting_anywhere_is_a_400_naming_the_limit(server, what, path, body):
    status, text = _post(server["port"], path, body)
    assert status == 400, (what, status, text[:300])
    err = _error(text)
    assert err["type"] == "invalid_request_error" and f"deeper than {MAX_DEPTH} levels" in err["message"], err


def test_values_at_the_depth_limit_are_served(server):
    """The limit leaves room: a tool schema and call arguments nested exactly MAX_DEPTH deep (jsonschema's
    check_schema at about 8 frames per level) are answered normally."""
    status, text = _post(server["port"], "/v1/chat/completions", _chat_with(
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + _items_schema(MAX_DEPTH - 4)
        + "}}]"))
    assert status == 200, text
    status, text = _post(server["port"], "/v1/chat/completions", _chat_with_arguments(_nest(MAX_DEPTH)))
    assert status == 200, text


ODD_BODIES = [  # (what, path, raw body, words of the message)
    ("an int beyond Python's int-string limit", "/v1/completions", '{"prompt": "a", "seed": ' + "9" * 5000 + "}",
     "4300 digits"),
    ("a huge int in arguments", "/v1/chat/completions", _chat_with_arguments('{"a": ' + "9" * 5000 + "}"),
     "4300 digits"),
    ("1e999 (infinite as a float)", "/v1/completions", '{"prompt": "a", "top_p": 1e999}', "finite"),
    ("-1e999 in arguments", "/v1/chat/completions", _chat_with_arguments('{"a": -1e999}'), "finite"),
    ("NaN", "/v1/completions", '{"prompt": "a", "temperature": NaN}', "NaN is not JSON"),
    ("Infinity in arguments", "/v1/chat/completions", _chat_with_arguments('{"a": Infinity}'), "Infinity"),
    ("NaN in response_format", "/v1/chat/completions", _chat_with('"response_format": {"type": "text", "x": NaN}'),
     "NaN"),
    ("a repeated key", "/v1/completions", '{"prompt": "a", "max_tokens": 2, "prompt": "b"}', "'prompt' appears twice"),
    ("a repeated nested key", "/v1/chat/completions", '{"messages": [{"role": "user", "role": "system", '
                                                      '"content": "hi"}]}', "'role' appears twice"),
    ("a repeated key in arguments", "/v1/chat/completions", _chat_with_arguments('{"a": 1, "a": 2}'),
     "'a' appears twice"),
    ("a lone surrogate in arguments", "/v1/chat/completions", _chat_with_arguments('{"a": "\\ud800"}'),
     "lone surrogate"),
    ("a lone surrogate in a key", "/v1/chat/completions", _chat_with('"response_format": {"\\udc00": 1}'),
     "lone surrogate"),
    ("a lone surrogate in a /tokenize prompt (a 500 UnicodeEncodeError before)", "/tokenize",
     '{"prompt": "a\\ud800"}', "lone surrogate"),
    ("UTF-8 of a surrogate", "/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "lone surrogate"),
]


@pytest.mark.parametrize("what,path,body,words", ODD_BODIES, ids=[o[0] for o in ODD_BODIES])
def test_huge_or_non_finite_numbers_repeated_keys_and_lone_surrogates_are_a_400(server, what, path, body, words):
    before = len(server["logs"].records)
    status, text = _post(server["port"], path, body)
    assert status == 400, (what, status, text[:300])
    err = _error(text)
    assert err["type"] == "invalid_request_error" and words in err["message"], (what, err)
    assert len(server["logs"].records) == before, [r.getMessage() for r in server["logs"].records[before:]]


# ---- fuzz: no body gets a 5xx ------------------------------------------------------------------------------------
class Raw(str):
    """JSON text inserted as it stands (deep nests, huge numbers, NaN: what ``json.dumps`` would not write)."""


class Pairs(tuple):
    """An object written from its (key, value) pairs, so a key may repeat."""


def _dump(v) -> str:
    if isinstance(v, Raw):
        return v
    if isinstance(v, Pairs | dict):
        pairs = v if isinstance(v, Pairs) else v.items()
        return "{" + ", ".join(f"{json.dumps(k)}: {_dump(x)}" for k, x in pairs) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(map(_dump, v)) + "]"
    return json.dumps(v)  # a lone surrogate comes out as its \\udXXX escape, a non-finite float as NaN / Infinity


ODD_TEXT = st.sampled_from(["\ud800", "a\udfffb", "\x00", "\ufeff", "\u2028", "é", "💥", "<tool_call>", "\\", '"'])
TEXT = st.text(st.characters(exclude_categories=()), max_size=12) | ODD_TEXT  # surrogates included
DEPTHS = st.sampled_from([MAX_DEPTH, MAX_DEPTH + 1, 300, DEEP])  # 300: past jsonschema's stack, DEEP: json's
SPECIAL = st.one_of(  # what json.dumps would not write: deep nests (arrays, objects, schemas), odd numbers
    st.builds(lambda d: Raw(_nest(d, "1")), DEPTHS),
    st.builds(lambda d: Raw('{"a": ' * d + "1" + "}" * d), DEPTHS),
    st.builds(lambda d: Raw('{"items": ' * d + "{}" + "}" * d), DEPTHS),
    st.sampled_from([Raw("9" * 5000), Raw("-" + "1" * 4301), Raw("1" * 4300), Raw("1e999"), Raw("-1E400"),
                     Raw("1e-999"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("-0")]))
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | SPECIAL
KEYS = TEXT | st.sampled_from(["type", "text", "role", "content", "name", "arguments", "prompt", "messages"])
VALUE = st.recursive(SCALAR, lambda c: st.lists(c, max_size=4) | st.dictionaries(KEYS, c, max_size=4)
                     | st.lists(st.tuples(KEYS, c), min_size=2, max_size=4).map(Pairs), max_leaves=10)
PLAUSIBLE = st.none() | st.integers(0, 8) | st.booleans() | st.floats(0, 1)  # often a valid field value

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
BASES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/tokenize": {"prompt": "hi"},
         "/detokenize": {"tokens": [104, 105]}}
FIELDS = {  # route -> (top-level fields, nested dotted paths) a fuzzed value may replace
    "/v1/chat/completions": (sorted(set(ChatCompletionRequest.model_fields) | {"unknown"}), [
        "messages.0", "messages.0.content", "messages.0.content.0.text", "messages.1.tool_calls.0.function",
        "messages.1.tool_calls.0.function.arguments", "messages.1.tool_calls.0.function.name", "messages.2.role",
        "tools.0.function.parameters", "tools.0.function.parameters.properties", "tools.0.function.name",
        "messages.1.tool_calls.0.function.arguments"]),  # twice: the issue's field
    "/v1/completions": (sorted(set(CompletionRequest.model_fields) | {"unknown"}), ["prompt.0"]),
    "/tokenize": (["prompt", "messages", "add_special_tokens", "return_token_strs", "model"], ["prompt"]),
    "/detokenize": (["tokens", "model", "unknown"], ["tokens.0"]),
}
ROUTES = st.sampled_from([*["/v1/chat/completions"] * 3, *["/v1/completions"] * 2, "/tokenize", "/detokenize"])


def _replace(body, path: str, new):
    """A copy of ``body`` with the value at the dotted ``path`` replaced by ``new(old value)`` (unchanged where the
    path does not lead into a dict or list: an earlier replacement may have cut it)."""
    body = copy.deepcopy(body)  # keeps Raw and Pairs as they are
    *up, last = path.split(".")
    node = body
    for k in [*up, last]:
        if isinstance(node, list) and k.isdigit() and int(k) < len(node) or type(node) is dict:
            parent, node = node, node[int(k)] if isinstance(node, list) else node.get(k)
        else:
            return body
    parent[int(last) if isinstance(parent, list) else last] = new(node)
    return body


@st.composite
def bodies(draw) -> tuple[str, str]:
    """(route, raw body): a valid base body with 1-2 fields (top-level or nested) replaced, each by an odd value
    (SPECIAL, ODD_TEXT), a plausible one (a string where there was one, a small number) or random JSON; a tool
    call's ``arguments`` by a string of such JSON text; or (1 in 10) a random JSON value as the whole body."""
    path = draw(ROUTES)
    if draw(st.integers(0, 9)) == 9:
        return path, _dump(draw(VALUE))
    top, nested = FIELDS[path]
    body = BASES[path]
    for field in draw(st.lists(st.sampled_from(top) | st.sampled_from(nested), min_size=1, max_size=2)):
        def new(old, field=field):
            value = draw(st.one_of(SPECIAL, ODD_TEXT, TEXT if isinstance(old, str) else PLAUSIBLE, VALUE))
            return _dump(value) if field.endswith("arguments") else value

        body = _replace(body, field, new)
    return path, _dump(body)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          derandomize=True)
@given(case=bodies())
@example(case=("/v1/chat/completions", _chat_with_arguments(_nest(DEEP))))  # the issue's body
@example(case=("/v1/chat/completions", _chat_with('"tools": [{"type": "function", "function": {"name": "f", '
                                                  '"parameters": ' + _items_schema(300) + "}}]")))
@example(case=("/tokenize", '{"prompt": "a\\udfffb"}'))
def test_fuzzed_bodies_never_get_a_5xx(server, case):
    """Random bodies (:func:`bodies`) and three known 500s of the code before the bounds (each was a 500; random
    generation alone met one in about 130 examples there: 6 in 800)."""
    path, body = case
    before = len(server["logs"].records)
    status, text = _post(server["port"], path, body)
    assert status < 500, (path, body[:300], status, text[:300])
    if status >= 400:
        assert _error(text)["type"] == "invalid_request_error", text[:300]
    assert len(server["logs"].records) == before, [r.getMessage() for r in server["logs"].records[before:]]


def test_the_server_serves_after_the_fuzz(server):
    _served(server["port"])


# ---- the module itself ------------------------------------------------------------------------------------------
def _reference_depth(text: str) -> int:
    """Deepest bracket nesting outside strings, a character at a time (the scanner's specification): a quote opens
    or closes a string unless an odd run of backslashes comes right before it (in valid JSON, only in a string)."""
    depth = deepest = slashes = 0
    inside = False
    for c in text:
        if c == '"' and slashes % 2 == 0:
            inside = not inside
        elif c in "[{" and not inside:
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}" and not inside:
            depth -= 1
        slashes = slashes + 1 if c == "\\" else 0
    return deepest


def _value_depth(v) -> int:
    if isinstance(v, dict | list):
        return 1 + max(map(_value_depth, v.values() if isinstance(v, dict) else v), default=0)
    return 0


CHARS = st.sampled_from('[]{}"\\a,:é\ud800')
NESTED = st.recursive(st.none() | st.integers() | st.text(CHARS, max_size=6),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(CHARS, max_size=3), c, max_size=3),
                      max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=NESTED, junk=st.text(CHARS, max_size=40), limit=st.integers(0, 8))
def test_the_scanner_measures_depth_outside_strings(value, junk, limit):
    """Valid JSON: exactly the value's depth (strings full of brackets, quotes and backslashes, compact or indented,
    escaped or raw non-ASCII); any text: the reference's measure."""
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
        assert too_deep(text, limit) == (_value_depth(value) > limit), text
    for text in (junk, json.dumps(value) + junk, junk + json.dumps(value)):
        assert too_deep(text, limit) == (_reference_depth(text) > limit), text


def test_loads_and_check_value_refuse_without_recursing():
    deep = {}
    for _ in range(DEEP):  # built iteratively: 100k levels of Python dicts
        deep = {"a": deep}
    with pytest.raises(JsonBoundsError, match=f"deeper than {MAX_DEPTH} levels"):
        check_value(deep)
    with pytest.raises(JsonBoundsError, match=f"deeper than {MAX_DEPTH} levels"):
        loads(_nest(DEEP))
    assert loads(_nest(MAX_DEPTH)) == json.loads(_nest(MAX_DEPTH))
    assert loads(b'\xef\xbb\xbf{"a": [1.5, -0, "\\u00e9"]}') == {"a": [1.5, 0, "é"]}  # a BOM, as json.loads reads it
    with pytest.raises(json.JSONDecodeError):
        loads("{not json")
    check_value({"prompt": list(range(4000)), "x": [1.5, None, True]})  # fine: no error
    with pytest.raises(JsonBoundsError, match=r"x\.1: numbers must be finite"):
        check_value({"x": [1.0, math.inf]}, "")
    # from Python, past the HTTP layer: the schemas refuse a deep tool schema before jsonschema recurses into it
    with pytest.raises(ValidationError, match="deeper than"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": deep}}]})


def _call_ids(call_text: str) -> list[int]:
    return [TOK.tool_start_id, *TOK.encode(call_text), TOK.tool_end_id, TOK.eos_id]


@pytest.mark.parametrize("call,tools", [
    ('{"name": "f", "arguments": ' + _nest(3000) + "}", {"f": {}}),  # RecursionError in json.loads before
    ('{"name": "f", "arguments": {"a": NaN}}', {"f": {}}),  # was a call, sent back with "NaN" in its arguments
    ('{"name": "f", "arguments": {"a": 1}}', {"f": {"$ref": "#"}}),  # a schema whose $ref loops: RecursionError
    ('{"name": "f", "arguments": {"a": 1}}', {"f": {"$ref": "#/$defs/nowhere"}}),  # Unresolvable
], ids=["3000-deep arguments", "NaN arguments", "a looping $ref", "a $ref to nowhere"])
def test_a_generated_call_beyond_the_bounds_is_not_a_call(call, tools):
    """A generated tool call is parsed and validated within the bounds too: one the server cannot read is text
    (``tool_calls_of`` returns None), not a 500 after the generation."""
    assert tool_calls_of(_call_ids(call), TOK, tools) is None
    ok = tool_calls_of(_call_ids('{"name": "f", "arguments": {"a": 1}}'), TOK, {"f": {"type": "object"}})
    assert ok is not None and json.loads(ok[0]["function"]["arguments"]) == {"a": 1}
