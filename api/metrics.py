"""/metrics in the Prometheus text format: request and token counters, latency histograms, and
the engine's gauges read at scrape time."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cadenza.metrics import EngineMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """One registry per app, so several servers (tests) never share counters."""

    def __init__(self, engine_metrics: EngineMetrics) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cadenza_requests", "Finished requests.", ["api", "finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter("cadenza_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry)
        self.generation_tokens = Counter(
            "cadenza_generation_tokens", "Tokens generated for finished requests.", registry=self.registry
        )
        self.ttft = Histogram(
            "cadenza_time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.tpot = Histogram(
            "cadenza_time_per_output_token_seconds", "Mean time per token after the first.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "cadenza_request_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.registry.register(_EngineCollector(engine_metrics))

    def observe_ended(self, api: str, request_id: str, last) -> None:
        """Record a request whose stream ended, finished or not: one the client left (or whose
        connection dropped) before its last output counts as aborted, with no timings."""
        if last is None or not last.finished:
            from cadenza.engine.streams import GenerationOutput

            last = last or GenerationOutput(request_id, "", (), None, None, 0, 0, 0)
            last = dataclasses.replace(last, finish_reason="abort", timings=None)
        self.observe(api, last)

    def observe(self, api: str, last) -> None:
        """Record a finished request from its last `GenerationOutput`."""
        self.requests.labels(api, last.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(last.num_prompt_tokens)
        self.generation_tokens.inc(last.num_output_tokens)
        timings = last.timings
        if timings is not None:
            if timings.ttft_seconds is not None:
                self.ttft.observe(timings.ttft_seconds)
            if timings.tpot_seconds is not None:
                self.tpot.observe(timings.tpot_seconds)
            self.e2e.observe(timings.e2e_seconds)


class _EngineCollector:
    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        gauges = {
            "cadenza_requests_running": ("Requests being generated.", m.num_running),
            "cadenza_requests_waiting": ("Requests queued.", m.num_waiting),
            "cadenza_requests_active": ("Requests whose output stream is open (any stage).", m.requests_active),
            "cadenza_kv_cache_blocks_used": ("KV cache blocks held by requests.", m.kv_blocks_used),
            "cadenza_kv_cache_capacity_tokens": ("Tokens the KV cache holds in all (cache.dtype decides).", m.kv_capacity_tokens),
            "cadenza_kv_cache_usage_ratio": ("Share of KV cache blocks in use.", m.kv_usage),
            "cadenza_kv_cache_blocks_cached": ("Blocks held in the prefix cache.", m.kv_blocks_cached),
            "cadenza_prefix_cache_hit_ratio": ("Prompt tokens served from the prefix cache.", m.prefix_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "cadenza_requests_started": ("Requests the engine accepted.", m.requests_started),
            "cadenza_requests_ended": ("Accepted requests whose stream has closed.", m.requests_ended),
            "cadenza_preemptions": ("Requests preempted for lack of KV blocks.", m.num_preemptions),
            "cadenza_engine_steps": ("Engine steps run.", m.num_steps),
            "cadenza_prefill_tokens_computed": ("Prompt tokens run through the model.", m.prefill_tokens_computed),
            "cadenza_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", m.prefix_queried_tokens),
            "cadenza_prefix_cache_hits": ("Prompt tokens found in the prefix cache (tier read-backs included).",
                                          m.prefix_cached_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from _speculation_families(m)
        yield from _tier_families(m)


def _tier_families(m: EngineMetrics):
    """The prefix cache's tiers below the KV budget (host, disk), by tier."""
    families = {
        stat: CounterMetricFamily(f"cadenza_kv_tier_{name}", doc, labels=["tier"])
        for stat, name, doc in (
            ("hits", "hits", "Blocks read back from a KV tier."),
            ("bytes_read", "read_bytes", "Bytes read back from a KV tier."),
            ("bytes_written", "written_bytes", "Bytes written to a KV tier."),
            ("read_seconds", "read_seconds", "Time spent reading blocks back from a KV tier."),
            ("corrupt", "corrupt_blocks", "Blocks that failed a check on read and were recomputed."),
            ("write_errors", "write_errors", "Writes a KV tier refused."),
            ("writes_skipped", "writes_skipped", "Writes a KV tier did not try: paused, too large, or no block to evict (all pinned)."),
            ("policy_errors", "policy_errors", "Calls to a KV tier's eviction policy that raised (logged; the tier skipped the write)."),
        )
    }
    for tier, stats in sorted(m.kv_tiers.items()):
        for stat, family in families.items():
            family.add_metric([tier], getattr(stats, stat))
    yield from families.values()
    yield CounterMetricFamily("cadenza_kv_tier_writes_dropped", "Blocks not written behind: the queue was full, or evicted mid-copy.",
                              value=m.kv_tier_writes_dropped)  # fmt: skip


def _speculation_families(m: EngineMetrics):
    """Speculative decoding per proposer: steps, tokens proposed and accepted, acceptance rate."""
    steps = CounterMetricFamily("cadenza_spec_decode_steps", "Speculative request-steps, by proposer.", labels=["method"])
    proposed = CounterMetricFamily("cadenza_spec_decode_proposed_tokens", "Tokens proposed, by proposer.", labels=["method"])
    accepted = CounterMetricFamily(
        "cadenza_spec_decode_accepted_tokens", "Proposed tokens the model accepted, by proposer.", labels=["method"]
    )
    rate = GaugeMetricFamily("cadenza_spec_decode_acceptance_ratio", "Accepted over proposed tokens, by proposer.", labels=["method"])
    for method, (n, p, a) in sorted(m.speculation.items()):
        steps.add_metric([method], n)
        proposed.add_metric([method], p)
        accepted.add_metric([method], a)
        rate.add_metric([method], a / p if p else 0.0)
    yield from (steps, proposed, accepted, rate)
