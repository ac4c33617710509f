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

#: An engine step, and the time between two tokens of a sequence: milliseconds to a minute.
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: Time to first token: vLLM's buckets (up to 2560 s: a request may wait long in a full queue).
_FIRST_TOKEN_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0),
    *(80.0, 160.0, 640.0, 2560.0),
)
#: A whole request: vLLM's buckets (up to 2 hours; a CPU writes a long answer in minutes), with finer ones below 0.3 s
#: for small models.
_REQUEST_BUCKETS = (
    *(0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


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

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.step_time = histogram("pluginhost_engine_step_seconds", "Time of one engine step", _STEP_BUCKETS)
        self.ttft = histogram(
            "pluginhost_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            _FIRST_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "pluginhost_inter_token_latency_seconds",
            "Time between two consecutive tokens of a sequence (one observation per token after the first, as vLLM's)",
            _STEP_BUCKETS,
        )
        self.request_tpot = histogram(
            "pluginhost_request_time_per_output_token_seconds",
            "A request's mean time per output token: from its first token to its last, over its tokens after the first",
            _STEP_BUCKETS,
        )
        self.e2e = histogram(
            "pluginhost_e2e_request_latency_seconds", "From a request's arrival to its end", _REQUEST_BUCKETS
        )

    def record_step(self, stats: EngineStats) -> None:
        """An engine step's figures (called by the engine loop's thread)."""
        self.running.labels(self._model).set(stats.num_running - stats.num_finished)
        self.waiting.labels(self._model).set(stats.num_waiting)
        self.prompt_tokens.labels(self._model).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(self._model).inc(stats.num_generated_tokens)
        self.preemptions.labels(self._model).inc(stats.num_preempted)
        self.step_time.labels(self._model).observe(stats.step_time_s)
        itl = self.itl.labels(self._model)
        for gap in stats.token_gaps_s:
            itl.observe(gap)

    def record_request(
        self,
        *,
        finish_reasons: Sequence[str],
        arrival: float,
        first_token: float | None,
        last_token: float | None,
        end: float,
        tokens: int,
    ) -> None:
        """A finished request: why each of its samples ended, and its latencies (monotonic seconds)."""
        for reason in finish_reasons:
            self.finished.labels(self._model, reason).inc()
        self.e2e.labels(self._model).observe(end - arrival)
        if first_token is not None:
            self.ttft.labels(self._model).observe(first_token - arrival)
            if tokens > 1 and last_token is not None:
                self.request_tpot.labels(self._model).observe((last_token - first_token) / (tokens - 1))

    def record_queue(self, running: int, waiting: int) -> None:
        """The batch and the queue as they are now (at a scrape: no step may follow an abort)."""
        self.running.labels(self._model).set(running)
        self.waiting.labels(self._model).set(waiting)

    def record_http(self, route: str, status: int) -> None:
        self.http_requests.labels(self._model, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
