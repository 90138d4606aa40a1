"""Prometheus metrics of the server: traffic, tokens, time, speculative acceptance, health.

One registry per app (not the process-global one) so that several servers in one process, as in
tests, never collide. The accept-length histogram is the speculative decoder's vital sign: its
mean is the tokens gained per target forward.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)


class Metrics:
    """The counters, gauges and histograms the supervisor and the routes update."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flashtree_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.generations = Counter("flashtree_generations", "generations the engine ended, by finish reason "
                                   "(stop, length, cancelled: the client went away or stopped it)",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("flashtree_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("flashtree_cached_tokens", "prompt tokens reused from the KV/prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("flashtree_completion_tokens", "generated tokens", registry=r)
        self.prefill_seconds = Counter("flashtree_prefill_seconds", "seconds spent in prefill", registry=r)
        self.decode_seconds = Counter("flashtree_decode_seconds", "seconds spent decoding", registry=r)
        self.snapshot_seconds = Counter("flashtree_snapshot_seconds", "seconds of prefill spent saving the live "
                                        "state to the prefix cache and restoring snapshots", registry=r)
        self.alloc_retries = Counter("flashtree_cuda_alloc_retries", "CUDA allocations that found no free "
                                     "block, so torch's allocator emptied its cache and retried (memory "
                                     "pressure; each synchronizes the device)", registry=r)
        self.decode_step_seconds = Counter("flashtree_decode_step_seconds", "seconds of decoding spent inside "
                                           "the engine's steps (the rest streamed their tokens out)", registry=r)
        self.device_mallocs = Counter("flashtree_cuda_mallocs", "cudaMalloc calls of torch's allocator during "
                                      "generations (steady decoding reuses its cached blocks and makes none)",
                                      registry=r)
        self.device_frees = Counter("flashtree_cuda_frees", "cudaFree calls of torch's allocator during "
                                    "generations (each synchronizes the device)", registry=r)
        self.decode_steps = Counter("flashtree_decode_steps", "speculative decode steps (target verify forwards)",
                                    registry=r)
        self.shared_steps = Counter("flashtree_shared_decode_steps", "decode steps whose verify forward also held "
                                    "other sequences' trees (each sequence's step counted)", registry=r)
        self.accept_length = Histogram("flashtree_accept_length", "tokens committed per decode step",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.preemptions = Counter("flashtree_preemptions", "times a running generation's KV rows were taken for "
                                   "another's pages (saved, then restored before it went on)", registry=r)
        self.preempted = Gauge("flashtree_sequences_preempted", "running generations whose KV rows were taken "
                               "for another's pages and that wait to take them back, as last reported by the "
                               "engine", registry=r)
        self.queue_depth = Gauge("flashtree_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("flashtree_requests_running", "generations running in the engine", registry=r)
        self.worker_restarts = Counter("flashtree_worker_restarts", "engine worker restarts after it died",
                                       registry=r)
        self.engine_events = Counter("flashtree_engine_events", "engine-wide events, e.g. cache_cleared",
                                     ["kind"], registry=r)
        self.cache_cleared = Counter("flashtree_cache_cleared", "times the engine dropped its device-tier "
                                     "snapshots (label: reason)", ["reason"], registry=r)
        self.oom = Counter("flashtree_oom", "out-of-memory errors the engine survived, by site", ["site"],
                           registry=r)
        self.cache_entries = Gauge("flashtree_prefix_cache_entries", "snapshots per tier, as last reported "
                                   "by the engine", ["tier"], registry=r)
        self.cache_bytes = Gauge("flashtree_prefix_cache_bytes", "snapshot bytes per tier", ["tier"], registry=r)
        self.cache_hits = Gauge("flashtree_prefix_cache_hits", "snapshot restores per tier since the engine "
                                "started", ["tier"], registry=r)
        self.sequence_tokens = Gauge("flashtree_live_sequence_tokens", "tokens each live sequence holds, as last "
                                     "reported by the engine", ["sequence"], registry=r)
        self.kv_pages = Gauge("flashtree_kv_pages", "the target's KV pages of 64 rows: total, free, and "
                              "shared (held by more than one sequence), as last reported by the engine", ["state"],
                              registry=r)
        self.cache_report: dict[str, Any] = {}

    def observe_generation(self, stats: dict[str, Any]) -> None:
        """Account one finished generation from the engine's stats dict."""
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.cached_tokens.inc(stats.get("cached_tokens", 0))
        self.completion_tokens.inc(stats.get("completion_tokens", 0))
        self.prefill_seconds.inc(max(0.0, stats.get("prefill_s", 0.0)))
        self.decode_seconds.inc(max(0.0, stats.get("decode_s", 0.0)))
        self.snapshot_seconds.inc(max(0.0, stats.get("snapshot_s", 0.0)))
        self.decode_step_seconds.inc(max(0.0, stats.get("step_s", 0.0)))
        self.alloc_retries.inc(max(0, stats.get("alloc_retries", 0)))
        self.device_mallocs.inc(max(0, stats.get("device_mallocs", 0)))
        self.device_frees.inc(max(0, stats.get("device_frees", 0)))
        accepts = stats.get("accept_lengths") or []
        self.decode_steps.inc(len(accepts))
        self.shared_steps.inc(max(0, stats.get("shared_steps", 0)))
        self.preemptions.inc(max(0, stats.get("preemptions", 0)))
        for length in accepts:
            self.accept_length.observe(length)

    def observe_event(self, kind: str, data: dict[str, Any], cache: dict[str, Any]) -> None:
        self.engine_events.labels(kind=kind).inc()
        if kind == "cache_cleared":
            self.cache_cleared.labels(reason=data.get("reason", "unknown")).inc()
            if data.get("reason") == "oom":
                self.oom.labels(site=data.get("site", "unknown")).inc()
        self.observe_cache(cache)

    def observe_cache(self, cache: dict[str, Any]) -> None:
        """Publish the engine's own cache report. The engine owns the cache; this is a read-only
        copy for /metrics and /props, never consulted for any decision."""
        if not cache:
            return
        self.cache_report = cache
        for tier, row in cache.get("tiers", {}).items():
            self.cache_entries.labels(tier=tier).set(row["entries"])
            self.cache_bytes.labels(tier=tier).set(row["bytes"])
            self.cache_hits.labels(tier=tier).set(row["hits"])
        for seq in cache.get("sequences", []):
            self.sequence_tokens.labels(sequence=str(seq["index"])).set(seq["tokens"])
        if "sequences" in cache:
            self.preempted.set(sum(bool(seq.get("preempted")) for seq in cache["sequences"]))
        for state, count in cache.get("kv_pages", {}).items():
            self.kv_pages.labels(state=state).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
