"""`cadenza bench serve --workload kv-tiers`: the prefix cache's disk tier (docs/kv-tiers.md) under
a multi-turn agent load whose working set is several times the KV budget.

Two arms, each its own launched `cadenza serve` with the same KV budget (`cache.num_blocks`):
`budget` (the KV budget alone) and `disk` (the same budget over a disk tier in a fresh temporary
directory). The load is the router bench's multi-turn conversations (router_bench.py: groups of
conversations sharing a long system prompt, each turn's prompt the last one, its answer and a new
user message), over WebSocket as token ids. Between two turns of a conversation the others push
its blocks out of the budget: the `budget` arm computes them again, the `disk` arm reads them back.

Per arm: TTFT p50/p99, output tok/s, the prefix hit rate (from each turn's usage, and from
/metrics: `cadenza_prefix_cache_hits`/`_queries`), and the disk tier's counters
(`cadenza_kv_tier_*`). `--restart` adds a restart: a disk-tier server runs the first half of every
conversation, is stopped (SIGTERM to its process group, after write-behind has settled), a new one
starts over the same directory and gets the next turn of the first conversations one at a time;
their TTFT is set against the same prompts' on a cold server with no tier.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import anyio

from cadenza.bench.common.quiet import QuietPolicy, QuietReport
from cadenza.bench.common.report import table
from cadenza.bench.common.workload import BenchRequest
from cadenza.bench.serving.router_bench import MultiTurnWorkload, make_multi_turn, run_conversations
from cadenza.bench.serving.serve import _run_async, arrival_offsets
from cadenza.bench.serving.serve_arms import ArmsCommand, ServerSpec, arm_order, medians, metrics_text, run_arm
from cadenza.bench.serving.serve_clients import RequestRecord, WebSocketClient
from cadenza.bench.serving.serve_process import wait_idle
from cadenza.bench.serving.stats import ServeRun, rate_label

ARMS = ("budget", "disk")
TARGETS = {"output_tokens_per_s": (">=", 2.0), "ttft_p99_ms": ("<=", 0.5)}  # disk over budget (issue 38)
_SAMPLE = re.compile(r'^(cadenza_[a-z_]+?)(?:_total)?(?:\{tier="(\w+)"\})? (\S+)$', re.M)


def working_set_tokens(workload: MultiTurnWorkload) -> int:
    """Distinct tokens the conversations' prompts hold in all: the shared system prompts once, and
    every user message and answer."""
    return (sum(len(p) for p in workload.system_prompts) + sum(len(m) for t in workload.user_messages for m in t)
            + sum(n for t in workload.max_tokens for n in t))


def read_cache_metrics(url: str) -> dict[str, float]:
    """The prefix cache's and the tiers' counters from /metrics (a tier's as `name:tier`)."""
    out = {}
    for name, tier, value in _SAMPLE.findall(metrics_text(url)):
        out[f"{name}:{tier}" if tier else name] = float(value)
    return out


def cache_delta(before: dict, after: dict) -> dict:
    """What a run added: prompt tokens looked up and found in the prefix cache, prompt tokens computed,
    preemptions, and the disk tier's hits, bytes and read seconds."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    queries, hits, hit_blocks = d("cadenza_prefix_cache_queries"), d("cadenza_prefix_cache_hits"), d("cadenza_kv_tier_hits:disk")
    return {"prefix_queried_tokens": int(queries), "prefix_hit_tokens": int(hits),
            "prefix_hit_rate": round(hits / queries, 4) if queries else None,
            "prefill_tokens_computed": int(d("cadenza_prefill_tokens_computed")),
            "preemptions": int(d("cadenza_preemptions")), "disk_hit_blocks": int(hit_blocks),
            "disk_read_mb": round(d("cadenza_kv_tier_read_bytes:disk") / 1e6, 2),
            "disk_read_ms_per_block": round(1000 * d("cadenza_kv_tier_read_seconds:disk") / hit_blocks, 3) if hit_blocks else None,
            "disk_written_mb": round(d("cadenza_kv_tier_written_bytes:disk") / 1e6, 2),
            "disk_writes_dropped": int(d("cadenza_kv_tier_writes_dropped")),
            "budget_tokens": int(after.get("cadenza_kv_cache_capacity_tokens", 0))}


def wait_written(url: str, timeout: float = 30.0) -> None:
    """Wait until the disk tier's written bytes stop growing for a second (write-behind settled)."""
    wait_idle(url)
    deadline, last = time.monotonic() + timeout, -1.0
    while time.monotonic() < deadline:
        now = read_cache_metrics(url).get("cadenza_kv_tier_written_bytes:disk", 0.0)
        if now == last:
            return
        last = now
        time.sleep(1.0)


@dataclass(slots=True)
class TiersRun:
    arm: str
    repeat: int
    run: ServeRun
    metrics: dict
    server_pid: int | None = None

    def figures(self) -> dict:
        done = self.run.completed
        prompt = sum(r.num_prompt_tokens for r in done)
        ttft = self.run.latency("ttft")
        return {"ttft_p50_ms": ttft and ttft.p50, "ttft_p99_ms": ttft and ttft.p99,
                "output_tokens_per_s": self.run.output_tokens_per_second,
                "prefix_hit_rate": sum(r.num_cached_tokens or 0 for r in done) / prompt if prompt else None}

    def as_dict(self) -> dict:
        return {"arm": self.arm, "repeat": self.repeat, "server_pid": self.server_pid,
                **{k: None if v is None else round(v, 4) for k, v in self.figures().items()},
                "metrics": self.metrics, **self.run.as_dict()}


@dataclass(slots=True)
class RestartResult:
    """The next turn of the first conversations, one at a time: after a restart over the disk tier,
    and on a cold server with no tier."""

    prompt_tokens: list[int]
    restarted: list[RequestRecord]
    cold: list[RequestRecord]
    restarted_metrics: dict
    quiet: list[QuietReport]

    def ttfts(self, records: list[RequestRecord]) -> list[float | None]:
        return [None if r.ttft is None else 1000 * r.ttft for r in records]

    def as_dict(self) -> dict:
        after, cold = self.ttfts(self.restarted), self.ttfts(self.cold)
        ok = [(a, c) for a, c in zip(after, cold) if a and c]
        return {"prompt_tokens": self.prompt_tokens, "ttft_after_restart_ms": after, "ttft_cold_ms": cold,
                "cached_tokens_after_restart": [r.num_cached_tokens for r in self.restarted],
                "ttft_after_restart_p50_ms": ok and statistics.median(a for a, _ in ok),
                "ttft_cold_p50_ms": ok and statistics.median(c for _, c in ok),
                "cold_over_restarted_first": ok and round(ok[0][1] / ok[0][0], 2),
                "cold_over_restarted_p50": ok and round(statistics.median(c for _, c in ok)
                                                        / statistics.median(a for a, _ in ok), 2),
                "failed": [r.error for r in self.restarted + self.cold if r.status != "completed"],
                "metrics_after_restart": self.restarted_metrics, "quiet": [q.describe() for q in self.quiet]}


@dataclass(slots=True)
class TiersResult:
    workload: MultiTurnWorkload
    kv_blocks: int
    rate: float
    max_duration: float
    runs: list[TiersRun] = field(default_factory=list)
    restart: RestartResult | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def working_set(self) -> int:
        return working_set_tokens(self.workload)

    def medians(self, arm: str) -> dict:
        return medians([r.figures() for r in self.runs if r.arm == arm])

    def ratios(self) -> dict:
        """disk over budget (medians over repeats)."""
        a, b = self.medians("disk"), self.medians("budget")
        return {k: round(a[k]["median"] / b[k]["median"], 4) if a.get(k) and b.get(k) and b[k]["median"] else None
                for k in a}

    def targets(self) -> dict:
        ratios = self.ratios()
        return {k: None if ratios.get(k) is None else (ratios[k] >= bound if op == ">=" else ratios[k] <= bound)
                for k, (op, bound) in TARGETS.items()}

    def render(self) -> str:
        headers = ["arm", "repeat", "completed", "cancelled", "failed", "seconds", "TTFT p50 ms", "TTFT p99 ms",
                   "output tok/s", "hit rate", "hit rate /metrics", "computed", "preempt", "disk hits", "read MB",
                   "ms/block", "written MB", "machine"]
        rows = []
        for r in self.runs:
            f, m = r.figures(), r.metrics
            rows.append([r.arm, r.repeat, len(r.run.completed), len(r.run.of_status("cancelled")),
                         len(r.run.of_status("failed")), r.run.seconds, f["ttft_p50_ms"], f["ttft_p99_ms"],
                         f["output_tokens_per_s"], f["prefix_hit_rate"], m["prefix_hit_rate"], m["prefill_tokens_computed"],
                         m["preemptions"], m["disk_hit_blocks"], m["disk_read_mb"], m["disk_read_ms_per_block"],
                         m["disk_written_mb"], r.run.quiet.describe() if r.run.quiet else "-"])
        lines = [table(headers, rows) if rows else "(no arms ran)"]
        if self.runs:
            ratios, met = self.ratios(), self.targets()
            lines += ["", "disk / budget (medians; TTFT: below 1 favours the disk tier):",
                      "  " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in ratios.items()),
                      "  targets: " + ", ".join(f"{k} {op} {bound}: {'-' if met[k] is None else 'met' if met[k] else 'missed'}"
                                                for k, (op, bound) in TARGETS.items())]
        if self.restart:
            r = self.restart.as_dict()
            lines += ["", f"restart: next turn of {len(r['prompt_tokens'])} conversations, one at a time "
                      f"(prompts {min(r['prompt_tokens'])}..{max(r['prompt_tokens'])} tokens)",
                      f"  TTFT after the restart (disk tier) p50 {r['ttft_after_restart_p50_ms'] or 0:.0f} ms, "
                      f"cold server without a tier p50 {r['ttft_cold_p50_ms'] or 0:.0f} ms: "
                      f"{r['cold_over_restarted_p50'] or 0:.2f}x sooner at p50, {r['cold_over_restarted_first'] or 0:.2f}x "
                      f"for the first request; cached tokens after the restart {r['cached_tokens_after_restart']}"]
        for run in self.runs:
            for failure in run.run.failures[:3]:
                lines.append(f"  {run.arm} #{run.repeat}: request {failure['index']} {failure['status']}: {failure['reason']}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"workload": self.workload.as_dict(), "kv_blocks": self.kv_blocks,
                "budget_tokens": max((r.metrics["budget_tokens"] for r in self.runs), default=None),
                "working_set_tokens": self.working_set, "request_rate": self.rate, "max_duration_s": self.max_duration,
                "medians": {arm: self.medians(arm) for arm in ARMS}, "ratios": self.ratios() if self.runs else None,
                "targets": self.targets() if self.runs else None, "runs": [r.as_dict() for r in self.runs],
                "restart": self.restart.as_dict() if self.restart else None, "notes": self.notes}

    @property
    def failed(self) -> bool:
        restart_failed = self.restart is not None and self.restart.as_dict()["failed"]
        return any(r.run.of_status("failed") for r in self.runs) or bool(restart_failed)


def _tier_args(arm: str, scratch: str, attempt: int) -> tuple[str, ...]:
    return ("--kv-disk-path", str(Path(scratch) / f"kv-{attempt}")) if arm == "disk" else ()


def run_tiers(spec: ServerSpec, make: Callable[[str], MultiTurnWorkload], kv_blocks: int, rate: float,
              max_duration: float, repeats: int, restart: int, policy: QuietPolicy,
              log: Callable[[str], None] = print) -> TiersResult:
    """Each arm `repeats` times (A B, B A, ...) on a server of its own, then (`restart` > 0) the
    restart of a disk-tier server and a cold one, over the next turn of `restart` conversations."""
    workload = make("0")
    result = TiersResult(workload, kv_blocks, rate, max_duration)
    offsets = arrival_offsets(workload.num_requests, rate, spec.seed)
    env = {"CADENZA_CACHE__NUM_BLOCKS": str(kv_blocks)}
    for arm, repeat in arm_order(ARMS, repeats):
        with tempfile.TemporaryDirectory(prefix="cadenza-kv-tiers-") as scratch:

            def once(url: str, attempt: int, arm=arm, scratch=scratch):
                load = workload if attempt == 0 else make(str(attempt))
                before: dict = {}
                client = WebSocketClient(url, load.num_conversations, load.temperature)
                records, seconds = _run_async(lambda: run_conversations(
                    client, load, offsets, max_duration, 1, lambda: before.update(read_cache_metrics(url))))
                wait_idle(url)
                return records, seconds, cache_delta(before, read_cache_metrics(url))

            # A retry's server is the same one: its tier directory already holds the first attempt's blocks,
            # but a retry's prompts are new (make(attempt)), so none of them can hit.
            (records, seconds, metrics), quiet, pid = run_arm(spec, f"{arm} #{repeat}", once, policy,
                                                              extra_args=_tier_args(arm, scratch, 0), extra_env=env, log=log)
        run = TiersRun(arm, repeat, ServeRun("ws", rate, records, seconds, quiet), metrics, pid)
        result.runs.append(run)
        f = run.figures()
        log(f"  {arm} #{repeat}: {len(run.run.completed)}/{len(records)} completed in {seconds:.1f}s, TTFT p50/p99 "
            f"{f['ttft_p50_ms'] or 0:.0f}/{f['ttft_p99_ms'] or 0:.0f} ms, {f['output_tokens_per_s'] or 0:.1f} output tok/s, "
            f"hit rate {f['prefix_hit_rate'] or 0:.2f} (/metrics {metrics['prefix_hit_rate']}), "
            f"{metrics['prefill_tokens_computed']} prompt tokens computed, {metrics['disk_hit_blocks']} disk hits ({quiet.describe()})")
    if restart:
        result.restart = run_restart(spec, workload, min(restart, workload.num_conversations), offsets, env, policy, log)
    return result


def _next_turns(workload: MultiTurnWorkload, half: int, records: list[RequestRecord], count: int) -> list[BenchRequest]:
    """Turn `half`'s prompt of the first `count` conversations: what the first half's turns built."""
    requests = []
    for c in range(count):
        history = workload.system_prompt(c) + workload.user_messages[c][0]
        for t in range(half):
            record = records[workload.slot(c, t)]
            if record.status != "completed":
                raise RuntimeError(f"restart: conversation {c} turn {t} did not complete before the restart: {record.error}")
            history = history + record.output_token_ids + workload.user_messages[c][t + 1]
        requests.append(BenchRequest(history, workload.max_tokens[c][half]))
    return requests


async def _one_at_a_time(url: str, requests: list[BenchRequest], temperature: float) -> list[RequestRecord]:
    client = WebSocketClient(url, 1, temperature)
    records = [RequestRecord(i, len(r.prompt_token_ids), r.max_tokens) for i, r in enumerate(requests)]
    async with client, anyio.create_task_group() as readers:
        client.start(readers)
        for i, (request, record) in enumerate(zip(requests, records)):
            await client.send(i, request, record, request_id=f"after-{i}")
        readers.cancel_scope.cancel()
    return records


def run_restart(spec: ServerSpec, workload: MultiTurnWorkload, count: int, offsets: list[float], env: dict,
                policy: QuietPolicy, log: Callable[[str], None]) -> RestartResult:
    """The first half of every conversation on a disk-tier server, a restart over its directory, the
    next turn of `count` conversations one at a time; then the same prompts on a cold server, no tier.
    No retries: a second attempt would find the first one's blocks."""
    if workload.num_turns < 2:
        raise ValueError("--restart needs at least 2 --turns (half before the restart, the next turn after it)")
    half = workload.num_turns // 2
    first = dataclasses.replace(workload, user_messages=[m[:half] for m in workload.user_messages],
                                max_tokens=[n[:half] for n in workload.max_tokens], order=workload.order[:half])
    once = dataclasses.replace(policy, max_repeats=0)
    with tempfile.TemporaryDirectory(prefix="cadenza-kv-restart-") as scratch:
        tier = ("--kv-disk-path", str(Path(scratch) / "kv"))

        def before_restart(url: str, attempt: int):
            client = WebSocketClient(url, first.num_conversations, first.temperature)
            records, _ = _run_async(lambda: run_conversations(client, first, offsets, 600.0, 1))
            wait_written(url)  # then run_arm stops the server: SIGTERM to its process group
            return records

        records, quiet_before, pid = run_arm(spec, f"restart: turns 1..{half} with the disk tier", before_restart, once,
                                             extra_args=tier, extra_env=env, log=log)
        log(f"  stopped pid {pid} (SIGTERM); starting a new server over the same directory")
        requests = _next_turns(workload, half, records, count)

        def after(url: str, attempt: int):
            before = read_cache_metrics(url)
            done = _run_async(lambda: _one_at_a_time(url, requests, workload.temperature))
            return done, cache_delta(before, read_cache_metrics(url))

        (restarted, metrics), quiet_after, _ = run_arm(spec, "restart: the new server", after, once, extra_args=tier,
                                                       extra_env=env, log=log)
    cold, quiet_cold, _ = run_arm(spec, "restart: a cold server, no tier", lambda url, attempt: _run_async(
        lambda: _one_at_a_time(url, requests, workload.temperature)), once, extra_args=(), extra_env=env, log=log)
    result = RestartResult([len(r.prompt_token_ids) for r in requests], restarted, cold, metrics,
                           [quiet_before, quiet_after, quiet_cold])
    r = result.as_dict()
    log(f"  after the restart: TTFT p50 {r['ttft_after_restart_p50_ms'] or 0:.0f} ms against "
        f"{r['ttft_cold_p50_ms'] or 0:.0f} ms cold ({r['cold_over_restarted_p50']}x)")
    return result


def serve_kv_tiers(args) -> int:
    """`cadenza bench serve --workload kv-tiers`: the KV budget alone and over a disk tier."""
    from cadenza.bench.serving.serve_process import model_vocab_size

    command = ArmsCommand.start(args, "kv-tiers", "arm", 8.0, (("--kv-blocks", args.kv_blocks),
                                                                ("--restart-requests", args.restart_requests)))
    vocab = args.vocab_size or model_vocab_size(args.model, args.config)

    def make(salt: str) -> MultiTurnWorkload:
        return make_multi_turn(args.conversations, args.system_prompts, args.turns, args.system_len, tuple(args.user_len),
                               tuple(args.output_len), seed=args.seed, salt=salt, vocab_size=vocab,
                               temperature=args.temperature)

    workload = make("0")  # refuses bad sizes before any server starts
    budget = args.kv_blocks * 16
    working = working_set_tokens(workload)
    command.announce(f"the KV budget ({args.kv_blocks} blocks) alone and over a disk tier",
                     f"{workload.describe()}; {rate_label(command.rate)} Poisson; working set {working} tokens, "
                     f"KV budget {budget} tokens at 16-token blocks ({working / budget:.1f}x)")
    return command.finish(lambda: run_tiers(command.spec, make, args.kv_blocks, command.rate, args.max_duration,
                                            args.repeats, args.restart_requests if args.restart else 0, command.policy))
