"""`cadenza bench serve --workload multi-turn`: the data-parallel router as users see it.

Multi-turn chats over shared system prompts at a fixed request rate, against a `cadenza serve
--data-parallel-size N` launched once per router (each arm its own server, same seed, same
workload). Conversation c has system prompt c mod K; its turn t's prompt is turn t-1's prompt,
the answer streamed back (token ids over WebSocket) and a new user message, so each prompt extends
the last and the prefix cache, and the replica a turn lands on, matter.

Arrivals: the request slots of a Poisson process at `rate` go round by round, turn t of every
conversation in the t-th block of N slots, in a seeded shuffled order per round (a fixed order
would send conversation c's every turn to replica c mod 2 under round-robin, which measured the
same hit rate as the prefix router); a turn is sent at its slot or when its previous turn ended,
whichever is later. A turn whose
previous turn failed is never sent (counted cancelled). The run stops at `max_duration`.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import anyio

from cadenza.bench.common.quiet import QuietPolicy
from cadenza.bench.common.report import table
from cadenza.bench.common.workload import BenchRequest
from cadenza.bench.serving.serve import WARMUP_TIMEOUT, _run_async, arrival_offsets
from cadenza.bench.serving.serve_arms import (
    METRICS_SETTLE,
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
from cadenza.bench.serving.stats import ServeRun, rate_label

ROUTERS = ("prefix", "round_robin", "least_loaded")
SGLANG_NOTE = "SGLang reports its cache-aware router at 1.9x throughput and 75% against 20% cache hits"


@dataclass(frozen=True, slots=True)
class MultiTurnWorkload:
    """N conversations of T turns; conversation c opens with system prompt c mod K."""

    system_prompts: list[list[int]]
    user_messages: list[list[list[int]]]  # [conversation][turn] -> token ids
    max_tokens: list[list[int]]  # [conversation][turn]
    order: list[list[int]]  # [turn] -> the conversations in the order of that round's slots
    seed: int
    temperature: float

    @property
    def num_conversations(self) -> int:
        return len(self.user_messages)

    @property
    def num_turns(self) -> int:
        return len(self.user_messages[0])

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.num_turns

    def slot(self, conversation: int, turn: int) -> int:
        """Which request slot (arrival, and record index) turn `turn` of `conversation` takes."""
        return turn * self.num_conversations + self.order[turn].index(conversation)

    def system_prompt(self, conversation: int) -> list[int]:
        return self.system_prompts[conversation % len(self.system_prompts)]

    def describe(self) -> str:
        users = [len(m) for turns in self.user_messages for m in turns]
        outputs = [n for turns in self.max_tokens for n in turns]
        return (f"multi-turn: {self.num_conversations} conversations x {self.num_turns} turns, "
                f"{len(self.system_prompts)} shared system prompts of {len(self.system_prompts[0])} tokens, "
                f"user messages {min(users)}..{max(users)} tokens, answers {min(outputs)}..{max(outputs)} tokens "
                f"(ignore_eos), temperature {self.temperature}, seed {self.seed}")

    def as_dict(self) -> dict:
        return {"conversations": self.num_conversations, "turns": self.num_turns,
                "system_prompts": len(self.system_prompts), "system_prompt_tokens": len(self.system_prompts[0]),
                "user_tokens": sum(len(m) for turns in self.user_messages for m in turns),
                "output_tokens": sum(n for turns in self.max_tokens for n in turns), "seed": self.seed,
                "temperature": self.temperature, "describe": self.describe()}


def make_multi_turn(num_conversations: int, num_system_prompts: int, turns: int, system_len: int,
                    user_len: tuple[int, int], output_len: tuple[int, int], *, seed: int = 0, salt: str = "",
                    vocab_size: int = 10_000, temperature: float = 0.6) -> MultiTurnWorkload:
    """Token ids uniform below min(vocab_size, 10000); `salt` gives new tokens of the same shape."""
    for name, value in (("conversations", num_conversations), ("system prompts", num_system_prompts),
                        ("turns", turns), ("system prompt length", system_len)):
        if value < 1:
            raise ValueError(f"multi-turn: {name} must be at least 1, got {value}")
    for name, (low, high) in (("user message length", user_len), ("output length", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"multi-turn: {name}: need 1 <= low <= high, got {low}..{high}")
    rng = random.Random(f"multi-turn-{seed}-{salt}")
    top = min(vocab_size, 10_000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(top) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(num_system_prompts)]
    users = [[tokens(rng.randint(*user_len)) for _ in range(turns)] for _ in range(num_conversations)]
    outputs = [[rng.randint(*output_len) for _ in range(turns)] for _ in range(num_conversations)]
    order = [rng.sample(range(num_conversations), num_conversations) for _ in range(turns)]
    return MultiTurnWorkload(systems, users, outputs, order, seed, temperature)


async def run_conversations(client: WebSocketClient, workload: MultiTurnWorkload, offsets: Sequence[float],
                            max_duration: float, warmups: int, before_run: Callable[[], None] = lambda: None
                            ) -> tuple[list[RequestRecord], float]:
    """Warm up (`warmups` distinct prompts at once, untimed), call `before_run`, then every
    conversation turn by turn. Records are by slot (`workload.slot(c, t)`)."""
    n = workload.num_conversations
    records = [RequestRecord(k, 0, workload.max_tokens[workload.order[k // n][k % n]][k // n], keep_token_ids=True)
               for k in range(workload.num_requests)]
    async with client, anyio.create_task_group() as readers:
        client.start(readers)
        with anyio.move_on_after(WARMUP_TIMEOUT) as warmup:
            await client.warmup(warmups)
        if warmup.cancelled_caught:
            raise RuntimeError(f"the warm-up requests got no answer in {WARMUP_TIMEOUT:.0f}s")
        await anyio.to_thread.run_sync(before_run)
        started = time.perf_counter()

        async def converse(c: int) -> None:
            history = workload.system_prompt(c) + workload.user_messages[c][0]
            for t in range(workload.num_turns):
                k = workload.slot(c, t)
                delay = started + offsets[k] - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                record = records[k]
                record.num_prompt_tokens = len(history)
                await client.send(c, BenchRequest(list(history), record.max_tokens), record, request_id=f"c{c}t{t}")
                if record.status != "completed":
                    return
                if t + 1 < workload.num_turns:
                    history = history + record.output_token_ids + workload.user_messages[c][t + 1]

        with anyio.move_on_after(max_duration):
            async with anyio.create_task_group() as tg:
                for c in range(n):
                    tg.start_soon(converse, c)
        deadline_at = time.perf_counter()
        readers.cancel_scope.cancel()
    for record in records:
        if record.status is None:
            record.status = "cancelled"
            record.error = ("unfinished at --max-duration" if record.sent_at else
                            "not sent: an earlier turn failed or --max-duration came first")
    if any(r.status == "cancelled" for r in records):
        return records, deadline_at - started
    return records, max(r.finished_at for r in records) - started


_REPLICA = re.compile(r'^cadenza_replica_(\w+)\{replica="(\d+)"\} (\S+)$', re.M)
_PROMPT = re.compile(r"^cadenza_prompt_tokens_total (\S+)$", re.M)


def read_replica_metrics(url: str) -> dict:
    """From /metrics: per replica `routed`, `prefix_cached_tokens`, `generation_tokens`, and the
    server's `prompt_tokens` (of finished requests)."""
    text = metrics_text(url)
    replicas: dict[int, dict[str, float]] = {}
    for name, replica, value in _REPLICA.findall(text):
        replicas.setdefault(int(replica), {})[name] = float(value)
    prompt = _PROMPT.search(text)
    return {"replicas": [replicas[i] for i in sorted(replicas)], "prompt_tokens": float(prompt.group(1)) if prompt else 0.0}


def metrics_delta(before: dict, after: dict) -> dict:
    """What the timed run added: requests routed and prefix-cached tokens per replica, and the
    server-side hit rate (cached over prompt tokens)."""
    keys = ("routed", "prefix_cached_tokens", "generation_tokens")
    per = [{k: int(a.get(k, 0) - b.get(k, 0)) for k in keys} for b, a in zip(before["replicas"], after["replicas"])]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = sum(r["prefix_cached_tokens"] for r in per)
    return {"routed": [r["routed"] for r in per], "prefix_cached_tokens": [r["prefix_cached_tokens"] for r in per],
            "generation_tokens": [r["generation_tokens"] for r in per], "prompt_tokens": int(prompt),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else None}


@dataclass(slots=True)
class RouterRun:
    router: str
    repeat: int
    run: ServeRun
    metrics: dict
    server_pid: int | None = None

    @property
    def hit_rate(self) -> float | None:
        """Prompt tokens the replicas' prefix caches served, over all prompt tokens (from each
        completed turn's usage)."""
        done = self.run.completed
        prompt = sum(r.num_prompt_tokens for r in done)
        return sum(r.num_cached_tokens or 0 for r in done) / prompt if prompt else None

    def figures(self) -> dict:
        ttft, e2e = self.run.latency("ttft"), self.run.latency("e2e")
        return {"ttft_p50_ms": ttft and ttft.p50, "ttft_p99_ms": ttft and ttft.p99, "e2e_p50_ms": e2e and e2e.p50,
                "e2e_p99_ms": e2e and e2e.p99, "output_tokens_per_s": self.run.output_tokens_per_second,
                "prefix_hit_rate": self.hit_rate}

    def as_dict(self) -> dict:
        return {"router": self.router, "repeat": self.repeat, "server_pid": self.server_pid,
                **{k: None if v is None else round(v, 4) for k, v in self.figures().items()},
                "metrics": self.metrics, **self.run.as_dict()}


@dataclass(slots=True)
class RouterResult:
    workload: MultiTurnWorkload
    routers: tuple[str, ...]
    data_parallel_size: int
    rate: float
    max_duration: float
    runs: list[RouterRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def medians(self, router: str) -> dict:
        """Each figure's median over the router's repeats (and its spread: min..max)."""
        return medians([r.figures() for r in self.runs if r.router == router])

    def ratios(self) -> dict | None:
        """The first router's medians over the second's (prefix / round_robin by default)."""
        if len(self.routers) < 2:
            return None
        a, b = self.medians(self.routers[0]), self.medians(self.routers[1])
        return {k: round(a[k]["median"] / b[k]["median"], 4) if a.get(k) and b.get(k) and b[k]["median"] else None
                for k in a}

    def render(self) -> str:
        headers = ["router", "repeat", "completed", "cancelled", "failed", "seconds", "TTFT p50 ms", "TTFT p99 ms",
                   "E2E p50 ms", "E2E p99 ms", "output tok/s", "hit rate", "hit rate /metrics", "routed", "machine"]
        rows = []
        for r in self.runs:
            f = r.figures()
            rows.append([r.router, r.repeat, len(r.run.completed), len(r.run.of_status("cancelled")),
                         len(r.run.of_status("failed")), r.run.seconds, f["ttft_p50_ms"], f["ttft_p99_ms"], f["e2e_p50_ms"],
                         f["e2e_p99_ms"], f["output_tokens_per_s"], f["prefix_hit_rate"],
                         r.metrics.get("prefix_hit_rate"), "+".join(map(str, r.metrics.get("routed", []))),
                         r.run.quiet.describe() if r.run.quiet else "-"])
        lines = [table(headers, rows)]
        ratios = self.ratios()
        if ratios:
            a, b = self.routers[:2]
            lines += ["", f"{a} / {b} (medians over repeats; TTFT and E2E: lower is better, below 1 favours {a}):",
                      "  " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in ratios.items())]
        for run in self.runs:
            for failure in run.run.failures[:3]:
                lines.append(f"  {run.router} #{run.repeat}: request {failure['index']} {failure['status']}: "
                             f"{failure['reason']}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"workload": self.workload.as_dict(), "routers": list(self.routers),
                "data_parallel_size": self.data_parallel_size, "request_rate": self.rate,
                "max_duration_s": self.max_duration,
                "medians": {router: self.medians(router) for router in self.routers},
                "ratios": self.ratios(), "runs": [r.as_dict() for r in self.runs], "notes": self.notes}

    @property
    def failed(self) -> bool:
        """A request failed (a cancelled one, unfinished at --max-duration, is no failure)."""
        return any(r.run.of_status("failed") for r in self.runs)


def run_routers(spec: ServerSpec, make: Callable[[str], MultiTurnWorkload], routers: Sequence[str],
                data_parallel_size: int, rate: float, max_duration: float, repeats: int, policy: QuietPolicy,
                log: Callable[[str], None] = print) -> RouterResult:
    """Each router `repeats` times (order reversed every other repeat: A B, B A, ...), each on a
    server of its own. `make(salt)` gives the workload; salt "0" first, a new one per quiet retry,
    the same sequence in every arm."""
    workload = make("0")
    result = RouterResult(workload, tuple(routers), data_parallel_size, rate, max_duration)
    offsets = arrival_offsets(workload.num_requests, rate, spec.seed)
    for router, repeat in arm_order(routers, repeats):

        def once(url: str, attempt: int, router=router, repeat=repeat):
            load = workload if attempt == 0 else make(str(attempt))
            if not wait_idle(url):
                result.notes.append(f"{router} #{repeat}: the server was still busy before attempt {attempt}")
            before: dict = {}

            def snapshot_before() -> None:
                time.sleep(METRICS_SETTLE)  # the warm-up's counts reach /metrics
                before.update(read_replica_metrics(url))

            client = WebSocketClient(url, load.num_conversations, load.temperature)
            records, seconds = _run_async(lambda: run_conversations(
                client, load, offsets, max_duration, data_parallel_size, snapshot_before))
            wait_settled(url)
            return records, seconds, metrics_delta(before, read_replica_metrics(url))

        (records, seconds, metrics), quiet, pid = run_arm(
            spec, f"{router} #{repeat}", once, policy, extra_args=("--data-parallel-size", str(data_parallel_size)),
            extra_env={"CADENZA_PARALLEL__ROUTER": router}, log=log)
        run = RouterRun(router, repeat, ServeRun("ws", rate, records, seconds, quiet), metrics, pid)
        result.runs.append(run)
        f = run.figures()
        log(f"  {router} #{repeat}: {len(run.run.completed)}/{len(records)} completed in {seconds:.1f}s, "
            f"TTFT p50 {f['ttft_p50_ms'] or 0:.0f} ms, {f['output_tokens_per_s'] or 0:.1f} output tok/s, "
            f"hit rate {f['prefix_hit_rate'] or 0:.2f}, routed {metrics['routed']} ({quiet.describe()})")
    result.notes.append(SGLANG_NOTE + f" (not this workload nor this machine); rate {rate_label(rate)}")
    return result


def serve_multi_turn(args) -> int:
    """`cadenza bench serve --workload multi-turn`: every router on its own launched server."""
    from cadenza.bench.serving.serve_process import model_vocab_size

    command = ArmsCommand.start(args, "multi-turn", "router", 2.0,
                                (("--data-parallel-size", args.data_parallel_size),))
    routers = tuple(dict.fromkeys(args.routers))
    vocab = args.vocab_size or model_vocab_size(args.model, args.config)

    def make(salt: str) -> MultiTurnWorkload:
        return make_multi_turn(args.conversations, args.system_prompts, args.turns, args.system_len, tuple(args.user_len),
                               tuple(args.output_len or (32, 32)), seed=args.seed, salt=salt, vocab_size=vocab,
                               temperature=args.temperature)

    workload = make("0")  # refuses bad sizes before any server starts
    command.announce(f"routers {', '.join(routers)} on --data-parallel-size {args.data_parallel_size}",
                     f"{workload.describe()}; {rate_label(command.rate)} Poisson")
    return command.finish(lambda: run_routers(command.spec, make, routers, args.data_parallel_size, command.rate,
                                              args.max_duration, args.repeats, command.policy))
