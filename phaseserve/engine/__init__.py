"""The serving engine: requests, scheduler, prefill and decode workers, KV handoff, metrics."""

from phaseserve.engine.engine import Engine
from phaseserve.engine.request import (
    CancelledError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidParameterError,
    InvalidTokenError,
    PromptTooLongError,
    Request,
    RequestError,
    RequestOutput,
)

__all__ = ["CancelledError", "DuplicateRequestError", "EmptyPromptError", "Engine", "InvalidParameterError",
           "InvalidTokenError", "PromptTooLongError", "Request", "RequestError", "RequestOutput"]
