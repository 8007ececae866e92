"""Prometheus metrics, named as vLLM's (vllm/v1/metrics/loggers.py) with the prefix `g4ops:` and a `model_name`
label, so dashboards made for vLLM read them. Each app has its own registry (several servers in one process, as in
the tests, do not share counts). The engine's gauges are read from `engine.stats()` when scraped.

Latencies are measured where the client would see them: from the request's arrival to the first token reaching
the HTTP side (TTFT), between consecutive tokens (ITL), and to the last (end to end)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

PREFIX = "g4ops:"
# vLLM's bucket edges (seconds) for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _EngineCollector:
    """Scrape-time gauges from the engine's thread-safe stats snapshot."""

    def __init__(self, engine, model_name: str):
        self._engine, self._labels = engine, [model_name]

    def collect(self):
        stats = self._engine.stats()
        values = (("num_requests_running", "Requests holding a KV slot (prefill or decode).", stats.running),
                  ("num_requests_waiting", "Requests waiting for a KV slot.", stats.waiting),
                  ("kv_slots_in_use", "KV cache slots (batch rows) held by requests.", stats.kv_slots_in_use),
                  ("kv_slots_total", "KV cache slots (batch rows) in the engine.", stats.kv_slots_total),
                  ("kv_cache_usage_perc", "Fraction of KV cache slots in use (1 = full).",
                   stats.kv_slots_in_use / stats.kv_slots_total if stats.kv_slots_total else 0.0))
        for name, doc, value in values:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(self._labels, value)
            yield family


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        labels, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=reg).labels(model_name)
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          [*labels, "finished_reason"], registry=reg)
        self.finished = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        reg.register(_EngineCollector(engine, model_name))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
