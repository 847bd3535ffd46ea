"""The server-sent-event template renders each event byte for byte as ``json.dumps`` of the whole chunk does."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from phaseserve.server.sse import Template, event


@given(text=st.text(), model=st.text(), reason=st.none() | st.sampled_from(["stop", "length"]))
def test_a_template_event_equals_the_whole_chunk_dumped(text, model, reason):
    def chunk(t):
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": model,
                "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": reason}], "usage": None}

    assume(Template.SLOT not in model)  # the one string the template reserves
    got = Template(chunk(Template.SLOT))(text)
    assert got == event(chunk(text))
    assert json.loads(got.removeprefix("data: "))["choices"][0]["text"] == text


def test_a_template_needs_exactly_one_slot():
    with pytest.raises(ValueError, match="exactly one"):
        Template({"a": "x"})
    with pytest.raises(ValueError, match="exactly one"):
        Template({"a": Template.SLOT, "b": Template.SLOT})
