"""`cadenza bench serve --workload disaggregation`: 1 prefill + 1 decode replica against 2 colocated
replicas, on the same cores, while long prompts arrive beside running decodes.

Each arm is its own launched `cadenza serve --data-parallel-size 2` (every replica with the same
threads): `colocated` (every replica prefills and decodes), `disaggregated`
(`parallel.disaggregation: {prefill: 1, decode: 1}`). The load, over WebSocket as token ids, is
the same in both: `decodes` requests with short prompts start first and decode until the run ends;
once each has streamed a token, `long_prompts` prompts of `long_prompt_len` tokens arrive as a
Poisson process of `rate`, each asking `long_tokens` tokens. When the last long prompt has ended,
the decodes are cancelled. What it reports per arm:

- inter-token latency (ITL) p50/p99 and max of the running decodes while long prompts were
  arriving or running (a delta of n tokens after a gap g counts n gaps of g/n): a prefill that
  shares a replica's steps shows here, in the max first (one stall is one sample among the
  hundreds of tokens between arrivals, so p99 moves only once stalls are frequent);
- the long prompts' time to first token (TTFT) p50/p99;
- for the disaggregated arm, from `/metrics` (`cadenza_kv_transfer_*`): bytes and milliseconds
  per transferred token, and the blocks sent and those the decode replica already had.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

import anyio

from cadenza.bench.common.quiet import QuietPolicy
from cadenza.bench.common.report import table
from cadenza.bench.common.workload import BenchRequest
from cadenza.bench.serving.serve import WARMUP_TIMEOUT, _run_async, arrival_offsets
from cadenza.bench.serving.serve_arms import (
    ArmsCommand,
    ServerSpec,
    arm_order,
    medians,
    metrics_text,
    run_arm,
    wait_settled,
)
from cadenza.bench.serving.serve_clients import RequestRecord, WebSocketClient
from cadenza.bench.serving.serve_process import wait_idle
from cadenza.bench.serving.stats import Summary

ARMS = ("colocated", "disaggregated")
_TRANSFER = re.compile(r"^cadenza_kv_transfer_(\w+) (\S+)$", re.M)


@dataclass(frozen=True, slots=True)
class DisaggWorkload:
    decode_prompts: list[list[int]]
    decode_tokens: int
    long_prompts: list[list[int]]
    long_tokens: int
    offsets: list[float]  # seconds after the decodes' first tokens at which each long prompt is sent
    rate: float
    seed: int

    def describe(self) -> str:
        return (f"{len(self.decode_prompts)} running decodes ({len(self.decode_prompts[0])}-token prompts, up to "
                f"{self.decode_tokens} tokens, cancelled at the end), {len(self.long_prompts)} long prompts of "
                f"{len(self.long_prompts[0])} tokens ({self.long_tokens} tokens each) at {self.rate:g}/s Poisson, "
                f"greedy, ignore_eos, seed {self.seed}")  # fmt: skip

    def as_dict(self) -> dict:
        return {"decodes": len(self.decode_prompts), "decode_prompt_len": len(self.decode_prompts[0]),
                "decode_tokens": self.decode_tokens, "long_prompts": len(self.long_prompts),
                "long_prompt_len": len(self.long_prompts[0]), "long_tokens": self.long_tokens,
                "rate": self.rate, "seed": self.seed, "describe": self.describe()}  # fmt: skip


def make_disagg_workload(decodes: int, decode_prompt_len: int, decode_tokens: int, long_prompts: int,
                         long_prompt_len: int, long_tokens: int, rate: float, *, seed: int = 0, salt: str = "",
                         vocab_size: int = 10_000) -> DisaggWorkload:  # fmt: skip
    for name, value in (("--decodes", decodes), ("--decode-prompt-len", decode_prompt_len),
                        ("--decode-tokens", decode_tokens), ("--long-prompts", long_prompts),
                        ("--long-prompt-len", long_prompt_len), ("--long-tokens", long_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    rng = random.Random(f"disaggregation-{seed}-{salt}")
    top = min(vocab_size, 10_000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(top) for _ in range(n)]

    return DisaggWorkload([tokens(decode_prompt_len) for _ in range(decodes)], decode_tokens,
                          [tokens(long_prompt_len) for _ in range(long_prompts)], long_tokens,
                          arrival_offsets(long_prompts, rate, seed), rate, seed)  # fmt: skip


@dataclass(slots=True)
class TimedRecord(RequestRecord):
    """A request with the time of every streamed delta and its token count."""

    deltas: list[tuple[float, int]] = field(default_factory=list)

    def on_tokens(self, now: float, count: int) -> None:
        RequestRecord.on_tokens(self, now, count)
        self.deltas.append((now, count))


def inter_token_latencies(records: list[TimedRecord], start: float, end: float) -> list[float]:
    """Seconds between tokens of `records` whose delta arrived within [start, end]; a delta of n
    tokens after a gap g gives n latencies of g / n."""
    gaps = []
    for record in records:
        for (before, _), (now, count) in zip(record.deltas, record.deltas[1:]):
            if start <= now <= end and count:
                gaps += [(now - before) / count] * count
    return gaps


def read_transfer_metrics(url: str) -> dict[str, float]:
    return {name: float(value) for name, value in _TRANSFER.findall(metrics_text(url))}


@dataclass(slots=True)
class ArmRun:
    arm: str
    repeat: int
    itl: Summary | None  # of the running decodes while long prompts were in flight (seconds)
    itl_max: float | None  # the longest of those gaps: one stall is a single sample among many
    ttft: Summary | None  # of the long prompts (seconds)
    long_completed: int
    long_failed: list[str]
    seconds: float
    transfer: dict[str, float]  # what /metrics's cadenza_kv_transfer_* added over the run
    quiet: object = None
    server_pid: int | None = None

    def figures(self) -> dict:
        itl = self.itl and self.itl.scaled(1000)
        ttft = self.ttft and self.ttft.scaled(1000)
        t = self.transfer
        tokens = t.get("tokens_sent", 0)
        return {"itl_p50_ms": itl and itl.p50, "itl_p99_ms": itl and itl.p99,
                "itl_max_ms": None if self.itl_max is None else 1000 * self.itl_max, "ttft_p50_ms": ttft and ttft.p50,
                "ttft_p99_ms": ttft and ttft.p99,
                "bytes_per_token": t["bytes_sent"] / tokens if tokens else None,
                "transfer_ms_per_token": 1000 * t["seconds"] / tokens if tokens else None,
                "blocks_sent": t.get("blocks_sent"), "blocks_skipped": t.get("blocks_skipped")}  # fmt: skip

    def as_dict(self) -> dict:
        return {"arm": self.arm, "repeat": self.repeat, "server_pid": self.server_pid, **self.figures(),
                "itl_count": self.itl and self.itl.count, "long_completed": self.long_completed,
                "long_failed": self.long_failed, "seconds": round(self.seconds, 3), "transfer": self.transfer,
                "quiet": self.quiet.describe() if self.quiet else None}  # fmt: skip


async def run_arm_load(client: WebSocketClient, workload: DisaggWorkload, max_duration: float,
                       before_run=lambda: None) -> tuple[list[TimedRecord], list[TimedRecord], float, float]:  # fmt: skip
    """Warm up (untimed; one prompt long enough to be transferred, so a prefill replica and the
    connector have run once too), call `before_run`, then the decodes, then the long prompts at
    their offsets; returns the records and the window [first long prompt sent, last one ended]
    in perf_counter seconds."""
    decodes = [TimedRecord(i, len(p), workload.decode_tokens) for i, p in enumerate(workload.decode_prompts)]
    longs = [TimedRecord(len(decodes) + j, len(p), workload.long_tokens) for j, p in enumerate(workload.long_prompts)]
    async with client, anyio.create_task_group() as readers:
        client.start(readers)
        with anyio.move_on_after(WARMUP_TIMEOUT) as warmup:
            await client.warmup(2)
            warm = TimedRecord(-1, 48, 2)
            await client.send(0, BenchRequest([7 + (i * 13) % 97 for i in range(48)], 2), warm, "warmup-long")
        if warmup.cancelled_caught or warm.status != "completed":
            raise RuntimeError(f"the warm-up requests got no answer in {WARMUP_TIMEOUT:.0f}s: {warm.error}")
        await anyio.to_thread.run_sync(before_run)
        start = end = None
        with anyio.move_on_after(max_duration):
            async with anyio.create_task_group() as running:
                for i, prompt in enumerate(workload.decode_prompts):
                    running.start_soon(client.send, i, BenchRequest(prompt, workload.decode_tokens), decodes[i], f"d{i}")
                while any(r.first_token_at is None and r.status is None for r in decodes):
                    await anyio.sleep(0.01)
                start = time.perf_counter()

                async def long(j: int) -> None:
                    await anyio.sleep(max(0.0, start + workload.offsets[j] - time.perf_counter()))
                    index = len(decodes) + j
                    await client.send(index, BenchRequest(workload.long_prompts[j], workload.long_tokens), longs[j], f"l{j}")

                async with anyio.create_task_group() as arrivals:
                    for j in range(len(longs)):
                        arrivals.start_soon(long, j)
                end = time.perf_counter()
                if any(r.status is not None for r in decodes):
                    raise RuntimeError("a running decode ended before the long prompts did: raise --decode-tokens")
                running.cancel_scope.cancel()  # the decodes have served their purpose
        readers.cancel_scope.cancel()
    if start is None:
        raise RuntimeError(f"the running decodes streamed nothing within --max-duration {max_duration:g}s")
    return decodes, longs, start, end or time.perf_counter()


def run_arms(spec: ServerSpec, make, arms, max_duration: float, repeats: int, policy: QuietPolicy, connector: str,
             log=print) -> list[ArmRun]:  # fmt: skip
    """Each arm `repeats` times (order reversed every other repeat), each on a server of its own."""
    runs = []
    for arm, repeat in arm_order(arms, repeats):
        env = {}
        if arm == "disaggregated":
            env = {"CADENZA_PARALLEL__DISAGGREGATION__PREFILL": "1", "CADENZA_PARALLEL__DISAGGREGATION__DECODE": "1",
                   "CADENZA_PARALLEL__DISAGGREGATION__CONNECTOR": connector}  # fmt: skip

        def once(url: str, attempt: int):
            load = make("0" if attempt == 0 else str(attempt))  # fresh prompts: nothing cached from before
            wait_idle(url)
            before: dict[str, float] = {}
            client = WebSocketClient(url, len(load.decode_prompts) + len(load.long_prompts), 0.0)
            records = _run_async(lambda: run_arm_load(client, load, max_duration,
                                                      lambda: before.update(read_transfer_metrics(url))))
            wait_settled(url)
            after = read_transfer_metrics(url)
            return records, {k: after[k] - before.get(k, 0.0) for k in after if k != "in_flight"}

        ((decodes, longs, start, end), transfer), quiet, pid = run_arm(
            spec, f"{arm} #{repeat}", once, policy, extra_args=("--data-parallel-size", "2"), extra_env=env, log=log)
        done = [r for r in longs if r.status == "completed"]
        gaps = inter_token_latencies(decodes, start, end)
        run = ArmRun(arm, repeat, Summary.of(gaps), max(gaps, default=None),
                     Summary.of([r.ttft for r in done if r.ttft is not None]), len(done),
                     [f"l{r.index - len(decodes)}: {r.error}" for r in longs if r.status != "completed"],
                     end - start, transfer, quiet, pid)  # fmt: skip
        runs.append(run)
        f = run.figures()
        log(f"  {arm} #{repeat}: ITL p50 {f['itl_p50_ms'] or 0:.1f} ms, p99 {f['itl_p99_ms'] or 0:.1f} ms, max "
            f"{f['itl_max_ms'] or 0:.0f} ms; long "
            f"prompts {len(done)}/{len(longs)}, TTFT p50 {f['ttft_p50_ms'] or 0:.0f} ms ({quiet.describe()})")
    return runs


@dataclass(slots=True)
class DisaggResult:
    """What the command prints and writes: every arm's runs, of the workload made with salt "0"."""

    workload: DisaggWorkload
    connector: str
    runs: list[ArmRun]

    def render(self) -> str:
        headers = ["arm", "repeat", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "TTFT p50 ms", "TTFT p99 ms", "long done",
                   "bytes/token", "transfer ms/token", "blocks sent", "blocks skipped", "seconds", "machine"]
        rows = []
        for r in self.runs:
            f = r.figures()
            rows.append([r.arm, r.repeat, f["itl_p50_ms"], f["itl_p99_ms"], f["itl_max_ms"], f["ttft_p50_ms"],
                         f["ttft_p99_ms"], r.long_completed, f["bytes_per_token"], f["transfer_ms_per_token"],
                         f["blocks_sent"], f["blocks_skipped"], r.seconds,
                         r.quiet.describe() if r.quiet else "-"])  # fmt: skip
        lines = [table(headers, rows)]
        for arm in ARMS:
            p99 = medians([r.figures() for r in self.runs if r.arm == arm]).get("itl_p99_ms")
            if p99:
                lines.append(f"  {arm}: ITL p99 median over repeats {p99['median']:.1f} ms")
        for r in self.runs:
            lines += [f"  {r.arm} #{r.repeat}: {failure}" for failure in r.long_failed[:3]]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"workload": self.workload.as_dict(), "connector": self.connector,
                "runs": [r.as_dict() for r in self.runs]}

    @property
    def failed(self) -> bool:
        """A long prompt did not complete."""
        return any(r.long_failed for r in self.runs)


def serve_disaggregation(args) -> int:
    """`cadenza bench serve --workload disaggregation`."""
    from cadenza.bench.serving.serve_process import model_vocab_size

    command = ArmsCommand.start(args, "disaggregation", "arm", 0.5)
    vocab = args.vocab_size or model_vocab_size(args.model, args.config)

    def make(salt: str) -> DisaggWorkload:
        return make_disagg_workload(args.decodes, args.decode_prompt_len, args.decode_tokens, args.long_prompts,
                                    args.long_prompt_len, args.long_tokens, command.rate, seed=args.seed, salt=salt,
                                    vocab_size=vocab)  # fmt: skip

    workload = make("0")  # refuses bad sizes before any server starts
    command.announce(f"1 prefill + 1 decode replica ({args.connector}) against 2 colocated replicas",
                     workload.describe())
    return command.finish(lambda: DisaggResult(workload, args.connector, run_arms(
        command.spec, make, ARMS, args.max_duration, args.repeats, command.policy, args.connector)))
