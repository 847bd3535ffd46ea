"""Bounds on every JSON value the server parses: nesting depth, integer digits, finite numbers, unique keys, UTF-8.

Python's ``json`` decoder, pydantic, ``jsonschema`` and the schemas' own walks recurse once or more per nesting
level, so a value nested deep enough raises ``RecursionError`` wherever it is first walked -- a 500 (issue 61: a
100k-deep tool-call ``arguments`` string). Every JSON text the server decodes goes through :func:`loads`, which
measures the text's bracket depth outside strings first (:func:`too_deep`: iterative, O(n) in a few array passes)
and refuses it before any decoder sees it, then decodes it strictly. Decoded values (and values handed to the
schemas from Python) are checked by :func:`check_value`, an iterative walk. Both raise :class:`JsonBoundsError`, a
``ValueError``: pydantic turns it into a validation error, i.e. a 400.

Limits:

- :data:`MAX_DEPTH` = 64 nested arrays / objects (``[]`` is depth 1). ``jsonschema``'s ``check_schema`` of a tool's
  ``parameters`` takes about 8 stack frames per level, so 64 levels stay well inside Python's default 1000 frames
  from inside a request handler; an OpenAI client's body is a few levels plus its tools' schemas;
- integers of at most Python's int-string limit (``sys.get_int_max_str_digits()``, 4300 digits by default);
- finite numbers: ``NaN`` / ``Infinity`` literals (not JSON) and floats that overflow (``1e999``) are refused;
- each key once per object (RFC 8259 leaves a repeated key's meaning to the parser: refused, not last-one-wins);
- strings and keys valid UTF-8 (:func:`check_value`: a lone surrogate such as ``"\\ud800"`` is refused).

Size: a request body, and so every JSON string inside it (``arguments``), is bounded by the body limit
(:mod:`phaseserve.server.security`: ``max_body_bytes``, 1 MiB by default); a generated tool call by the context.

:class:`BoundedRoute` is the FastAPI route class that decodes request bodies with :func:`loads`: a violation is a
400 in OpenAI's error shape (an ``HTTPException``, answered by the app's handler as the body limit's 413 is).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response

MAX_DEPTH = 64  # nested arrays / objects in one JSON value

_STEP = np.zeros(256, np.int8)  # byte -> depth change: +1 at "[" and "{", -1 at "]" and "}"
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


class JsonBoundsError(ValueError):
    """A JSON text or value beyond this module's limits; the message names the limit (and where it was hit)."""


def too_deep(text: str, max_depth: int = MAX_DEPTH) -> bool:
    """Whether the brackets of JSON text ``text`` outside its strings nest deeper than ``max_depth``: iterative,
    O(len(text)) in a few array passes, no Python loop per character. Malformed text is measured as it stands (the
    decoder refuses it anyway)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False  # too few brackets to nest that deep, wherever the strings are
    b = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)  # [n]; quotes, backslashes, brackets: 1 byte
    quote = b == _QUOTE  # [n] bool: quotes; escaped ones are dropped next
    if "\\" in text:
        i = np.arange(1, len(b) + 1, dtype=np.int32)  # [n] 1-based positions
        last = np.maximum.accumulate(np.where(b == _BACKSLASH, 0, i))  # [n] the last non-backslash up to here
        quote[1:] &= (i - last)[:-1] % 2 == 0  # a quote after an odd run of backslashes is escaped
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0  # [n] bool: outside every string
    depth = np.cumsum(_STEP[b] * outside, dtype=np.int32)  # [n] nesting depth after each byte
    return bool(depth.max() > max_depth)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonBoundsError(f"the key {dup!r:.80} appears twice in one object")
    return obj


def _constant(name: str) -> Any:
    raise JsonBoundsError(f"{name} is not JSON (numbers must be finite)")


def _float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise JsonBoundsError(f"the number {literal:.40} is beyond a float's range (numbers must be finite)")
    return value


def loads(text: str | bytes, what: str = "JSON") -> Any:
    """``json.loads(text)`` within the limits, else :class:`JsonBoundsError` naming ``what`` and the limit (depth:
    before any recursion). Bytes are decoded as ``json.loads`` decodes them (UTF-8, -16 or -32, a BOM allowed); a
    syntax error is ``json.JSONDecodeError`` as usual."""
    if isinstance(text, bytes | bytearray):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    if too_deep(text):
        raise JsonBoundsError(f"{what}: JSON nested deeper than {MAX_DEPTH} levels (this server's limit)")
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_constant, parse_float=_float)
    except JsonBoundsError as e:
        raise JsonBoundsError(f"{what}: {e}") from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # the int-string limit (the only other ValueError the decoder raises)
        raise JsonBoundsError(f"{what}: an integer has more than {sys.get_int_max_str_digits()} digits (this "
                              f"server's limit)") from None


def _utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PLAIN = {int, bool, type(None)}  # element types a list can hold without a look at each element
_CONTAINERS = (dict, list, tuple)


def check_value(value: Any, what: str = "body", max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`JsonBoundsError` if a decoded JSON value (dicts, lists, scalars) nests deeper than
    ``max_depth``, or holds a string or key that is not valid UTF-8 (a lone surrogate) or a non-finite float; the
    message names the dotted path under ``what``. Iterative: a value of any depth is safe to check."""
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]  # (value, its depth, its path)
    while stack:
        v, depth, path = stack.pop()
        if not isinstance(v, _CONTAINERS):
            _scalar(v, what, path)
            continue
        if depth > max_depth:
            raise JsonBoundsError(f"{_where(what, path)}: nested deeper than {max_depth} levels (this server's "
                                  f"limit)")
        if isinstance(v, dict):
            for k in v:
                if isinstance(k, str) and not k.isascii() and not _utf8(k):
                    raise JsonBoundsError(f"{_where(what, path)}: a key is not valid UTF-8 (a lone surrogate)")
            items: Any = v.items()
        elif set(map(type, v)) <= _PLAIN:  # e.g. token ids: nothing to look at
            continue
        else:
            items = enumerate(v)
        for k, x in items:
            if isinstance(x, _CONTAINERS):
                stack.append((x, depth + 1, (*path, k)))
            elif isinstance(x, str) and not x.isascii() or isinstance(x, float):  # ASCII strings are UTF-8
                _scalar(x, what, (*path, k))


def _scalar(v: Any, what: str, path: tuple) -> None:
    if isinstance(v, str) and not _utf8(v):
        raise JsonBoundsError(f"{_where(what, path)}: a string is not valid UTF-8 (a lone surrogate)")
    if isinstance(v, float) and not math.isfinite(v):
        raise JsonBoundsError(f"{_where(what, path)}: numbers must be finite, got {v}")


def _where(what: str, path: tuple) -> str:
    return ".".join(map(str, (what, *path) if what else path)) or "body"


class BoundedRequest(Request):
    """A request whose JSON body is decoded by :func:`loads`: a violation is a 400 ``HTTPException``, which FastAPI
    passes on to the app's handler (any other decoding error takes FastAPI's usual path)."""

    async def json(self) -> Any:
        if not hasattr(self, "_bounded_json"):
            try:
                self._bounded_json = loads(await self.body(), "the request body")
            except JsonBoundsError as e:
                raise HTTPException(400, str(e)) from None
        return self._bounded_json


class BoundedRoute(APIRoute):
    """FastAPI's route class (``app.router.route_class``), its handlers reading the body through
    :class:`BoundedRequest`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(BoundedRequest(request.scope, request.receive))

        return bounded
