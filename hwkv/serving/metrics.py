"""Prometheus metrics of the server, ``hwkv_``-prefixed, labelled with ``model_name``.

Latencies and token counts are measured in the front end as outputs arrive (what a client sees,
less the HTTP hop); scheduler and KV-cache figures come from the engine core's stats snapshot,
refreshed on each scrape. Each server owns its own registry (several may live in one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# engine stats key -> (metric name, kind, help)
CORE_METRICS = {
    "num_running": ("hwkv_num_requests_running", "gauge", "Requests in the running batch"),
    "num_waiting": ("hwkv_num_requests_waiting", "gauge", "Requests waiting to be scheduled"),
    "kv_usage": ("hwkv_kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by requests (0-1)"),
    "num_kv_blocks": ("hwkv_num_kv_blocks", "gauge", "KV cache blocks in the pool"),
    "num_free_blocks": ("hwkv_num_free_kv_blocks", "gauge", "Free KV blocks (cached-but-free included)"),
    "prefix_cache_hit_rate": ("hwkv_prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries (tokens)"),
    "prefix_cache_queries": ("hwkv_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("hwkv_prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache"),
    "num_preemptions": ("hwkv_num_preemptions", "counter", "Requests preempted (KV blocks ran out)"),
    "num_steps": ("hwkv_engine_steps", "counter", "Engine steps that scheduled tokens"),
    "prompt_tokens": ("hwkv_engine_prompt_tokens", "counter", "Prefill tokens computed by the engine "
                      "(recompute after preemption included)"),
    "busy_s": ("hwkv_engine_busy_seconds", "counter", "Wall time the engine spent stepping"),
}


class ServingMetrics(Collector):
    """Front-end observer for :class:`hwkv.serving.AsyncEngine` (``on_tokens``/``on_finished``)
    and the collector of the core's stats (``update_core``)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model = model_name
        self.core: dict[str, Any] = {}
        lab = ["model_name"]
        reg = dict(registry=self.registry)
        self.ttft = Histogram("hwkv_time_to_first_token_seconds", "Time to first token", lab,
                              buckets=LATENCY_BUCKETS, **reg).labels(model_name)
        self.itl = Histogram("hwkv_inter_token_latency_seconds", "Time between a request's successive outputs",
                             lab, buckets=LATENCY_BUCKETS, **reg).labels(model_name)
        self.e2e = Histogram("hwkv_e2e_request_latency_seconds", "Arrival to finish of a request", lab,
                             buckets=LATENCY_BUCKETS, **reg).labels(model_name)
        # plain ints, exported by collect(): incremented per request per step, a Counter's lock would show
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = Counter("hwkv_request_success", "Finished requests by finish reason",
                                lab + ["finished_reason"], **reg)
        self.registry.register(self)

    # ---- AsyncEngine observer -------------------------------------------------------------------
    def on_tokens(self, req: Any, n: int, itl: float | None) -> None:
        self.generation_tokens += n
        if itl is None:
            self.ttft.observe(req.first_token_time - req.arrival)
            self.prompt_tokens += len(req.prompt_token_ids)
        else:
            self.itl.observe(itl)

    def on_finished(self, req: Any) -> None:
        self.finished.labels(self.model, req.finish_reason).inc()
        self.e2e.observe(req.finish_time - req.arrival)

    # ---- core stats ---------------------------------------------------------------------------
    def update_core(self, stats: dict[str, Any]) -> None:
        self.core = dict(stats)

    def collect(self) -> Iterator[Any]:
        for name, doc, value in (
            ("hwkv_prompt_tokens", "Prompt tokens of requests that started generating", self.prompt_tokens),
            ("hwkv_generation_tokens", "Tokens generated", self.generation_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
        core = self.core
        for key, (name, kind, doc) in CORE_METRICS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
            if key in core:
                family.add_metric([self.model], float(core[key]))
            yield family
        for key, value in sorted((core.get("connector") or {}).items()):  # a connector's own counters
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family = CounterMetricFamily(f"hwkv_connector_{key}", f"KV connector counter {key}",
                                             labels=["model_name"])
                family.add_metric([self.model], float(value))
                yield family
