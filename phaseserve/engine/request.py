"""Requests, their outputs and the typed errors a request can end with.

A :class:`Request` is what a user submits; the engine validates it on arrival (:func:`validate`) and a bad
request ends alone with ``finish_reason="error"`` and one of the :class:`RequestError` subclasses below,
having allocated nothing. ``max_tokens`` must be at least 1 and prompt + max_tokens must fit the context
(``ServeConfig.max_context``, default the model's ``max_position_embeddings``, further capped by the
pages one sequence may hold).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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


class CancelledError(RequestError):
    pass


@dataclass(frozen=True)
class Request:
    """One generation request. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable them."""

    id: str
    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: do not stop at the model's eos token ids
    tenant: str = ""  # salt of the prefix-cache hash chain: one tenant's prefix is never another's hit

    def replace(self, **kw) -> Request:
        return dataclasses.replace(self, **kw)


@dataclass
class RequestMetrics:
    """Times are ``time.perf_counter()`` seconds."""

    arrival: float = 0.0
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
    finish_reason: str | None = None  # "length" | "stop" | "aborted" | "error" | "cancelled"
    error: Exception | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def validate(req: Request, vocab_size: int, max_context: int) -> None:
    """Raise the matching :class:`RequestError` for a malformed request (nothing is allocated before this)."""
    if not isinstance(req.prompt, (list, tuple)) or len(req.prompt) == 0:
        raise EmptyPromptError(f"request {req.id!r}: empty prompt")
    bad = [t for t in req.prompt if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise InvalidTokenError(f"request {req.id!r}: token ids outside [0, {vocab_size}): {bad[:5]}")
    if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
        raise InvalidParameterError(f"request {req.id!r}: max_tokens must be >= 1, got {req.max_tokens!r}")
    if len(req.prompt) >= max_context:
        raise PromptTooLongError(f"request {req.id!r}: prompt of {len(req.prompt)} tokens does not fit the "
                                 f"context of {max_context}")
    if len(req.prompt) + req.max_tokens > max_context:
        raise InvalidParameterError(f"request {req.id!r}: prompt ({len(req.prompt)}) + max_tokens "
                                    f"({req.max_tokens}) exceeds the context of {max_context}")
    if req.temperature < 0 or not (0 < req.top_p <= 1) or req.top_k < 0:
        raise InvalidParameterError(f"request {req.id!r}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
    bad_stop = [t for t in req.stop_token_ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad_stop:
        raise InvalidTokenError(f"request {req.id!r}: stop token ids outside the vocabulary: {bad_stop[:5]}")
