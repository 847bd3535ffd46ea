"""Building and running the server from a composed Hydra config (``configs/server.yaml``).

``python -m phaseserve.server [overrides]`` and ``experiments/server.py`` both end in :func:`serve`. The config is
the experiments' tree (``configs/config.yaml``: model, quant, cache, mesh, engine) plus the server's settings in
its ``experiment`` node:

- ``experiment.backend=engine``: one process; ``engine.mode`` colocated or disaggregated (prefill and decode on their
  own meshes, each with its own weight representation -- ``quant=phase`` by default);
- ``experiment.backend=ray``: disaggregated serving on Ray (:class:`phaseserve.distributed.RayEngine`): the same
  engine, its prefill and decode workers in Ray actors that own their devices (``experiment.ray``: the cluster
  address -- else ``RAY_ADDRESS``, else a local cluster --, per-phase node resources, restarts).

The tokenizer is the checkpoint's own: the byte-level one (:mod:`phaseserve.data.tokenizer`) for the shipped default
model, else its Hugging Face tokenizer and chat template (``AutoTokenizer``); a checkpoint without one is refused
with a :class:`~phaseserve.ConfigError`.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from phaseserve.config import ConfigError
from phaseserve.config_hydra import repo_path
from phaseserve.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose(overrides: list[str] = ()) -> DictConfig:
    """``configs/server.yaml`` with command-line style ``overrides`` (``experiment.port=8001 quant=f32``). Inside a
    running Hydra app (an experiment's ``@hydra.main`` over ``configs/``) it composes through that app's search
    path, which is the same directory."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="server", overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="server", overrides=list(overrides))


def tokenizer_of(cfg: DictConfig) -> ByteTokenizer | HFTokenizer:
    """The checkpoint's tokenizer (:func:`~phaseserve.data.tokenizer.load_tokenizer`: the byte-level one, or its
    own Hugging Face tokenizer); random weights of a preset: bytes (as good as any ids; vocab checked in serve)."""
    m = cfg.model
    if not m.get("checkpoint"):
        return ByteTokenizer()
    path = repo_path(m.checkpoint)
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:  # no tokenizer files AutoTokenizer can read
        raise ConfigError(f"the server needs the checkpoint's tokenizer (tokenizer.json / tokenizer_config.json) in "
                          f"{path}: {type(e).__name__}: {e}") from None


def build_backend(cfg: DictConfig) -> Any:
    """The engine backend the config asks for (weights loaded, engine built, or its Ray actors started); with
    ``mesh.replicas`` > 1 (engine backend), a list of them: the engines of a :class:`phaseserve.ReplicatedEngine`,
    one per device block, each to be driven by its own loop thread."""
    from phaseserve.server.loop import EngineBackend

    backend = cfg.experiment.backend
    if backend == "engine":
        from phaseserve.engine import Engine, ReplicatedEngine

        if int(cfg.mesh.get("replicas", 1)) > 1:
            return [EngineBackend(e) for e in ReplicatedEngine.from_hydra(cfg).engines]
        return EngineBackend(Engine.from_hydra(cfg))
    if backend != "ray":
        raise ConfigError(f"experiment.backend must be 'engine' or 'ray', got {backend!r}")
    from phaseserve.distributed import RayEngine

    return EngineBackend(RayEngine.from_hydra(cfg))


def use_compilation_cache(cfg: DictConfig) -> None:
    """JAX's persistent compilation cache in ``jax_cache_dir`` (``configs/config.yaml``; null: off), so a restarted
    server loads what an earlier one compiled (its warm-up included) instead of compiling it again. A
    ``JAX_COMPILATION_CACHE_DIR`` in the environment wins."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or not cfg.get("jax_cache_dir"):
        return
    d = repo_path(cfg.jax_cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def warm_up(backends: list, mode: str) -> None:
    """Compile every shape the engines can run before the server answers ``/health`` (``Engine.warm_up``), and
    say so: ``mode`` ``all``; ``none`` (only the handoff's chunk sizes and the integrity tracker's tag-update
    sizes, both cheap); ``auto`` (default): ``all`` on an accelerator, ``none`` on a CPU, where one shape of the
    default model compiles in ~20 s (a 2-core machine)."""
    if mode not in ("auto", "all", "none"):
        raise ConfigError(f"experiment.warmup must be auto, all or none, got {mode!r}")
    import jax

    engines = [b.engine for b in backends if hasattr(b, "engine")]
    if mode == "auto":
        mode = "none" if jax.default_backend() == "cpu" else "all"
    t0 = time.perf_counter()
    for e in engines:
        if mode == "all":
            counts = e.warm_up()
        else:
            counts = {"handoff_sizes": e.warm_handoff(), "tag_sync_sizes": e.decode.warm_tags()}
    if engines:
        what = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items())
        print(f"phaseserve: warm-up {mode}: compiled {what} per engine in {time.perf_counter() - t0:.1f} s"
              + ("" if mode == "all" else "; other shapes compile on first use (experiment.warmup=all)"),
              flush=True)
        if counts.get("shapes_left"):
            print(f"phaseserve: warm-up stopped with {counts['shapes_left']} shapes left (they compile on first use): "
                  "the process holds most of the kernel's memory-map limit (vm.max_map_count), past which the next "
                  "XLA CPU compile crashes; raise it (sysctl -w vm.max_map_count=262144) to warm every shape",
                  flush=True)


def serve(cfg: DictConfig) -> None:
    """Build the backend and serve HTTP until interrupted (uvicorn)."""
    import uvicorn

    from phaseserve.server.app import create_app

    tok = tokenizer_of(cfg)
    use_compilation_cache(cfg)
    backend = build_backend(cfg)
    backends = backend if isinstance(backend, list) else [backend]
    vocab = backends[0].limits.vocab_size
    if isinstance(tok, ByteTokenizer) and (vocab > tok.vocab_size or vocab < 256 + 5):
        raise ConfigError(f"the model's vocabulary ({vocab}) does not fit the byte tokenizer")
    if not isinstance(tok, ByteTokenizer) and tok.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens, the model's vocabulary {vocab}")
    s = cfg.experiment
    warm_up(backends, str(s.get("warmup", "auto")))
    where = f", {len(backends)} replicas" if len(backends) > 1 else ""
    print(f"phaseserve: serving {s.model_name!r} ({s.backend} backend{where}) on http://{s.host}:{s.port}/v1",
          flush=True)
    keys = {str(k): str(v) for k, v in (s.get("api_keys") or {}).items()}
    metrics_key = s.get("metrics_key")
    limit, cap = s.get("max_body_bytes"), s.get("max_in_flight")
    app = create_app(backend, tok, str(s.model_name), stream_interval=int(s.stream_interval), api_keys=keys,
                     metrics_key=None if metrics_key is None else str(metrics_key),
                     max_body_bytes=None if limit is None else int(limit),
                     max_in_flight=None if cap is None else int(cap), replica_fill=replica_fill(cfg))
    uvicorn.run(app, host=str(s.host), port=int(s.port), log_level=str(s.log_level))


def replica_fill(cfg: DictConfig) -> int | None:
    """``experiment.replica_fill`` of a server config: requests packed per replica before the next takes any."""
    fill = cfg.experiment.get("replica_fill")
    return None if fill is None else int(fill)


def http_stack() -> dict[str, str]:
    """What uvicorn's ``"auto"`` settings (used by :func:`serve` and :func:`start_in_thread`) pick here: the
    ``uvloop`` event loop and the ``httptools`` parser when they are installed (dependencies of this package), else
    asyncio's loop and ``h11``."""
    return {"loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
            "http": "httptools" if importlib.util.find_spec("httptools") else "h11"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_in_thread(app: Any, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 60.0,
                    log_level: str = "warning", keep_alive_s: float = 5.0) -> tuple[Any, threading.Thread, str]:
    """Serve ``app`` with uvicorn in a daemon thread (tests, benchmarks); returns (server, thread, base URL).
    ``keep_alive_s``: how long an idle client connection is kept open (uvicorn's default, 5 s; a benchmark whose
    client keeps its connections between runs sets it above the gap between them). Stop it with
    ``server.should_exit = True; thread.join()``."""
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=server.run, name="phaseserve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.05)
    return server, thread, f"http://{host}:{port}"
