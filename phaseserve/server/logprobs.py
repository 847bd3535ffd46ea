"""Log-probabilities in OpenAI's response shapes, from the engine's :class:`~phaseserve.engine.request.Logprob`s.

- Completions (the legacy shape lm-eval reads): ``{"tokens": [str], "token_logprobs": [float | None],
  "top_logprobs": [{str: float} | None], "text_offset": [int]}``, one entry per token of the choice's text (the
  echoed prompt's first, whose first token has no logprob: null, as OpenAI and vLLM write it).
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's string is its decoded text (a special token by its name); a token that is not whole UTF-8 on its own
(one byte of a multi-byte character) is written ``bytes:\\xNN`` as OpenAI does. ``text_offset`` is the character
offset in the choice's text where the token's text starts (a byte that begins a character is at that character).
The values are the model's distribution (raw logits' ``log_softmax``, before temperature, top-k and top-p).
"""

from __future__ import annotations

import codecs
from typing import Any

from phaseserve.engine.request import Logprob


def token_bytes(tok: Any, t: int) -> bytes:
    """The bytes of token ``t`` (a special token: its name's)."""
    return tok.token_bytes(t)


def token_string(tok: Any, t: int) -> str:
    raw = token_bytes(tok, t)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_offsets(tok: Any, ids: list[int], start: int = 0) -> list[int]:
    """The character offset (from ``start``) where each token's text starts in the decoded text of ``ids``
    (special tokens skipped), in one incremental UTF-8 pass."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, n = [], start
    for t in ids:
        out.append(n)
        if not tok.is_special(t):
            n += len(utf8.decode(token_bytes(tok, t)))
    return out


def completion_logprobs(tok: Any, ids: list[int], entries: list[Logprob | None], start: int = 0) -> dict:
    """The legacy completions ``logprobs`` object of tokens ``ids`` (their :class:`Logprob`, None for a prompt's
    first token), text offsets counted from ``start``."""
    if len(ids) != len(entries):
        raise ValueError(f"{len(ids)} tokens, {len(entries)} logprobs")
    top = []
    for e in entries:
        if e is None:
            top.append(None)
            continue
        d: dict[str, float] = {}
        for t, v in e.top:  # distinct ids can share a string (bytes:...): the likeliest is kept, as OpenAI's dict
            d.setdefault(token_string(tok, t), v)
        top.append(d)
    return {"tokens": [token_string(tok, t) for t in ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": text_offsets(tok, ids, start)}


def chat_logprobs(tok: Any, entries: list[Logprob]) -> dict:
    """The chat ``logprobs`` object of generated tokens."""
    def item(t: int, v: float) -> dict:
        return {"token": token_string(tok, t), "logprob": v, "bytes": list(token_bytes(tok, t))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries]}
