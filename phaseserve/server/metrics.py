"""Prometheus metrics of the server (``GET /metrics``), named the way vLLM exports them (``phaseserve:`` prefix).

Per request (observed when it finishes, from the engine's own :class:`~phaseserve.engine.request.RequestMetrics`,
so the times are the engine's, not the HTTP layer's):

- ``phaseserve:time_to_first_token_seconds``, ``phaseserve:time_per_output_token_seconds``,
  ``phaseserve:e2e_request_latency_seconds`` (histograms);
- ``phaseserve:request_success_total{finished_reason}`` (length / stop -- a stop string included -- / aborted /
  error / cancelled by the client), ``phaseserve:prompt_tokens_total``, ``phaseserve:generation_tokens_total``.

From the backend after every loop iteration (:meth:`ServerMetrics.on_step`; with several engine loops -- replicas
behind one endpoint -- each reports as its own ``source`` and these are the sums over them):

- gauges ``phaseserve:num_requests_running``, ``phaseserve:num_requests_waiting``, ``phaseserve:kv_pages_used``,
  ``phaseserve:kv_pages_free``, ``phaseserve:prefix_cache_hit_rate`` (hit pages / looked-up pages since start);
- counters ``phaseserve:num_preemptions_total``, ``phaseserve:integrity_aborts_total`` (requests ended by a failed
  page-tag check, and nothing else), ``phaseserve:nonfinite_errors_total`` (requests ended by NaN/inf in the model's
  logits or attention output: ``NonFiniteLogitsError``, a model fault), ``phaseserve:prefix_cache_queries_total`` /
  ``phaseserve:prefix_cache_hits_total`` (pages).

The metrics vLLM also exports are written a second time under its ``vllm:`` prefix (:data:`VLLM_NAMES`:
requests running / waiting, TTFT, TPOT, e2e latency, request success by reason, prompt / generation tokens,
preemptions), with ``vllm:kv_cache_usage_perc``, so dashboards built for vLLM read this server; the prefix-cache
counters stay ``phaseserve:`` only (pages here, tokens in vLLM).

Each server has its own registry (several servers can live in one process, e.g. in tests).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from phaseserve.engine.request import CancelledError

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
GAUGES = {"running": "num_requests_running", "waiting": "num_requests_waiting", "kv_pages_used": "kv_pages_used",
          "kv_pages_free": "kv_pages_free"}
COUNTERS = {"preemptions": "num_preemptions", "integrity_aborts": "integrity_aborts",
            "nonfinite_errors": "nonfinite_errors",
            "prefix_lookup_pages": "prefix_cache_queries", "prefix_hit_pages": "prefix_cache_hits"}


VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "time_to_first_token_seconds",
              "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_success_total",
              "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total")


def _vllm_aliases(text: bytes) -> bytes:
    """The exposition lines of the :data:`VLLM_NAMES` metrics (and their histogram series) renamed ``vllm:``."""
    out = []
    for line in text.decode().splitlines():
        words = line.split(" ", 3)
        name = words[2] if line.startswith("#") and len(words) > 2 else line.split("{", 1)[0].split(" ", 1)[0]
        base = name.removeprefix("phaseserve:")
        if name.startswith("phaseserve:") and any(base == n or base.startswith(n.removesuffix("_total") + "_")
                                                  or base == n.removesuffix("_total") for n in VLLM_NAMES):
            out.append(line.replace("phaseserve:", "vllm:", 1) if not line.startswith("#")
                       else line.replace(name, "vllm:" + base, 1))
    return ("\n".join(out) + "\n").encode() if out else b""


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": r}
        self.ttft = Histogram("phaseserve:time_to_first_token_seconds", "Time to first token (engine clock).",
                              buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self.tpot = Histogram("phaseserve:time_per_output_token_seconds", "Mean time per output token after the "
                              "first.", buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self.e2e = Histogram("phaseserve:e2e_request_latency_seconds", "Arrival to last token (engine clock).",
                             buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self.finished = Counter("phaseserve:request_success", "Finished requests by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.prompt_tokens = Counter("phaseserve:prompt_tokens", "Prompt tokens of finished requests.",
                                     **label).labels(model_name)
        self.generation_tokens = Counter("phaseserve:generation_tokens", "Generated tokens of finished requests.",
                                         **label).labels(model_name)
        self.gauges = {k: Gauge(f"phaseserve:{name}", name.replace("_", " "), **label).labels(model_name)
                       for k, name in GAUGES.items()}
        self.hit_rate = Gauge("phaseserve:prefix_cache_hit_rate", "Prefix-cache hit pages / looked-up pages.",
                              **label).labels(model_name)
        self.counters = {k: Counter(f"phaseserve:{name}", name.replace("_", " "), **label).labels(model_name)
                         for k, name in COUNTERS.items()}
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: used / (used + free) pages (1 = full).",
                              **label).labels(model_name)
        self._seen = dict.fromkeys(COUNTERS, 0)
        self._sources: dict[int, dict] = {}  # the latest stats of each engine loop
        self._lock = threading.Lock()  # the loops report from their own threads

    def on_finish(self, handle) -> None:
        """A request finished (loop thread): its latencies, reason and token counts."""
        out = handle.output
        m = out.metrics
        reason = out.finish_reason
        if handle.stop_string:  # ended by a stop string: the server cancelled it in the engine
            reason = "stop"
        elif isinstance(out.error, CancelledError):
            reason = "cancelled"
        self.finished.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(len(out.tokens))
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e)):
            if value is not None and reason in ("length", "stop"):
                hist.observe(value)

    def on_step(self, stats: dict, source: int = 0) -> None:
        """Gauges and totals from one engine loop's backend (its thread); every loop's latest stats summed."""
        with self._lock:
            self._sources[source] = stats
            keys = set().union(*self._sources.values())
            total = {k: sum(s.get(k, 0) for s in self._sources.values()) for k in keys}
            for k, g in self.gauges.items():
                if k in total:
                    g.set(total[k])
            for k, c in self.counters.items():
                if k in total and total[k] > self._seen[k]:
                    c.inc(total[k] - self._seen[k])
                    self._seen[k] = total[k]
            if total.get("prefix_lookup_pages"):
                self.hit_rate.set(total["prefix_hit_pages"] / total["prefix_lookup_pages"])

    def render(self) -> bytes:
        """The exposition: every metric under ``phaseserve:``, and those vLLM also exports (same meaning and unit,
        :data:`VLLM_NAMES`) again under ``vllm:``, plus ``vllm:kv_cache_usage_perc``, for dashboards built for vLLM."""
        with self._lock:
            used, free = (self.gauges[k]._value.get() for k in ("kv_pages_used", "kv_pages_free"))
            self.kv_usage.set(used / (used + free) if used + free else 0.0)
        return generate_latest(self.registry) + _vllm_aliases(generate_latest(self.registry))
