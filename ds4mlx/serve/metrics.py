"""GET /metrics: the Prometheus text format through `prometheus_client` (docs/http-api.md §9.3).

Names follow vLLM's (`vllm:` -> `ds4mlx:`) where it has a counterpart, else llama.cpp's
(`prompt_tokens_seconds`, `predicted_tokens_seconds`); HTTP requests are
`http_requests_total{handler,method,status}` as vLLM's instrumentator writes them.
Per-request figures come from the engine's event stream as it is emitted (a
`RequestTimer` per job, on the engine thread); whole-process counters are read at
scrape time from what GET /v1/ds4mlx/stats serves (`stats_doc`).  Each app has its
own registry (tests run several servers in one process).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..experts.cli import stats_of
from ..runtime.events import Finish, PrefillProgress, ReasoningDelta, Started, TextDelta, ToolCallStart

PREFIX = "ds4mlx:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's request-latency buckets (seconds), one set for TTFT / E2E / queue / prefill / decode
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# where a reused prompt prefix came from (the engine's reuse ladder, docs/kv-cache.md §2)
CACHE_SOURCES = ("live", "memory_checkpoint", "disk")


def cache_kind(source: str, cached: int) -> str:
    """The engine's cache source (engine/reuse.py's ladder rungs) -> live | memory_checkpoint | disk | none."""
    if cached <= 0:
        return "none"
    if source in ("memory-checkpoint", "vision-checkpoint"):
        return "memory_checkpoint"
    if source.startswith("disk"):
        return "disk"
    return "live"


def stats_doc(engine) -> dict:
    """GET /v1/ds4mlx/stats: engine counters (`prefill_tokens` = prompt tokens actually
    evaluated since start), the disk KV cache's and the expert cache's."""
    cache_stats = getattr(engine.cache, "stats", None)
    checkpoints = getattr(engine, "checkpoints", None)
    return {
        "engine": dict(vars(engine.stats)),
        "live_tokens": len(engine.session) if engine.session is not None else 0,
        "memory_checkpoint_restores": getattr(checkpoints, "restored", 0),
        "kv_disk_cache": cache_stats() if callable(cache_stats) else None,
        "expert_cache": stats_of(engine.model),  # --stream-experts (None: all experts resident)
        "vision": getattr(engine, "vision", None) is not None,  # image parts accepted (--vision)
    }


class RequestTimer:
    """Monotonic times of one job's events, taken as the engine emits them."""

    def __init__(self) -> None:
        self.submitted = time.monotonic()
        self.left_queue: float | None = None  # the first PrefillProgress: the job runs
        self.started: float | None = None  # prefill done
        self.first_token: float | None = None  # the first output event
        self.finished: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cache_source = "none"

    def see(self, ev: Any) -> None:
        now = time.monotonic()
        if isinstance(ev, PrefillProgress):
            if self.left_queue is None:
                self.left_queue = now
        elif isinstance(ev, Started):
            self.started = now
            self.prompt_tokens, self.cached_tokens = ev.prompt_tokens, ev.cached_tokens
            self.cache_source = cache_kind(ev.cache_source, ev.cached_tokens)
        elif isinstance(ev, (TextDelta, ReasoningDelta, ToolCallStart)):
            if self.first_token is None and (getattr(ev, "text", None) or isinstance(ev, ToolCallStart)):
                self.first_token = now
        elif self.finished is None and (isinstance(ev, Finish) or hasattr(ev, "status")):
            self.finished = now

    def span(self, a: float | None, b: float | None) -> float:
        return max(0.0, b - a) if a is not None and b is not None else 0.0

    @property
    def queue_s(self) -> float:
        return self.span(self.submitted, self.left_queue or self.started or self.finished)

    @property
    def prefill_s(self) -> float:
        return self.span(self.left_queue, self.started)

    @property
    def decode_s(self) -> float:
        return self.span(self.started, self.finished)

    @property
    def total_s(self) -> float:
        return self.span(self.submitted, self.finished)


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self._lock = threading.Lock()
        self._prefill = [0, 0.0]  # tokens evaluated by prefill, seconds (completed requests)
        self._decode = [0, 0.0]
        p = PREFIX
        self.http_requests = Counter(
            "http_requests", "HTTP requests by route, method and status", ["handler", "method", "status"], registry=r
        )
        self.request_success = Counter(
            p + "request_success", "Finished generation requests by finish reason", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the KV caches (live, checkpoints, disk)", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens reused instead of prefilled, by source", ["source"], registry=r
        )
        self.cache_requests = Counter(
            p + "prefix_cache_requests", "Requests by where their reused prefix came from", ["source"], registry=r
        )
        for s in CACHE_SOURCES:  # every series exists from the start (rates need a zero)
            self.prefix_hits.labels(s)
            self.cache_requests.labels(s)
        self.cache_requests.labels("none")

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(p + name, doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first output token")
        self.itl = hist("inter_token_latency_seconds", "Time per output token after the first", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue_time = hist("request_queue_time_seconds", "Time waiting for a slot")
        self.prefill_time = hist("request_prefill_time_seconds", "Time prefilling the prompt")
        self.decode_time = hist("request_decode_time_seconds", "Time generating")
        Gauge(p + "num_requests_running", "Requests running in a slot", registry=r).set_function(
            lambda: len(engine.running)
        )
        Gauge(p + "num_requests_waiting", "Requests waiting in the queue", registry=r).set_function(
            lambda: engine.queue_depth
        )
        Gauge(p + "num_slots", "Resident session slots (--batched-session)", registry=r).set_function(
            lambda: engine.slots
        )
        Gauge(p + "prompt_tokens_seconds", "Average prefill throughput (tokens/s)", registry=r).set_function(
            lambda: self._rate(self._prefill)
        )
        Gauge(p + "predicted_tokens_seconds", "Average decode throughput (tokens/s)", registry=r).set_function(
            lambda: self._rate(self._decode)
        )
        r.register(_EngineCollector(engine))

    def _rate(self, acc: list) -> float:
        with self._lock:
            return acc[0] / acc[1] if acc[1] > 0 else 0.0

    def count_http(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()

    def finished(self, t: RequestTimer, ev: Any) -> None:
        """A job's terminal event (Finish or engine.Failed)."""
        if not isinstance(ev, Finish):
            self.request_success.labels("error").inc()
            return
        u = ev.usage
        self.request_success.labels(ev.reason).inc()
        self.prompt_tokens.inc(u.prompt_tokens)
        self.generation_tokens.inc(u.completion_tokens)
        if t.started is None:  # cancelled before its prefill ended: no latencies
            return
        self.prefix_queries.inc(u.prompt_tokens)
        self.cache_requests.labels(t.cache_source).inc()
        if t.cache_source != "none":
            self.prefix_hits.labels(t.cache_source).inc(u.cached_tokens)
        self.queue_time.observe(t.queue_s)
        self.prefill_time.observe(t.prefill_s)
        self.decode_time.observe(t.decode_s)
        self.e2e.observe(t.total_s)
        n = u.completion_tokens
        if n > 0:
            self.ttft.observe(t.span(t.submitted, t.first_token or t.finished))
            per_token = t.decode_s / n
            for _ in range(n - 1):  # one observation per interval between tokens
                self.itl.observe(per_token)
        with self._lock:
            if t.prefill_s > 0:
                self._prefill[0] += u.written_tokens
                self._prefill[1] += t.prefill_s
            if n and t.decode_s > 0:
                self._decode[0] += n
                self._decode[1] += t.decode_s

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Whole-process counters read at scrape time from `stats_doc`."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        doc = stats_doc(self.engine)
        st = doc["engine"]
        p = PREFIX

        def counter(name: str, doc_: str, value) -> CounterMetricFamily:
            f = CounterMetricFamily(p + name, doc_)
            f.add_metric([], float(value or 0))
            return f

        yield counter("prefill_tokens_evaluated", "Prompt tokens evaluated by prefill", st["prefill_tokens"])
        yield counter("decode_tokens_evaluated", "Sampled tokens evaluated into a session", st["decode_tokens"])
        yield counter("requests_cancelled", "Jobs cancelled (client gone, shutdown)", st["cancelled"])
        yield counter("memory_checkpoint_restores", "In-memory checkpoints restored", doc["memory_checkpoint_restores"])
        yield counter("spec_decode_num_drafts", "Speculative verify rounds", st["spec_rounds"])
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed", st["spec_drafted"])
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", st["spec_accepted"])
        g = GaugeMetricFamily(p + "kv_live_tokens", "Tokens in the current slot's live session")
        g.add_metric([], float(doc["live_tokens"]))
        yield g
        disk = doc["kv_disk_cache"]
        if disk is not None:
            yield counter("kv_disk_cache_hits", "Disk KV checkpoint loads", disk.get("hits"))
            yield counter("kv_disk_cache_misses", "Disk KV lookups that found nothing", disk.get("misses"))
            yield counter("kv_disk_cache_hit_tokens", "Tokens loaded from disk KV checkpoints", disk.get("hit_tokens"))
        experts = doc["expert_cache"]
        if experts is not None:
            yield counter("expert_cache_hits", "Routed-expert lookups found resident", experts.get("hits"))
            yield counter("expert_cache_misses", "Routed-expert lookups read from disk", experts.get("misses"))
            yield counter("expert_cache_read_bytes", "Bytes of expert weights read", experts.get("bytes_read"))
