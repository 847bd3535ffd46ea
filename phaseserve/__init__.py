"""phaseserve: a pure-JAX research framework for serving MoE models with phase-specific representations.

Public API (see docs/design.md):

- ``load_checkpoint(path, dtype, strict=True)`` -> ``(cfg, params)`` (plain, FP8 or INT4 as stored)
- ``init_params(cfg, key, dtype)``
- ``forward(params, cfg, tokens)`` -> logits
- ``Engine(cfg, params, ServeConfig(...)).generate([Request(...)])`` -> ``RequestOutput``s
- ``ReplicatedEngine(cfg, params, ServeConfig(mesh=MeshConfig(replicas=N)))``: N data-parallel engines, same calls
- ``planner.plan(model, gpu, num_gpus, weights, kv)`` -> capacity / roofline dict
- config dataclasses: ``ModelConfig``, ``QuantConfig``, ``CacheConfig``, ``MeshConfig``, ``ServeConfig``
"""

from phaseserve import planner  # capacity and roofline model: ps.planner.plan(...)
from phaseserve.config import (
    CacheConfig,
    ConfigError,
    MeshConfig,
    ModelConfig,
    QuantConfig,
    SequenceTooLongError,
    ServeConfig,
    UnsupportedArchitectureError,
)
from phaseserve.engine import Engine, ReplicatedEngine, Request, RequestError, RequestOutput
from phaseserve.model.loader import (
    CheckpointConfigError,
    CheckpointError,
    CorruptTensorError,
    MalformedCheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    TensorDtypeError,
    UnexpectedTensorError,
    UnsafePathError,
)
from phaseserve.model.params import Params, abstract_params, init_params
from phaseserve.model.transformer import forward, prefill
from phaseserve.quant.loader import load_checkpoint  # the one loader: plain, FP8 and INT4 checkpoints

__all__ = [
    "CacheConfig", "CheckpointConfigError", "CheckpointError", "ConfigError", "CorruptTensorError", "Engine",
    "MalformedCheckpointError", "MeshConfig", "MissingTensorError", "ModelConfig", "Params", "QuantConfig",
    "ReplicatedEngine", "Request", "RequestError", "RequestOutput", "SequenceTooLongError", "ServeConfig",
    "ShapeMismatchError", "TensorDtypeError", "UnexpectedTensorError", "UnsafePathError",
    "UnsupportedArchitectureError", "abstract_params", "forward", "init_params", "load_checkpoint", "planner",
    "prefill",
]
