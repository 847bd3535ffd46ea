"""``phaseserve.server``: an OpenAI-compatible HTTP server over the engine (or the multi-process router).

    python -m phaseserve.server                       # the shipped default model on http://127.0.0.1:8000/v1
    python -m phaseserve.server --port 8001 engine.mode=colocated quant=f32   # flags beside Hydra overrides
    python -m phaseserve.server --model PATH          # a checkpoint with its own tokenizer (--help)

Modules: :mod:`~phaseserve.server.schemas` (pydantic request models, OpenAI error body),
:mod:`~phaseserve.server.chat` (chat rendering, tool-call gating, incremental text),
:mod:`~phaseserve.server.logprobs` (OpenAI's logprobs shapes),
:mod:`~phaseserve.server.loop` (the engine-loop thread and its backends), :mod:`~phaseserve.server.metrics`
(Prometheus), :mod:`~phaseserve.server.app` (the FastAPI app), :mod:`~phaseserve.server.launch` (Hydra config ->
backend -> uvicorn). It holds no scheduling logic: batching, admission and preemption are the engine's.
"""

from phaseserve.server.app import create_app
from phaseserve.server.loop import EngineBackend, EngineLoop, RouterBackend

__all__ = ["EngineBackend", "EngineLoop", "RouterBackend", "create_app"]
