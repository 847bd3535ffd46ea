"""The server's request schemas and its text path (no engine, no HTTP): what is refused, what maps to the engine's
sampling fields, incremental UTF-8 / stop strings / tool calls in :class:`~phaseserve.server.chat.TextStream`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import TOOLS, examples
from phaseserve.server.chat import TextStream, forced_prefix, render_chat, tool_calls_of
from phaseserve.server.schemas import ChatCompletionRequest, CompletionRequest, Message, validation_message

TOK = ByteTokenizer()
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_prompts_unknown_fields_and_the_sampling_map():
    assert CompletionRequest(prompt="ab").prompts == ["ab"]  # a string is one prompt, not its first character
    assert CompletionRequest(prompt=["ab", "c"]).prompts == ["ab", "c"]
    assert CompletionRequest(prompt=[3, 4]).prompts == [[3, 4]]
    assert CompletionRequest(prompt=[[3, 4], [5]]).prompts == [[3, 4], [5]]
    assert CompletionRequest(prompt="x", seed=2**32 - 1).sampling(1, choice=2)["seed"] == 1  # choice j: seed + j
    r = CompletionRequest.model_validate({"prompt": "x", "top_k": -1, "max_tokens": 7})
    assert r.sampling(r.max_tokens) == {"max_tokens": 7, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None,
                                        "ignore_eos": False, "stop_token_ids": (), "min_tokens": 0}
    r = CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=5, seed=2**32 - 1, stop="\n", ignore_eos=True,
                          stop_token_ids=[7], min_tokens=2)
    assert r.sampling(3) == {"max_tokens": 3, "temperature": 0.0, "top_p": 0.5, "top_k": 5, "seed": 2**32 - 1,
                             "ignore_eos": True, "stop_token_ids": (7,), "min_tokens": 2}
    assert r.stops == ["\n"]
    c = ChatCompletionRequest(messages=USER, max_completion_tokens=5, max_tokens=9)
    assert c.token_budget(100) == 5 and ChatCompletionRequest(messages=USER).token_budget(100) == 100


BAD_COMPLETIONS = [
    {"prompt": "x", "temperature": 2.5}, {"prompt": "x", "temperature": -0.1}, {"prompt": "x", "temperature": "nan"},
    {"prompt": "x", "top_p": 0}, {"prompt": "x", "top_p": 1.5}, {"prompt": "x", "top_k": -2},
    {"prompt": "x", "seed": -1}, {"prompt": "x", "seed": 2**32}, {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "max_tokens": "lots"}, {"prompt": "x", "n": 17}, {"prompt": "x", "logprobs": 21},
    {"prompt": "x", "logprobs": 2, "stream": True}, {"prompt": "x", "best_of": 2}, {"prompt": "x", "stop": ""},
    {"prompt": "x", "stop": list("abcdefghijklmnopq")}, {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": ""}, {"prompt": []}, {"prompt": ["a", ""]}, {"prompt": [[1, 2], []]}, {"prompt": [-1]}, {},
]
REFUSED_BY_NAME = [  # (body, the name the 400 gives): accepted and ignored before
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"), ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"), ({"prompt": "x", "min_p": 0.1}, "min_p"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "json_object"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ({"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens"),
    ({"prompt": "x", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize("body,name", REFUSED_BY_NAME)
def test_fields_the_server_cannot_honour_are_refused_by_name(body, name):
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body)
    assert name in validation_message(e.value.errors())[0]
    defaults = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0,
                "logit_bias": {}, "response_format": {"type": "text"}, "skip_special_tokens": True}
    CompletionRequest.model_validate({"prompt": "x", **defaults})  # the defaults themselves are fine


BAD_CHATS = [
    {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "user"}]},
    {"messages": [{"role": "tool", "content": "x"}]}, {"messages": USER, "tool_choice": "required"},
    {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"messages": USER, "tools": [TOOL, TOOL]}, {"messages": USER, "top_logprobs": 2},
    {"messages": USER, "logprobs": True, "top_logprobs": 21}, {"messages": USER, "logprobs": True, "stream": True},
    {"messages": USER, "tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"messages": USER, "max_completion_tokens": 0},
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS)
def test_bad_completion_bodies_are_refused_with_a_message(body):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    msg, _ = validation_message(e.value.errors())
    assert msg


@pytest.mark.parametrize("body", BAD_CHATS)
def test_bad_chat_bodies_are_refused(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_a_single_request_renders_in_the_trained_format_and_tool_choice_forces_the_opening():
    ex = examples(1, "heldout", seed=int(np.random.default_rng().integers(1 << 20)))[0]
    assert render_chat([Message(role="user", content=ex.request)], TOK) == ex.prompt_ids(TOK)
    named = ChatCompletionRequest(messages=USER, tools=[TOOL], tool_choice={"type": "function",
                                                                            "function": {"name": "get_weather"}})
    assert TOK.decode(forced_prefix(named, TOK)) == '<tool_call>{"name": "get_weather", "arguments": '
    assert forced_prefix(ChatCompletionRequest(messages=USER, tools=[TOOL], tool_choice="required"), TOK) == [
        TOK.tool_start_id]
    assert forced_prefix(ChatCompletionRequest(messages=USER, tools=[TOOL], tool_choice="none"), TOK) == []
    # an earlier assistant call is rendered as the model writes calls
    call = {"id": "c1", "type": "function", "function": {"name": ex.call["name"],
                                                         "arguments": json.dumps(ex.call["arguments"])}}
    chat = render_chat([Message(role="user", content=ex.request), Message(role="assistant", tool_calls=[call])], TOK)
    assert chat == ex.ids(TOK)


def test_tool_calls_are_read_back_with_json_arguments():
    for ex in examples(5, "heldout", seed=int(np.random.default_rng().integers(1 << 20))):
        calls = tool_calls_of(ex.completion_ids(TOK), TOK, TOOLS)
        assert calls[0]["function"]["name"] == ex.call["name"]
        assert json.loads(calls[0]["function"]["arguments"]) == ex.call["arguments"]
        ts = TextStream(TOK, tools=TOOLS)
        assert ts.feed(ex.completion_ids(TOK)) == "" and ts.flush() == ""
        content, got = ts.reply()
        assert content is None and json.loads(got[0]["function"]["arguments"]) == ex.call["arguments"]
    broken = [TOK.tool_start_id, *TOK.encode('{"name": "f", "arguments": [1'), TOK.eos_id]
    assert tool_calls_of(broken, TOK, {"f": {}}) is None
    ts = TextStream(TOK, tools={"f": {}})
    ts.feed(TOK.encode("ok ") + broken)
    ts.flush()
    assert ts.reply() == ('ok <tool_call>{"name": "f", "arguments": [1<eos>', None)


def test_a_call_to_a_tool_not_offered_or_with_bad_arguments_is_not_a_call():
    """Offered only book_flight, a get_weather call comes back as text; so does a book_flight call whose arguments
    fail its schema."""
    weather = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    ids = [TOK.tool_start_id, *TOK.encode(json.dumps(weather)), TOK.tool_end_id, TOK.eos_id]
    assert tool_calls_of(ids, TOK, TOOLS) is not None  # offered: a call
    offered = {"book_flight": TOOLS["book_flight"]}
    assert tool_calls_of(ids, TOK, offered) is None
    ts = TextStream(TOK, tools=offered)
    ts.feed(ids)
    ts.flush()
    assert ts.reply() == (f"<tool_call>{json.dumps(weather)}</tool_call><eos>", None)
    bad = {"name": "book_flight", "arguments": {"origin": 5}}
    ids = [TOK.tool_start_id, *TOK.encode(json.dumps(bad)), TOK.tool_end_id]
    assert tool_calls_of(ids, TOK, offered) is None


def test_an_offered_tool_schema_must_be_valid():
    body = {"messages": USER, "tools": [{"type": "function", "function": {"name": "f",
                                                                         "parameters": {"type": "nonsense"}}}]}
    with pytest.raises(ValidationError, match="not a valid JSON schema"):
        ChatCompletionRequest.model_validate(body)


TEXT = st.text(alphabet=st.sampled_from(list("ab \n") + ["é", "€", "😀", "\u0301"]), max_size=40)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, specials=st.lists(st.integers(0, 39), max_size=3), cuts=st.lists(st.integers(1, 9), max_size=30),
       junk=st.booleans())
def test_incremental_text_equals_the_tokenizer_decode(text, specials, cuts, junk):
    ids = TOK.encode(text)
    for at in sorted(specials, reverse=True):  # special tokens anywhere (they are dropped)
        ids.insert(min(at, len(ids)), TOK.eos_id)
    if junk:
        ids += [0xE2, 0x82]  # an unfinished multi-byte character at the end
    ts, out, i = TextStream(TOK), [], 0
    for c in [*cuts, len(ids)]:
        out.append(ts.feed(ids[i:i + c]))
        i += c
    out.append(ts.flush())
    assert "".join(out) == TOK.decode(ids, skip_special=True)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, stop=st.text(alphabet="ab\n€", min_size=1, max_size=4), cuts=st.lists(st.integers(1, 5)))
def test_stop_strings_cut_the_text_and_are_never_sent(text, stop, cuts):
    ids = TOK.encode(text)
    ts, out, i = TextStream(TOK, stops=[stop]), [], 0
    for c in [*cuts, len(ids)]:
        out.append(ts.feed(ids[i:i + c]))
        i += c
    out.append(ts.flush())
    sent = "".join(out)
    if stop in text:
        assert ts.stopped and sent == text[: text.index(stop)]
    else:
        assert not ts.stopped and sent == text
