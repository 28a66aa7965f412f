"""`cadenza bench serve`: a running cadenza server under load, over WebSocket sessions and the
OpenAI HTTP API.

For each protocol and each request rate, the seeded workload arrives as a Poisson process (rate
`inf`: all at once, saturation) and every request streams its tokens back; a run is bounded by
the workload's size and by `max_duration` seconds, after which what has not finished is cancelled
and counted as such. Latencies are what the client sees: TTFT from sending to the first streamed
tokens, TPOT as the mean time per output token after the first, end-to-end to the last message.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import anyio

from cadenza.bench.common.engines import EngineRun
from cadenza.bench.common.quiet import QuietPolicy
from cadenza.bench.common.report import table
from cadenza.bench.common.workload import BenchRequest, Workload
from cadenza.bench.serving.serve_clients import HTTPClient, RequestRecord, WebSocketClient
from cadenza.bench.serving.serve_process import run_quietly_here, wait_idle
from cadenza.bench.serving.stats import ServeRun, load_label

PROTOCOLS = ("ws", "http")
WARMUP_TIMEOUT = 300.0  # a first step on a big model may take a while; a hung server must not hang the bench


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the run's start at which each request is sent: a Poisson process of `rate`
    requests per second (exponential gaps, the first at 0), or all at 0 for an infinite rate.
    Seeded, so every protocol sees the same arrivals at a given rate."""
    if rate <= 0:
        raise ValueError(f"request rates must be positive (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}-{rate}")
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def run_load(client, workload: Workload, offsets: Sequence[float], max_duration: float,
                   concurrency: int | None = None) -> tuple[list[RequestRecord], float]:
    """Connect and warm up (untimed), then send each request at its offset; stop at `max_duration`.
    With `concurrency`, at most that many are in flight: a request due while they are waits for one
    to finish (at rate inf, that many streams run back to back: guidellm's concurrent profile,
    vLLM's --max-concurrency), and its TTFT counts from when it is sent.

    Returns every request's record (unfinished ones marked cancelled) and the run's seconds: from
    the first send to the last request's end, or to the deadline when it cut requests short.
    """
    records = [RequestRecord(i, len(r.prompt_token_ids), r.max_tokens) for i, r in enumerate(workload.requests)]
    async with client, anyio.create_task_group() as readers:
        client.start(readers)
        with anyio.move_on_after(WARMUP_TIMEOUT) as warmup:
            await client.warmup()
        if warmup.cancelled_caught:
            raise RuntimeError(f"the warm-up request over {client.protocol} got no answer in {WARMUP_TIMEOUT:.0f}s")
        limiter = anyio.CapacityLimiter(concurrency) if concurrency else None

        async def send(i: int, request: BenchRequest) -> None:
            if limiter is None:
                await client.send(i, request, records[i])
                return
            async with limiter:
                await client.send(i, request, records[i])

        started = time.perf_counter()
        with anyio.move_on_after(max_duration):
            async with anyio.create_task_group() as tg:
                for i, (request, offset) in enumerate(zip(workload.requests, offsets)):
                    delay = started + offset - time.perf_counter()
                    if delay > 0:
                        await anyio.sleep(delay)
                    tg.start_soon(send, i, request)
        deadline_at = time.perf_counter()
        readers.cancel_scope.cancel()
    for record in records:
        if record.status is None:
            record.status = "cancelled"
            record.error = "unfinished at --max-duration" if record.sent_at else "not sent before --max-duration"
    if any(r.status == "cancelled" for r in records):
        return records, deadline_at - started
    return records, max(r.finished_at for r in records) - started


@dataclass(slots=True)
class ServeTarget:
    """Where the load goes: the server's URL, what to call its model over HTTP, its key, and its
    process id (None when it cannot be found: its CPU then counts as another process's)."""

    url: str
    model_name: str
    api_key: str | None = None
    pid: int | None = None
    launched: bool = False


@dataclass(slots=True)
class ServePlan:
    protocols: tuple[str, ...]
    rates: tuple[float, ...]
    max_duration: float
    seed: int
    vocab_size: int  # prompt token ids are drawn below min(vocab_size, 10000), as make_workload draws them
    concurrency: tuple[int | None, ...] = (None,)  # each rate runs once per entry (None: no cap)


def with_fresh_prompts(workload: Workload, salt: str, vocab_size: int) -> Workload:
    """The same workload shape (prompt lengths, output lengths) with new random prompt tokens.

    The server keeps a prefix cache across runs: run after run of the very same prompts would be
    served mostly from it and look faster than the offline run, whose engine starts empty. Fresh
    tokens per run (and per repeat) make every run compute its prompts, as the offline run does.
    """
    rng = random.Random(f"prompts-{salt}")
    top = min(vocab_size, 10_000)
    requests = [BenchRequest([rng.randrange(top) for _ in r.prompt_token_ids], r.max_tokens) for r in workload.requests]
    return dataclasses.replace(workload, requests=requests)


@dataclass(slots=True)
class ServeResult:
    target: ServeTarget
    workload: Workload
    plan: ServePlan
    runs: list[ServeRun] = field(default_factory=list)
    offline: EngineRun | None = None
    offline_note: str = ""
    notes: list[str] = field(default_factory=list)

    def overhead(self) -> list[dict]:
        """Per protocol: serving output tok/s at saturation over offline output tok/s."""
        rows = []
        for protocol in self.plan.protocols:
            run = next((r for r in self.runs if r.protocol == protocol and math.isinf(r.rate) and r.concurrency is None),
                       None)
            row = {"protocol": protocol, "serving_output_tokens_per_s": None, "offline_output_tokens_per_s": None,
                   "serving_over_offline": None, "overhead_percent": None, "note": ""}
            if self.offline is not None:
                row["offline_output_tokens_per_s"] = round(self.offline.output_tokens_per_second, 3)
            if run is None:
                row["note"] = "no saturation run (add inf to --request-rates)"
            elif len(run.completed) != len(run.records):
                row["note"] = f"not comparable: {len(run.records) - len(run.completed)} requests did not complete"
            elif self.offline is None or self.offline.note:
                row["note"] = self.offline_note or (self.offline.note if self.offline else "no offline run")
            else:
                ratio = run.output_tokens_per_second / self.offline.output_tokens_per_second
                row.update(serving_output_tokens_per_s=round(run.output_tokens_per_second, 3),
                           serving_over_offline=round(ratio, 4), overhead_percent=round(100 * (1 - ratio), 2))
            rows.append(row)
        return rows

    def render(self) -> str:
        load = table(
            ["protocol", "rate", "completed", "failed", "cancelled", "seconds", "req/s", "output tok/s", "total tok/s",
             "machine"],
            [[r.protocol, r.label, len(r.completed), len(r.of_status("failed")), len(r.of_status("cancelled")),
              r.seconds, r.requests_per_second, r.output_tokens_per_second, r.total_tokens_per_second,
              r.quiet.describe() if r.quiet else "-"] for r in self.runs],
        )
        headers = ["protocol", "rate"] + [f"{m} {p}" for m in ("TTFT ms", "TPOT ms", "E2E ms") for p in ("p50", "p90", "p99")]
        rows = []
        for r in self.runs:
            row = [r.protocol, r.label]
            for name in ("ttft", "tpot", "e2e"):
                s = r.latency(name)
                row += [s.p50, s.p90, s.p99] if s else [None] * 3
            rows.append(row)
        lines = [load, "", table(headers, rows)]
        for run in self.runs:
            for failure in run.failures[:3]:
                lines.append(f"  {run.protocol} {run.label}: request {failure['index']} {failure['status']}: "
                             f"{failure['reason']}")
            if len(run.failures) > 3:
                lines.append(f"  {run.protocol} {run.label}: ... and {len(run.failures) - 3} more")
        overhead = self.overhead()
        if self.offline is not None or any(row["note"] for row in overhead):
            lines += ["", table(
                ["protocol", "serving output tok/s (inf)", "offline output tok/s", "serving/offline", "overhead"],
                [[o["protocol"], o["serving_output_tokens_per_s"], o["offline_output_tokens_per_s"],
                  None if o["serving_over_offline"] is None else f"{o['serving_over_offline']:.2f}",
                  None if o["overhead_percent"] is None else f"{o['overhead_percent']:.1f}%"] for o in overhead],
            )]
            lines += [f"  {o['protocol']}: {o['note']}" for o in overhead if o["note"]]
            if self.offline is not None and self.offline.quiet:
                lines.append(f"  offline: {self.offline.seconds:.1f}s ({self.offline.quiet.describe()})")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "server": {"url": self.target.url, "model": self.target.model_name, "launched": self.target.launched,
                       "pid": self.target.pid},
            "workload": self.workload.describe(),
            "plan": {"protocols": list(self.plan.protocols),
                     "request_rates": ["inf" if math.isinf(r) else r for r in self.plan.rates],
                     "max_concurrency": list(self.plan.concurrency),
                     "max_duration_s": self.plan.max_duration, "seed": self.plan.seed,
                     "prompts": "the workload's lengths with fresh token ids per run, so no run hits another's "
                                "prefix cache; the offline run uses the workload's own"},
            "runs": [r.as_dict() for r in self.runs],
            "offline": self.offline.as_dict() if self.offline else None,
            "offline_note": self.offline_note,
            "overhead": self.overhead(),
            "notes": self.notes,
        }


def run_serve(target: ServeTarget, workload: Workload, plan: ServePlan, policy: QuietPolicy,
              log: Callable[[str], None] = print) -> ServeResult:
    """Every protocol at every rate against `target`, each run on a quiet machine where possible."""
    result = ServeResult(target, workload, plan)
    if target.pid is None:
        # The server's work would read as another process's: a run would always look disturbed.
        policy = dataclasses.replace(policy, max_repeats=0)
        result.notes.append("the server's process was not found, so its CPU counts as other processes' in 'machine'")
    for protocol in plan.protocols:
        for rate in plan.rates:
            for concurrency in plan.concurrency:
                label = load_label(rate, concurrency)
                log(f"running {protocol} at {label} ...")
                offsets = arrival_offsets(workload.num_requests, rate, plan.seed)
                attempts = iter(range(1 << 30))

                def once() -> tuple[list[RequestRecord], float]:
                    if not wait_idle(target.url):
                        result.notes.append(f"the server was still busy before {protocol} at {label}")
                    salt = f"{plan.seed}-{protocol}-{rate}-{concurrency}-{next(attempts)}"
                    fresh = with_fresh_prompts(workload, salt, plan.vocab_size)
                    return _run_async(lambda: run_load(_client(protocol, target, fresh), fresh, offsets, plan.max_duration,
                                                       concurrency))

                (records, seconds), quiet = run_quietly_here(once, policy, target.pid)
                run = ServeRun(protocol, rate, records, seconds, quiet, concurrency)
                result.runs.append(run)
                log(f"  {protocol} {label}: {len(run.completed)}/{len(records)} completed, "
                    f"{run.output_tokens_per_second or 0:.1f} output tok/s in {seconds:.1f}s ({quiet.describe()})")
    return result


def _client(protocol: str, target: ServeTarget, workload: Workload):
    if protocol == "ws":
        return WebSocketClient(target.url, workload.num_requests, workload.temperature, target.api_key)
    if protocol == "http":
        return HTTPClient(target.url, workload.num_requests, workload.temperature, target.model_name, target.api_key)
    raise ValueError(f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")


def _run_async(fn):
    """anyio.run, with a lone error raised as itself rather than inside an exception group."""
    try:
        return anyio.run(fn)
    except BaseException as exc:  # (Base)ExceptionGroup is a builtin only from Python 3.11
        errors = [exc]
        while len(errors) == 1 and isinstance(getattr(errors[0], "exceptions", None), tuple):
            errors = list(errors[0].exceptions)
        if len(errors) == 1 and errors[0] is not exc:
            raise errors[0] from None
        raise
