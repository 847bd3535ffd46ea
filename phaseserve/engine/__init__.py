"""The serving engine: requests, scheduler, prefill and decode workers, KV handoff, metrics; data-parallel
replicas of it (``replicas``)."""

from phaseserve.engine.engine import Engine, EngineBusyError
from phaseserve.engine.replicas import ReplicatedEngine
from phaseserve.engine.request import (
    FINISH_REASONS,
    CancelledError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidParameterError,
    InvalidRequestIdError,
    InvalidTokenError,
    PromptTooLongError,
    Request,
    RequestError,
    RequestOutput,
)

__all__ = ["FINISH_REASONS", "CancelledError", "DuplicateRequestError", "EmptyPromptError", "Engine",
           "EngineBusyError", "InvalidParameterError", "InvalidRequestIdError", "InvalidTokenError",
           "PromptTooLongError", "ReplicatedEngine", "Request", "RequestError", "RequestOutput"]
