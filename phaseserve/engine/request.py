"""Requests, their outputs and the typed errors a request can end with; :class:`Sequence`, the engine's state of one
request in flight (its tokens so far, prefill progress, prefix pages, swap copy), and :func:`stop_reason`, the one
finish rule (stop tokens, eos unless ``ignore_eos``, ``max_tokens``).

A :class:`Request` is what a user submits; the engine (in process or on Ray) validates it on arrival
with :func:`validate` -- the one copy of the rules -- and a bad request ends alone with ``finish_reason="error"``
and one of the :class:`RequestError` subclasses below, having allocated nothing. Every field is checked for type
and range, cheap checks first (the prompt's length against the context before its tokens one by one): token ids
are integers (numpy integers accepted, ``bool`` refused) inside the vocabulary; ``max_tokens
>= 1`` and prompt + max_tokens fit the context (``ServeConfig.max_context``, default the model's
``max_position_embeddings``, further capped by the pages one sequence may hold); ``temperature >= 0`` and ``0 <
top_p <= 1`` are finite floats; ``0 <= top_k < 2**31``; ``0 <= seed < 2**32`` (None: a fresh random seed, drawn here
and reported in ``RequestOutput.seed``); ``tenant`` is a UTF-8-encodable
``str``; the id is a ``str``; ``logprobs`` / ``prompt_logprobs`` are None (off) or in ``[0, MAX_LOGPROBS]``;
``max_tokens == 0`` only with ``prompt_logprobs`` (scoring a prompt, nothing generated); ``0 <= min_tokens <=
max_tokens``.

Log-probabilities (:class:`Logprob`) are those of the model's distribution (``log_softmax`` of the raw logits,
before temperature, top-k or top-p), as vLLM reports by default and as scoring (lm-eval's loglikelihood) needs:
``RequestOutput.logprobs`` holds one per generated token when ``Request.logprobs`` is set, and
``RequestOutput.prompt_logprobs`` one per prompt token when ``Request.prompt_logprobs`` is set (None for the first
token, which nothing predicts) -- vLLM's ``logprobs`` and ``prompt_logprobs`` sampling parameters.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phaseserve.config import ConfigError


class RequestError(ValueError):
    """Base class of every error that ends a single request."""


class EmptyPromptError(RequestError):
    pass


class PromptTooLongError(RequestError):
    pass


class InvalidTokenError(RequestError):
    pass


class InvalidParameterError(RequestError):
    pass


class DuplicateRequestError(RequestError):
    pass


class InvalidRequestIdError(RequestError):
    """The id is not a ``str`` (ids key the engine's tables, the router's and the wire protocol's)."""


class CancelledError(RequestError):
    pass


class NonFiniteLogitsError(RuntimeError):
    """NaN or inf reached this request's next token: its logits (an overflow in the model's activations: a norm whose
    mean square overflows makes its row NaN, ``model.layers.rms_norm``) or, with the integrity check on, a decode
    step's attention output (the scores overflowed, or NaN/inf was read from the pages; the guard zeroed the row so
    that it cannot spread through the batch). Not a bad request, and not a page-tag failure (that is
    :class:`~phaseserve.cache.integrity.KVIntegrityError`). The request ends with ``finish_reason="error"`` and no
    token from that step. ``where``: ``"logits"`` or ``"attention"``."""

    def __init__(self, message: str, where: str = "logits"):
        super().__init__(message)
        self.where = where

    def __reduce__(self):  # picklable with its field (it crosses process boundaries)
        return (NonFiniteLogitsError, (str(self), self.where))


def nonfinite_logits(request_id: str, num_generated: int, where: str = "logits") -> NonFiniteLogitsError:
    what = ("non-finite logits (an overflow in the model)" if where == "logits" else
            "non-finite attention output (its scores overflowed, or it read NaN/inf from its pages)")
    return NonFiniteLogitsError(f"request {request_id!r}: {what} for output token {num_generated}; nothing was "
                                f"emitted for it", where)


MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model and the ``len(top)`` most likely tokens at its position
    (``(token id, logprob)``, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob_at(arrays: tuple[np.ndarray, ...] | None, index: tuple, token: int, n_top: int | None) -> Logprob | None:
    """The :class:`Logprob` at ``index`` of a step's host logprob arrays ``(logprob, top logprobs, top ids)``, with
    ``n_top`` alternatives; None when the request did not ask (``n_top`` None) or the step computed none."""
    if arrays is None or n_top is None:
        return None
    lp, top_lp, top_ids = arrays
    top = tuple((int(t), float(v)) for t, v in zip(top_ids[index][:n_top], top_lp[index][:n_top], strict=True))
    return Logprob(int(token), float(lp[index]), top)


FINISH_REASONS = ("length", "stop", "aborted", "error")  # the only values ``RequestOutput.finish_reason`` takes


@dataclass(frozen=True)
class Request:
    """One generation request. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable them."""

    id: str
    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a fresh random seed per request (RequestOutput.seed says which)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: do not stop at the model's eos token ids
    tenant: str = ""  # salt of the prefix-cache hash chain: one tenant's prefix is never another's hit
    min_tokens: int = 0  # stop and eos tokens end the request only once this many tokens are out (finish rule)
    logprobs: int | None = None  # generated tokens' logprobs with this many top alternatives (None: off)
    prompt_logprobs: int | None = None  # prompt tokens' logprobs likewise (None: off; the prompt skips prefix hits)

    def replace(self, **kw) -> Request:
        return dataclasses.replace(self, **kw)


@dataclass
class RequestMetrics:
    """Times are ``time.perf_counter()`` seconds. ``arrival``: added to the engine; ``received``: taken in by a front
    end that queued it for the engine (the HTTP server's engine loop inbox), None when added directly; ``admitted``:
    first admitted by the scheduler (its wait in the queue ends)."""

    arrival: float = 0.0
    received: float | None = None
    admitted: float | None = None  # first given its pages (the scheduler's admission), after any wait in the queue
    first_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # one of FINISH_REASONS; a cancel is "aborted" with a CancelledError
    error: Exception | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    seed: int | None = None  # the sampling seed the request ran with (drawn when it gave none)
    logprobs: list[Logprob] | None = None  # per generated token (Request.logprobs set)
    prompt_logprobs: list[Logprob | None] | None = None  # per prompt token, None for the first (prompt_logprobs set)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request."""

    request: Request
    output: RequestOutput
    tokens: list[int]  # prompt + generated so far
    num_prompt: int  # tokens prefilled at the last admission (prompt, plus generated ones after a preemption)
    shared_pages: int = 0  # leading pages taken from the prefix cache at admission
    computed: int = 0  # prompt tokens (of num_prompt) whose KV exists: prefilling while computed < num_prompt
    hashes: tuple[int, list[bytes]] | None = None  # (num_prompt, its full pages' hash chain), computed once
    admitted_order: int = 0
    swap: Any = None  # preemption="swap": the pages held at preemption, then their KV on the host, until swapped in

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.num_prompt

    @property
    def next_position(self) -> int:
        """Position of the pending input token (the last one in ``tokens``) in the next decode step."""
        return len(self.tokens) - 1



def stop_reason(req: Request, token: int, num_generated: int, eos_ids: tuple[int, ...]) -> str | None:
    """``"stop"`` on a stop (or, unless ``ignore_eos``, eos) token past the first ``min_tokens`` (such a token
    earlier is kept, and generation goes on: the finish rule, not a mask on the logits), ``"length"`` at
    ``max_tokens``, else None."""
    stoppable = num_generated > req.min_tokens
    if stoppable and (token in req.stop_token_ids or (not req.ignore_eos and token in eos_ids)):
        return "stop"
    if num_generated >= req.max_tokens:
        return "length"
    return None



@dataclass(frozen=True)
class Limits:
    """What one deployment can hold: the bounds :func:`validate` checks a request against (built once by the engine
    from the model and serve configs)."""

    vocab_size: int
    max_context: int  # prompt + max_tokens must fit (model, serve config and per-sequence page cap)
    page_size: int
    max_pages: int  # pages one request may ever hold: min(allocatable cache pages, max_pages_per_seq)

    @classmethod
    def of(cls, cfg: Any, serve: Any, num_pages: int | None = None) -> Limits:
        """The limits of a ``ModelConfig`` + ``ServeConfig`` deployment whose decode pool has ``num_pages`` pages
        (None: unknown here, only ``max_pages_per_seq`` bounds a request)."""
        c = serve.cache
        max_pages = c.max_pages_per_seq if num_pages is None else min(num_pages - 1, c.max_pages_per_seq)
        budget = max_pages * c.page_size  # tokens one request can ever hold (page cap and pool)
        if serve.max_context is None:  # the model's context, within the budget
            return cls(cfg.vocab_size, min(cfg.context_length, budget), c.page_size, max_pages)
        if serve.max_context > cfg.context_length:
            raise ConfigError(f"ServeConfig.max_context={serve.max_context} exceeds the model's context of "
                              f"{cfg.context_length} tokens (max_position_embeddings={cfg.max_position_embeddings}, "
                              f"rope {cfg.rope.kind!r} x{cfg.rope.factor})")
        if serve.max_context > budget:
            raise ConfigError(f"ServeConfig.max_context={serve.max_context} exceeds what one request can hold: "
                              f"{max_pages} pages x {c.page_size} = {budget} tokens (CacheConfig.max_pages_per_seq="
                              f"{c.max_pages_per_seq}, pool of {num_pages} pages incl. the null page)")
        return cls(cfg.vocab_size, serve.max_context, c.page_size, max_pages)


def pages_ever(prompt_len: int, max_tokens: int, page_size: int) -> int:
    """Pages a request can ever need: positions 0 .. prompt + max_tokens - 2 are written (the last sampled token is
    never fed back; at least one decode input)."""
    return -(-(prompt_len + max(max_tokens, 2) - 1) // page_size)


U32_MAX, I32_MAX = 2**32 - 1, 2**31 - 1
F32_MAX = float(np.finfo(np.float32).max)


def _integer(rid, name: str, v: Any, lo: int, hi: int | None, err: type[RequestError] = InvalidParameterError) -> int:
    if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
        raise err(f"request {rid!r}: {name} must be an integer, got {type(v).__name__} {v!r:.40}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        raise err(f"request {rid!r}: {name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _real(rid, name: str, v: Any, ok, rule: str) -> float:
    if isinstance(v, bool | np.bool_) or not isinstance(v, int | float | np.integer | np.floating):
        raise InvalidParameterError(f"request {rid!r}: {name} must be a real number, got {type(v).__name__} {v!r:.40}")
    v = float(v)
    if not (math.isfinite(v) and abs(v) <= F32_MAX and ok(v)):
        raise InvalidParameterError(f"request {rid!r}: {name} must be finite and {rule}, got {v!r}")
    return v


def _token_ids(rid, name: str, v: Any, vocab_size: int) -> list[int]:
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            raise InvalidTokenError(f"request {rid!r}: {name} must be a 1-D integer array, got {v.dtype}{v.shape}")
        v = v.tolist()
    if not isinstance(v, list | tuple):
        raise InvalidTokenError(f"request {rid!r}: {name} must be a list of token ids, got {type(v).__name__}")
    bad = [t for t in v if isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer)
           or not 0 <= t < vocab_size]
    if bad:
        raise InvalidTokenError(f"request {rid!r}: {name} must be integer ids in [0, {vocab_size}); "
                                f"bad: {[repr(t)[:20] for t in bad[:5]]}")
    return [int(t) for t in v]


def _check_length(rid, prompt: Any, limits: Limits) -> None:
    """Raise :class:`PromptTooLongError` for a prompt (list, tuple or 1-D array) that cannot fit the context, in
    O(1): a prompt of millions of tokens is refused without reading them (the engine loop is not held up)."""
    n = len(prompt) if isinstance(prompt, list | tuple) or (isinstance(prompt, np.ndarray) and prompt.ndim == 1) \
        else None
    if n is not None and n >= limits.max_context:
        raise PromptTooLongError(f"request {rid!r}: prompt of {n} tokens does not fit the context of "
                                 f"{limits.max_context}")


def validate(req: Any, limits: Limits) -> Request:
    """Check every field of ``req`` and return it normalised (plain ``int`` token ids, tuple stop ids, ``bool``
    ignore_eos); raise the matching :class:`RequestError` otherwise. Nothing is allocated before this runs, and it
    is the one copy of these rules (the engine and the router both call it)."""
    if not isinstance(req, Request):
        raise InvalidParameterError(f"expected a phaseserve Request, got {type(req).__name__}")
    rid = req.id
    if not isinstance(rid, str):
        raise InvalidRequestIdError(f"request id must be a str, got {type(rid).__name__} {rid!r:.40}")
    _check_length(rid, req.prompt, limits)  # cheap first: a huge prompt is refused before its tokens are read
    prompt = _token_ids(rid, "prompt", req.prompt, limits.vocab_size)
    if not prompt:
        raise EmptyPromptError(f"request {rid!r}: empty prompt")
    scoring = req.prompt_logprobs is not None
    max_tokens = _integer(rid, "max_tokens", req.max_tokens, 0 if scoring else 1, None)
    if len(prompt) >= limits.max_context:
        raise PromptTooLongError(f"request {rid!r}: prompt of {len(prompt)} tokens does not fit the context of "
                                 f"{limits.max_context}")
    if len(prompt) + max_tokens > limits.max_context:
        raise InvalidParameterError(f"request {rid!r}: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the "
                                    f"context of {limits.max_context}")
    need = pages_ever(len(prompt), max_tokens, limits.page_size)
    if need > limits.max_pages:
        raise InvalidParameterError(f"request {rid!r} needs {need} pages; one request may hold {limits.max_pages}")
    if not isinstance(req.tenant, str):
        raise InvalidParameterError(f"request {rid!r}: tenant must be a str, got {type(req.tenant).__name__}")
    try:
        req.tenant.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(f"request {rid!r}: tenant is not encodable as UTF-8 ({e.reason})") from None
    if not isinstance(req.ignore_eos, bool | np.bool_):
        raise InvalidParameterError(f"request {rid!r}: ignore_eos must be a bool, got {type(req.ignore_eos).__name__}")
    lps = {k: None if getattr(req, k) is None else _integer(rid, k, getattr(req, k), 0, MAX_LOGPROBS)
           for k in ("logprobs", "prompt_logprobs")}
    return req.replace(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos), **lps,
        min_tokens=_integer(rid, "min_tokens", req.min_tokens, 0, max_tokens),
        temperature=_real(rid, "temperature", req.temperature, lambda v: v >= 0, ">= 0"),
        top_p=_real(rid, "top_p", req.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=_integer(rid, "top_k", req.top_k, 0, I32_MAX),
        seed=secrets.randbits(32) if req.seed is None else _integer(rid, "seed", req.seed, 0, U32_MAX),
        stop_token_ids=tuple(_token_ids(rid, "stop_token_ids", req.stop_token_ids, limits.vocab_size)))


def open_request(req: Any, limits: Limits, in_flight: Any) -> tuple[Request | None, RequestOutput]:
    """A new request's output: ``(the validated request, its open output)``, or ``(None, an output finished with
    finish_reason="error" and the typed error)`` for a malformed one or an id in ``in_flight`` (the engine's and
    the router's one submission path)."""
    out = RequestOutput(id=getattr(req, "id", None))
    out.metrics.arrival = time.perf_counter()
    try:
        req = validate(req, limits)
        if req.id in in_flight:
            raise DuplicateRequestError(f"request id {req.id!r} is already in use")
    except Exception as e:  # a gap in validate() must still end only this request, with a RequestError
        out.finish_reason = "error"
        out.error = e if isinstance(e, RequestError) else InvalidParameterError(
            f"request {out.id!r:.40} is malformed: {e!r:.200}")
        out.metrics.finished = time.perf_counter()
        return None, out
    out.metrics.num_prompt_tokens = len(req.prompt)
    out.seed = req.seed
    if req.logprobs is not None:
        out.logprobs = []
    if req.prompt_logprobs is not None:
        out.prompt_logprobs = [None] * len(req.prompt)
    return req, out
