"""Prometheus metrics of one server, in a registry of its own (never the global one).

Engine state (requests, KV blocks per cache group, preemptions, token counters) is read from
the engine at each scrape; latencies are observed by the request handlers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tqexport.runtime.engine import Engine

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily(
            "tqexport_num_requests_running", "Requests in the running batch.", value=s.running
        )
        yield GaugeMetricFamily(
            "tqexport_num_requests_waiting", "Requests waiting to run.", value=s.waiting
        )
        for name, values, what in (
            ("tqexport_kv_blocks_used", s.blocks_used, "KV cache blocks in use"),
            ("tqexport_kv_blocks_free", s.blocks_free, "KV cache blocks free"),
        ):
            family = GaugeMetricFamily(name, f"{what}, per cache group.", labels=["group"])
            for group, n in enumerate(values):
                family.add_metric([str(group)], n)
            yield family
        for name, value, what in (
            ("tqexport_num_preemptions", s.preemptions, "Requests preempted (recomputed later)."),
            ("tqexport_prompt_tokens", s.prompt_tokens, "Prompt tokens admitted."),
            ("tqexport_generation_tokens", s.generation_tokens, "Tokens generated."),
        ):
            yield CounterMetricFamily(name, what, value=value)


class Metrics:
    """The registry of one app and the metrics its handlers observe."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram(
            "tqexport_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "tqexport_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "tqexport_request_success",
            "Requests finished, by finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
