"""Server-sent events as the OpenAI streaming API writes them: ``data: <json>\\n\\n`` per chunk, ``data: [DONE]`` last.

A stream's chunks differ only in their text, so :class:`Template` renders a chunk's JSON once with a placeholder and
fills in each event's text: one ``json.dumps`` of a short string per streamed token instead of one of the whole
chunk, byte for byte the same event (key order and escaping are ``json.dumps``'s).
"""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
_SLOT = "\x00slot\x00"  # a string no chunk built by the server contains (json.dumps writes it as \u0000slot\u0000)


def event(chunk: Any) -> str:
    """One server-sent event holding ``chunk`` as JSON."""
    return f"data: {json.dumps(chunk)}\n\n"


class Template:
    """The event of ``chunk`` with the one string value equal to :data:`_SLOT` replaced per call:
    ``Template({"text": _SLOT, ...})("hi") == event({"text": "hi", ...})``."""

    SLOT = _SLOT

    def __init__(self, chunk: dict):
        whole = event(chunk)
        slot = json.dumps(_SLOT)
        if whole.count(slot) != 1:
            raise ValueError(f"a template needs exactly one {slot} value, found {whole.count(slot)}")
        self.head, self.tail = whole.split(slot)

    def __call__(self, text: str) -> str:
        return f"{self.head}{json.dumps(text)}{self.tail}"
