"""The default model's chat and tool-call format, and the text the server returns for generated token ids.

The shipped model was trained on ``<bos>{request}\\n`` -> ``<tool_call>{json}</tool_call><eos>``
(:class:`~phaseserve.data.toolcalls.ToolExample`). A chat is rendered in that format (:func:`render_chat`): each
system / user / tool message is its text and a newline, an earlier assistant turn is its text or its calls inside
``<tool_call>`` ... ``</tool_call>`` and ``<eos>``. ``tool_choice`` steers the model by forcing the opening of the
answer (:func:`forced_prefix`): ``"required"`` appends ``<tool_call>`` to the prompt, a named function appends
``<tool_call>{"name": "<name>", "arguments": `` -- the model continues from there.

:class:`TextStream` turns generated ids into text deltas as they arrive: UTF-8 decoded incrementally (a multi-byte
character is sent whole), special tokens dropped, ``stop`` strings matched on the text (held back while they may
still be starting) and, for chat with tools, the text from ``<tool_call>`` on kept back for
:func:`tool_calls_of`, which returns it as a call only when it is JSON within :mod:`phaseserve.server.jsonbounds`'
limits, names an offered tool and its arguments satisfy that tool's JSON schema (else the text comes back as
content; so does a call checked against a schema whose ``$ref`` loops or points nowhere).

A checkpoint with its own Hugging Face tokenizer (:class:`~phaseserve.data.tokenizer.HFTokenizer`) renders chats
with its chat template; its tool-call format is the model's own, which this server does not parse, so ``tools``
are refused for it (by name, in the app).
"""

from __future__ import annotations

import codecs
import json
import uuid
from typing import Any

from referencing.exceptions import Unresolvable

from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import extract_call, validate_call
from phaseserve.server.jsonbounds import loads
from phaseserve.server.schemas import ChatCompletionRequest, Message, NamedToolChoice


def render_chat(messages: list[Message], tok: Any, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat (the last message is what it answers): a Hugging Face tokenizer's own chat template
    (:class:`~phaseserve.data.tokenizer.HFTokenizer`, with the offered ``tools``), else the default model's format.
    The default model was trained on requests alone (no tool descriptions in its prompts): its format has no place
    for ``tools``; they act on its output (:func:`tool_calls_of`)."""
    if not isinstance(tok, ByteTokenizer):
        return tok.chat_ids([_template_message(m) for m in messages], tools)
    ids = [tok.bos_id]
    for m in messages:
        if m.role != "assistant":
            ids += tok.encode(m.text + "\n")
            continue
        ids += tok.encode(m.text)
        for c in m.tool_calls or []:
            call = {"name": c.function.name, "arguments": loads(c.function.arguments or "{}")}
            ids += [tok.tool_start_id, *tok.encode(json.dumps(call)), tok.tool_end_id]
        ids.append(tok.eos_id)
    return ids


def _template_message(m: Message) -> dict:
    """A message as chat templates read it (Hugging Face's convention: text content, call arguments as objects)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": loads(c.function.arguments or "{}")}} for c in m.tool_calls]
    return out


def forced_prefix(req: ChatCompletionRequest, tok: ByteTokenizer) -> list[int]:
    """Ids appended to the prompt so the answer starts as ``tool_choice`` demands (empty for none / auto)."""
    choice = req.tool_choice
    if not req.tools_on or choice in (None, "auto"):
        return []
    if isinstance(choice, NamedToolChoice):
        return [tok.tool_start_id, *tok.encode(f'{{"name": {json.dumps(choice.function.name)}, "arguments": ')]
    return [tok.tool_start_id]


def tool_calls_of(ids: list[int], tok: ByteTokenizer, tools: dict[str, dict]) -> list[dict] | None:
    """The OpenAI ``tool_calls`` of a generation (its forced prefix included), or None when it holds no call
    ``{"name", "arguments"}`` to one of the offered ``tools`` (name -> parameters schema) whose arguments satisfy
    that tool's schema (``jsonschema``): a call to a tool that was not offered is not a call."""
    text = extract_call(ids, tok)
    try:
        call = loads(text, "the tool call") if text is not None else None  # bounded: ValueError past the limits
    except ValueError:
        return None
    try:
        if validate_call(call, tools):
            return None
    except (RecursionError, Unresolvable):  # a schema whose $ref loops ({"$ref": "#"}) or points nowhere
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


class TextStream:
    """Generated ids -> text deltas, with ``stop`` strings and (chat with tools) the tool call held back.

    Feed ids with :meth:`feed` (returns the text that can be sent now); :attr:`stopped` turns True when a stop
    string appeared (the text ends before it; the caller cancels the request); :meth:`flush` returns what was held
    back once generation ended. :attr:`ids` are the generated ids consumed (up to the stop), :attr:`call_ids` the
    ids from ``<tool_call>`` on when tools are on.
    """

    def __init__(self, tok: Any, stops: list[str] = (), tools: dict[str, dict] | None = None,
                 forced: list[int] = (), min_tokens: int = 0):
        self.tok, self.stops, self.tools, self.min_tokens = tok, list(stops), tools, min_tokens
        self.tools_on = tools is not None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # decoded text so far (before any stop string)
        self.sent = 0  # characters of ``text`` handed out
        self.ids: list[int] = []
        self.call_ids: list[int] | None = list(forced) if forced else None
        self.stopped = False

    def _decode(self, t: int) -> str:
        if self.tok.is_special(t):
            return ""  # a skipped special does not split the bytes around it (as ByteTokenizer.decode(skip_special))
        return self._utf8.decode(self.tok.token_bytes(t))

    def feed(self, new_ids: list[int]) -> str:
        for t in new_ids:
            if self.stopped:
                break
            self.ids.append(t)
            if self.call_ids is not None:
                self.call_ids.append(t)
                continue
            if self.tools_on and t == self.tok.tool_start_id:
                self.call_ids = [t]
                continue
            self.text += self._decode(t)
            if len(self.ids) <= self.min_tokens:  # stop strings count only past min_tokens (as stop tokens)
                continue
            for s in self.stops:
                at = self.text.find(s, self.sent)
                if at >= 0:
                    self.text, self.stopped = self.text[:at], True
                    break
        return self._take(final=self.stopped)

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            for s in self.stops:  # hold back a tail that may be the start of a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        """Everything held back, once generation has ended."""
        if self.call_ids is None and not self.stopped:
            self.text += self._utf8.decode(b"", final=True)
        return self._take(final=True)

    def reply(self) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls) of the whole generation; call after :meth:`flush`. A held-back call that does not
        parse is returned as text (special tokens named)."""
        if self.call_ids is None:
            return self.text, None
        calls = tool_calls_of(self.call_ids, self.tok, self.tools)
        if calls is not None:
            return (self.text or None), calls
        return self.text + self.tok.decode(self.call_ids), None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
