"""Prometheus metrics of a server (``GET /metrics``), through ``prometheus_client``.

Each server has its own ``CollectorRegistry``, so several apps in one process
(tests, embedders) never clash. Engine gauges are refreshed after every
engine step; request counters and latencies when a request ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pluginhost.engine.core import EngineStats

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)


class ServerMetrics:
    """The metrics of one served model."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        self.http_requests = counter(
            "pluginhost_http_requests", "HTTP requests by route and status", ("route", "status")
        )
        self.finished = counter(
            "pluginhost_request_success",
            "Samples finished (one per choice of an answer, as vLLM counts them), by reason",
            ("finish_reason",),
        )
        self.prompt_tokens = counter("pluginhost_prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("pluginhost_generation_tokens", "Tokens generated")
        self.preemptions = counter(
            "pluginhost_num_preemptions", "Sequences preempted for memory (to be recomputed when they run again)"
        )
        self.running = Gauge("pluginhost_num_requests_running", "Sequences running", labels, registry=self.registry)
        self.waiting = Gauge("pluginhost_num_requests_waiting", "Sequences waiting", labels, registry=self.registry)
        self.step_time = Histogram(
            "pluginhost_engine_step_seconds",
            "Time of one engine step",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pluginhost_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pluginhost_time_per_output_token_seconds",
            "Time between output tokens of a request (its decode time over its tokens after the first)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pluginhost_e2e_request_latency_seconds",
            "From a request's arrival to its end",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def record_step(self, stats: EngineStats) -> None:
        """An engine step's figures (called by the engine loop's thread)."""
        self.running.labels(self._model).set(stats.num_running - stats.num_finished)
        self.waiting.labels(self._model).set(stats.num_waiting)
        self.prompt_tokens.labels(self._model).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(self._model).inc(stats.num_generated_tokens)
        self.preemptions.labels(self._model).inc(stats.num_preempted)
        self.step_time.labels(self._model).observe(stats.step_time_s)

    def record_request(
        self, *, finish_reasons: Sequence[str], arrival: float, first_token: float | None, end: float, tokens: int
    ) -> None:
        """A finished request: why each of its samples ended, and its latencies (monotonic seconds)."""
        for reason in finish_reasons:
            self.finished.labels(self._model, reason).inc()
        self.e2e.labels(self._model).observe(end - arrival)
        if first_token is not None:
            self.ttft.labels(self._model).observe(first_token - arrival)
            if tokens > 1:
                self.itl.labels(self._model).observe((end - first_token) / (tokens - 1))

    def record_queue(self, running: int, waiting: int) -> None:
        """The batch and the queue as they are now (at a scrape: no step may follow an abort)."""
        self.running.labels(self._model).set(running)
        self.waiting.labels(self._model).set(waiting)

    def record_http(self, route: str, status: int) -> None:
        self.http_requests.labels(self._model, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
