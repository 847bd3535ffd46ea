"""The server-sent-event template renders each event byte for byte as ``json.dumps`` of the whole chunk does; the
event-stream response writes every event, and on a disconnect ends quietly with its iterator closed."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from phaseserve.server.sse import EventStream, Template, event


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


class _Asgi:
    """A fake ASGI connection: ``send`` records messages; ``receive`` reports a disconnect once ``gone`` is set, or
    the completed response after the last body message (as uvicorn does)."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.gone.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def _stream(n: int, closed: list, pause: asyncio.Event | None = None):
    async def gen():
        try:
            for i in range(n):
                if pause is not None and i == 2:
                    await pause.wait()
                await asyncio.sleep(0)
                yield event({"i": i})
        finally:
            closed.append(True)

    return gen()


def test_an_event_stream_writes_every_event_and_ends():
    asgi, closed = _Asgi(), []

    async def main():
        await EventStream(_stream(5, closed))({"type": "http"}, asgi.receive, asgi.send)
        await asyncio.sleep(0.01)  # the watcher saw the completed response: it must not cancel anything now
        return asyncio.current_task().cancelling()

    assert asyncio.run(main()) == 0
    assert asgi.sent[0]["type"] == "http.response.start" and (b"content-type", b"text/event-stream; charset=utf-8") \
        in asgi.sent[0]["headers"]
    assert asgi.body == "".join(event({"i": i}) for i in range(5)).encode() and closed == [True]


def test_a_disconnect_ends_the_stream_quietly_and_closes_its_iterator():
    asgi, closed, pause = _Asgi(), [], asyncio.Event()

    async def main():
        task = asyncio.ensure_future(EventStream(_stream(5, closed, pause))({"type": "http"}, asgi.receive, asgi.send))
        while len(asgi.sent) < 3:  # start + two events, then the stream waits
            await asyncio.sleep(0)
        asgi.gone.set()  # the client goes away
        await task  # returns normally
        return task.cancelling()

    assert asyncio.run(main()) == 0
    assert closed == [True] and asgi.body == (event({"i": 0}) + event({"i": 1})).encode()


def test_a_stream_cancelled_from_outside_re_raises():
    asgi, closed, pause = _Asgi(), [], asyncio.Event()

    async def main():
        task = asyncio.ensure_future(EventStream(_stream(5, closed, pause))({"type": "http"}, asgi.receive, asgi.send))
        while len(asgi.sent) < 3:
            await asyncio.sleep(0)
        task.cancel()  # e.g. the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert closed == [True]
