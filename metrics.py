"""Engine counters and gauges, kept in one place for logs, tests and the server's /metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EngineMetrics:
    """Written by the actors (each owns its fields), read by anyone; plain numbers, no locking needed."""

    # engine: requests whose stream opened, and closed (their caller has left, finished or not)
    requests_started: int = 0
    requests_ended: int = 0
    # scheduler
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0  # prompt tokens admitted
    prefill_tokens_computed: int = 0  # prompt tokens actually run through the model
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    # cache manager
    kv_blocks_total: int = 0
    kv_capacity_tokens: int = 0  # tokens the whole cache holds (an int8 cache holds ~2x bf16's)
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    prefix_hit_rate: float = 0.0
    prefix_cached_tokens: int = 0  # prompt tokens found in the prefix cache (tier read-backs included)
    prefix_queried_tokens: int = 0  # prompt tokens looked up in it
    kv_slots_allocated_peak: int = 0  # most token slots requests held at once
    kv_slots_filled_at_peak: int = 0  # of which holding (or about to hold) a token
    # tier agent: the tiers below the KV budget, by name -> their live counters (kv_tiers' TierStats:
    # hits, bytes_read, read_seconds, bytes_written, ...), and blocks the agent handled
    kv_tiers: dict[str, Any] = field(default_factory=dict)
    kv_tier_blocks_read: int = 0  # blocks read back into the KV cache for waiting requests
    kv_tier_writes_dropped: int = 0  # blocks not written behind: the queue was full, or evicted mid-copy
    # runner
    step_seconds_total: float = 0.0
    steps_ready_on_finish: int = 0  # the next step was already queued when one finished (overlap)
    # runner: speculative decoding, per proposer -> [speculative steps, tokens proposed, accepted]
    speculation: dict[str, list[int]] = field(default_factory=dict)

    def record_speculation(self, method: str, proposed: int, accepted: int) -> None:
        counts = self.speculation.setdefault(method, [0, 0, 0])
        counts[0] += 1
        counts[1] += proposed
        counts[2] += accepted

    @property
    def spec_proposed_tokens(self) -> int:
        return sum(c[1] for c in self.speculation.values())

    @property
    def spec_accepted_tokens(self) -> int:
        return sum(c[2] for c in self.speculation.values())

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over proposed tokens, all proposers together (0 before any proposal)."""
        proposed = self.spec_proposed_tokens
        return self.spec_accepted_tokens / proposed if proposed else 0.0

    @property
    def requests_active(self) -> int:
        return self.requests_started - self.requests_ended

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_unused_at_peak(self) -> float:
        """Allocated-but-unfilled slots over filled ones, at the peak of allocation."""
        filled = self.kv_slots_filled_at_peak
        return (self.kv_slots_allocated_peak - filled) / filled if filled else 0.0

    def snapshot(self) -> dict[str, float]:
        values = asdict(self)
        del values["speculation"]  # flat numbers only; the per-proposer counts are in /metrics
        del values["kv_tiers"]
        for tier, stats in self.kv_tiers.items():
            values.update({f"kv_tier_{tier}_{name}": value for name, value in asdict(stats).items()})
        values["spec_proposed_tokens"] = self.spec_proposed_tokens
        values["spec_accepted_tokens"] = self.spec_accepted_tokens
        values["spec_acceptance_rate"] = self.spec_acceptance_rate
        values["requests_active"] = self.requests_active
        values["kv_usage"] = self.kv_usage
        values["kv_unused_at_peak"] = self.kv_unused_at_peak
        return values
