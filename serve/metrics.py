"""Prometheus metrics of one server: counters the handlers move, and the engine's state read at
scrape time (a collector, so a scrape never waits for the model's thread)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "paged_decode"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.25, 2.5, 5, 10, 20, 40)


class _EngineCollector:
    """Running / waiting sequences, KV blocks and prefix-cache counters at scrape time."""

    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        for name, value, what in (("running_sequences", s["running"], "sequences decoding"),
                                  ("waiting_sequences", s["waiting"], "requests queued"),
                                  ("kv_blocks_used", s["blocks_used"], "KV pool blocks held"),
                                  ("kv_blocks_total", s["blocks_total"], "KV pool blocks")):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", what, value=value)
        cache = s["prefix_cache"] or {}
        for key, what in (("lookups", "prefix-cache lookups"), ("hits", "prefix-cache hits"),
                          ("tokens_saved", "prompt tokens not prefilled thanks to the cache")):
            yield CounterMetricFamily(f"{PREFIX}_prefix_cache_{key}", what,
                                      value=cache.get(key, 0))
        yield CounterMetricFamily(f"{PREFIX}_preemptions", "sequences preempted for recompute",
                                  value=s["preemptions"])
        for key, what in (("drafted", "tokens drafted by speculative decoding"),
                          ("accepted", "drafted tokens the model accepted")):
            yield CounterMetricFamily(f"{PREFIX}_speculative_{key}_tokens", what,
                                      value=s[f"{key}_tokens"])


class Metrics:
    """The server's registry (one per app, so several apps in one process stay apart)."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP API requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "submission to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "time between a sequence's tokens", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds",
                             "submission to last token", buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def observe(self, request) -> None:
        """One finished sequence (a scheduler ``Request``): its tokens and latencies."""
        times = request.token_times
        self.generation_tokens.inc(len(request.tokens))
        if times:
            self.ttft.observe(times[0] - request.submitted_s)
            self.e2e.observe(times[-1] - request.submitted_s)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
