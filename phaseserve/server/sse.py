"""Server-sent events as the OpenAI streaming API writes them: ``data: <json>\\n\\n`` per chunk, ``data: [DONE]`` last.

A stream's chunks differ only in their text, so :class:`Template` renders a chunk's JSON once with a placeholder and
fills in each event's text: one ``json.dumps`` of a short string per streamed token instead of one of the whole
chunk, byte for byte the same event (key order and escaping are ``json.dumps``'s). :class:`EventStream` is the
response that writes them and stops when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that stops when the client disconnects: its iterator is cancelled at the
    await it is in (so its ``finally`` runs, e.g. to cancel the request in the engine) and the response ends quietly.

    Starlette's ``StreamingResponse`` does the same under ASGI < 2.4 (uvicorn's) with an anyio task group per
    response; here one plain asyncio task per response waits for ``http.disconnect`` and cancels the streaming task,
    a smaller cost per request. Cancelled for another reason (server shutdown), the stream re-raises."""

    def __init__(self, content: Any):
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        state = {"finished": False, "disconnected": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["finished"]:  # after the last write, uvicorn reports the completed response as one
                state["disconnected"] = True
                streaming.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["disconnected"]:
                raise
            streaming.uncancel()  # the client went away: nothing left to send, nothing to report
        finally:
            state["finished"] = True
            watcher.cancel()
