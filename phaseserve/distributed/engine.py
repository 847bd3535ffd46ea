"""Disaggregated serving on Ray: :class:`RayEngine` is the in-process :class:`~phaseserve.engine.engine.Engine`
(one scheduler: admission, chunk planning, prefix reuse, preemption, the finish rule) whose prefill and decode
workers are proxies (:mod:`phaseserve.distributed.workers`) to two Ray actors
(:class:`~phaseserve.distributed.actor.PhaseActor`), each its own JAX process owning its devices::

    engine process (HTTP server / Python API)          Ray actors (any node of the cluster)
    Scheduler, page tables, finish rule  --batches, page ids, descriptors-->  prefill actor: FP8 weights, prefill pool
                                         --batches, page ids, tag changes-->  decode actor: INT4 weights, FP8 pages
                                         prefill actor ==KV over jax.experimental.transfer==> decode actor

Cluster: :func:`connect` joins the cluster at ``RayOptions.address`` or ``RAY_ADDRESS``, else starts a local one.
Placement: each phase's actor asks for ``PhaseOptions.resources`` (custom node resources, e.g. ``{"prefill": 1}``
on the node started with ``ray start --resources='{"prefill": 1}'``) and ``num_gpus``; its process sees
``devices`` JAX devices (on CPU: that many simulated host devices, through ``XLA_FLAGS`` in its
``runtime_env``).

Faults: a dead actor raises ``PeerDeadError`` in the engine; the requests whose KV it held end with it (those
that emitted nothing are requeued), Ray restarts the actor (``max_restarts``), and :meth:`RayEngine.health`
names the phase that is down until the restarted actor answers; meanwhile :meth:`RayEngine.step` waits instead
of stepping. Liveness is a heartbeat answered on the actor's own thread: an actor that has not answered one for
``heartbeat_timeout_s`` is reported *not answering* (``/health`` 503) until it does again; a call waits for an
actor that stopped answering up to ``call_timeout_s`` (it may resume: a pause, a stall), then kills it as hung,
which from there is a death like any other (``phaseserve.distributed.workers``). A transfer whose source dies or
hangs is abandoned at once rather than at ``transfer_timeout_s``. The transfer ports are behind an authenticating
gate (``transfer_gate``; ``phaseserve.distributed.gate``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from phaseserve.config import ConfigError, ModelConfig, ServeConfig
from phaseserve.distributed.actor import PhaseActor
from phaseserve.distributed.protocol import SECRET_ENV, ModelSource, deployment_secret
from phaseserve.distributed.workers import RayHandoff, RemoteDecode, RemotePrefill
from phaseserve.engine.engine import Engine
from phaseserve.engine.request import Limits
from phaseserve.engine.workers import PhaseWorkers


@dataclass
class PhaseOptions:
    """Where one phase's actor runs: custom node ``resources`` it needs (placement), ``num_gpus`` it holds."""

    resources: dict[str, float] = field(default_factory=dict)
    num_gpus: float = 0


@dataclass
class RayOptions:
    """The Ray deployment of a :class:`RayEngine`."""

    address: str | None = None  # None: RAY_ADDRESS if set, else a local cluster started here
    prefill: PhaseOptions = field(default_factory=PhaseOptions)
    decode: PhaseOptions = field(default_factory=PhaseOptions)
    jax_platforms: str | None = "cpu"  # JAX_PLATFORMS of the actors; None: JAX picks (GPU / TPU hosts)
    max_restarts: int = 8  # Ray restarts a dead actor this many times
    bind: str | None = "127.0.0.1"  # the actors' transfer servers listen here; None: each its node's Ray address
    transfer_timeout_s: float = 30.0  # a KV pull must land within this (TransferTimeoutError)
    heartbeat_timeout_s: float = 2.0  # an actor that leaves a heartbeat unanswered this long is "not answering"
    call_timeout_s: float = 30.0  # a call is abandoned (the actor killed as hung) after this long without a heartbeat
    max_call_s: float = 600.0  # ... or after this long in one call whatever the heartbeat (a step that never ends)
    transfer_gate: bool = True  # the transfer ports admit only peers that prove the deployment secret (gate.py)
    staging_pages: int = 4096  # pages a phase may hold staged for pulls
    staging_ttl_s: float = 120.0  # staged KV never pulled nor released is freed after this
    compilation_cache_dir: str | None = None  # JAX persistent compilation cache of the actors (restarts reuse it)
    start_timeout_s: float = 600.0

    @classmethod
    def from_dict(cls, d: Any) -> RayOptions:
        """From a config node (``experiment.ray``); unknown keys are refused."""
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown Ray options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        for phase in ("prefill", "decode"):
            p = dict(d.get(phase) or {})
            bad = set(p) - {"resources", "num_gpus"}
            if bad:
                raise ConfigError(f"unknown Ray options {phase}.{sorted(bad)}; known: resources, num_gpus")
            d[phase] = PhaseOptions(resources={str(k): float(v) for k, v in dict(p.get("resources") or {}).items()},
                                    num_gpus=float(p.get("num_gpus") or 0))
        return cls(**d)


def connect(options: RayOptions) -> None:
    """Join the cluster at ``options.address`` (or ``RAY_ADDRESS``); with neither, start a local one. A no-op when
    this process is connected already."""
    if ray.is_initialized():
        return
    if options.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=options.address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)


def model_config(spec: ModelSource) -> ModelConfig:
    """The model config alone (no weights): the engine process needs no weights."""
    if spec.checkpoint:
        return ModelConfig.from_hf_config(json.loads((Path(spec.checkpoint) / "config.json").read_text()))
    return ModelConfig.from_hf_config(dict(spec.hf_config))


def actor_env(options: RayOptions, num_devices: int) -> dict[str, str]:
    """The environment of a phase actor's process: its JAX platform and (on CPU) simulated device count, and the
    transfer plane's secret (this deployment's, generated here once per run when unset), so both actors sign and
    verify KV-transfer descriptors with one key."""
    deployment_secret()  # exports PHASESERVE_TRANSFER_SECRET when it was unset
    env = {SECRET_ENV: os.environ[SECRET_ENV]}
    if options.jax_platforms:
        env["JAX_PLATFORMS"] = options.jax_platforms
        if options.jax_platforms == "cpu":
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    if options.compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = options.compilation_cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def spawn(phase: str, model: ModelSource, serve: ServeConfig, options: RayOptions, **kw: Any) -> Any:
    """Start one phase's actor (not waited for): placed by the phase's resources, restarted by Ray on death."""
    m = serve.mesh
    n = m.prefill_tp if phase == "prefill" else m.decode_tp * m.decode_ep
    po = options.prefill if phase == "prefill" else options.decode
    # a "health" thread answers heartbeats beside a running call (workers.py, "Hangs")
    cls = ray.remote(concurrency_groups={"health": 1})(PhaseActor).options(
        name=None, num_cpus=0, num_gpus=po.num_gpus, resources=po.resources or None,
        max_restarts=options.max_restarts, max_task_retries=0, max_concurrency=1,
        runtime_env={"env_vars": actor_env(options, n)})
    return cls.remote(phase, model, serve, bind=options.bind, staging_pages=options.staging_pages,
                      staging_ttl_s=options.staging_ttl_s, gate=options.transfer_gate, **kw)


class RayEngine(Engine):
    """The :class:`~phaseserve.engine.engine.Engine` over a prefill actor and a decode actor (module docstring).
    Same API (``generate``, ``stream``, ``add_request`` / ``step``, ``cancel``, ``summary``), same greedy tokens."""

    def __init__(self, model: ModelSource, serve: ServeConfig, options: RayOptions | None = None,
                 attn_impl: str = "auto", matmul_impl: str = "auto"):
        if serve.mode != "disaggregated":
            raise ConfigError(f"the Ray backend serves mode='disaggregated' (got {serve.mode!r})")
        if serve.mesh.replicas != 1:
            raise ConfigError("the Ray backend runs one prefill and one decode actor (MeshConfig.replicas=1)")
        self.options = options = options or RayOptions()
        cfg = model_config(model)
        connect(options)
        kw = dict(attn_impl=attn_impl, matmul_impl=matmul_impl)
        known = serve.cache.num_pages  # the prefill pool is sized from the decode pool: start both at once if known
        decode = spawn("decode", model, serve, options, **kw)
        prefill = spawn("prefill", model, serve, options, decode_pages=known, **kw) if known else None
        self.actors: dict[str, Any] = {}
        try:
            dinfo = ray.get(decode.info.remote(), timeout=options.start_timeout_s)
            if prefill is None:
                prefill = spawn("prefill", model, serve, options, decode_pages=dinfo["num_pages"], **kw)
            pinfo = ray.get(prefill.info.remote(), timeout=options.start_timeout_s)
        except BaseException:
            for a in (decode, prefill):
                if a is not None:
                    ray.kill(a, no_restart=True)
            raise
        self.actors = {"prefill": prefill, "decode": decode}
        if options.staging_pages < pinfo["num_pages"]:  # one handoff stages at most the prefill pool's pages
            self.close()
            raise ConfigError(f"RayOptions.staging_pages={options.staging_pages} is below the prefill pool's "
                              f"{pinfo['num_pages']} pages: a handoff could never be staged")
        limits = Limits.of(cfg, serve, dinfo["num_pages"])
        c = serve.cache
        t = dict(transfer_timeout_s=options.transfer_timeout_s, call_timeout_s=options.call_timeout_s,
                 heartbeat_timeout_s=options.heartbeat_timeout_s, max_call_s=options.max_call_s)
        workers = PhaseWorkers(RemotePrefill(prefill, pinfo, limits, serve.max_prefill_tokens, **t),
                               RemoteDecode(decode, dinfo, c.max_pages_per_seq, c.integrity, **t))
        super().__init__(cfg, None, serve, attn_impl, matmul_impl, handoff=RayHandoff(), workers=workers)

    @classmethod
    def from_hydra(cls, hydra_cfg: Any) -> RayEngine:
        """From a composed ``configs/config.yaml`` tree; the Ray options come from ``experiment.ray``."""
        from phaseserve.config_hydra import serve_config

        model = ModelSource.from_hydra(hydra_cfg)
        exp = hydra_cfg.get("experiment") or {}
        engine_cfg = hydra_cfg.get("engine") or {}
        return cls(model, serve_config(hydra_cfg, model_config(model)), RayOptions.from_dict(exp.get("ray")),
                   engine_cfg.get("attn_impl", "auto"), engine_cfg.get("matmul_impl", "auto"))

    @property
    def phases(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode}

    def health(self) -> str | None:
        """None while both actors serve; else which phase is down (dead, restarting, or its death not yet handled
        by the engine) or not answering its heartbeat (for ``heartbeat_timeout_s``: hung, stopped, unreachable).
        Never blocks (``/health`` calls it from the HTTP event loop)."""
        bad = []
        for p, w in self.phases.items():
            w.probe(0)
            state = w.state()
            if state is not None:
                bad.append(f"the {p} actor is {state}")
        return "; ".join(bad) or None

    def step(self, after_prefill: Any = None) -> list[tuple[str, int]]:
        """One scheduling round once both actors are up. A death noticed between steps (a failed ping) is handled
        first: the requests whose KV it held end or are requeued; while an actor restarts, the round waits up to
        0.1 s and steps nothing."""
        self._handle_deaths()
        if not all(w.probe(0.1) for w in self.phases.values() if w.down):
            return []
        return super().step(after_prefill)

    def _handle_deaths(self) -> None:
        for w in self.phases.values():
            if w.lost is not None:  # noticed by a health ping: the requests whose KV it held end or are requeued
                self._device_failure([], w.lost)

    @property
    def has_work(self) -> bool:
        """Requests in flight, or an actor death to handle or a restart to wait for (the server's loop steps then,
        so a death noticed while idle is handled and /health turns 200 again once the actor is back)."""
        return super().has_work or any(w.lost is not None or w.down for w in self.phases.values())

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Block until both actors are up (after a restart), handling a noticed death on the way."""
        end = time.monotonic() + timeout_s
        while True:
            self._handle_deaths()
            if all([w.probe(0.5) for w in self.phases.values()]):
                return
            if time.monotonic() > end:
                raise TimeoutError(f"the actors did not come back within {timeout_s}s: {self.health()}")

    def check_invariants(self) -> None:
        super().check_invariants()
        self.decode.tables.check_invariants()
        self.prefill.tables.check_invariants()

    def close(self) -> None:
        """Stop both actors (for good: no restart)."""
        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        self.actors = {}
