"""What a serving run's records add up to: percentiles, latency summaries, throughput, counts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cadenza.bench.common.quiet import QuietReport
from cadenza.bench.serving.serve_clients import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default).

    Monotone in q, so p50 <= p90 <= p99 always holds for one set of values.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Summary:
    """Mean and p50/p90/p99 of one measure over the requests that have it."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Summary | None":
        """None for no values: a run where nothing completed has no latency to report."""
        if not values:
            return None
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), p50, p90, p99)

    def scaled(self, factor: float) -> "Summary":
        """The same summary in other units (seconds to milliseconds: 1000)."""
        return Summary(self.count, self.mean * factor, self.p50 * factor, self.p90 * factor, self.p99 * factor)

    def as_dict(self, digits: int = 3) -> dict:
        return {"count": self.count, "mean": round(self.mean, digits), "p50": round(self.p50, digits),
                "p90": round(self.p90, digits), "p99": round(self.p99, digits)}


@dataclass(slots=True)
class ServeRun:
    """One protocol at one rate: the records and what follows from them."""

    protocol: str
    rate: float
    records: list[RequestRecord]
    seconds: float
    quiet: QuietReport | None = None
    concurrency: int | None = None  # most requests in flight at once (None: as they arrive)

    @property
    def label(self) -> str:
        return load_label(self.rate, self.concurrency)

    def of_status(self, status: str) -> list[RequestRecord]:
        return [r for r in self.records if r.status == status]

    @property
    def completed(self) -> list[RequestRecord]:
        return self.of_status("completed")

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.completed)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.completed)

    def per_second(self, amount: float) -> float | None:
        return amount / self.seconds if self.seconds > 0 else None

    @property
    def requests_per_second(self) -> float | None:
        return self.per_second(len(self.completed))

    @property
    def output_tokens_per_second(self) -> float | None:
        return self.per_second(self.num_output_tokens)

    @property
    def total_tokens_per_second(self) -> float | None:
        return self.per_second(self.num_output_tokens + self.num_prompt_tokens)

    def latency(self, name: str) -> Summary | None:
        """`ttft`, `tpot` or `e2e` over the completed requests, in milliseconds."""
        summary = Summary.of([v for r in self.completed if (v := getattr(r, name)) is not None])
        return summary.scaled(1000) if summary else None

    @property
    def failures(self) -> list[dict]:
        return [{"index": r.index, "status": r.status, "reason": r.error} for r in self.records
                if r.status in ("failed", "cancelled")]

    def as_dict(self) -> dict:
        latency = {name: (s.as_dict() if (s := self.latency(name)) else None) for name in ("ttft", "tpot", "e2e")}
        return {
            "protocol": self.protocol,
            "request_rate": "inf" if math.isinf(self.rate) else self.rate,
            "max_concurrency": self.concurrency,
            "num_requests": len(self.records),
            "completed": len(self.completed),
            "failed": len(self.of_status("failed")),
            "cancelled": len(self.of_status("cancelled")),
            "seconds": round(self.seconds, 3),
            "requests_per_s": _round(self.requests_per_second),
            "output_tokens": self.num_output_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens_per_s": _round(self.output_tokens_per_second),
            "total_tokens_per_s": _round(self.total_tokens_per_second),
            "ttft_ms": latency["ttft"],
            "tpot_ms": latency["tpot"],
            "e2e_ms": latency["e2e"],
            "quiet": self.quiet.as_dict() if self.quiet else None,
            "failures": self.failures,
            "requests": [{"index": r.index, "status": r.status, "prompt_tokens": r.num_prompt_tokens,
                          "max_tokens": r.max_tokens, "output_tokens": r.num_output_tokens,
                          "streamed_tokens": r.num_streamed_tokens if self.protocol == "ws" else None,
                          "finish_reason": r.finish_reason, "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot),
                          "e2e_ms": _ms(r.e2e), "error": r.error} for r in self.records],
        }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}/s"


def load_label(rate: float, concurrency: int | None) -> str:
    """A run's load: its arrival rate, and the streams it keeps at most (`inf, 16 streams`)."""
    return rate_label(rate) + ("" if concurrency is None else f", {concurrency} streams")
