"""What the benches that compare arms share, each arm on a `cadenza serve` of its own: the router
bench (`--workload multi-turn`) and the disaggregation bench (`--workload disaggregation`).

A bench's command is an `ArmsCommand`: `start` checks the command line, `announce` prints what
runs where, `finish` runs the arms and prints and writes the result. Each arm is `run_arm`: its
server launched on a free loopback port (`serve_process.LaunchedServer`), the load run under the
quiet-machine check, the server stopped by its process group whatever ended the run.
"""

from __future__ import annotations

import itertools
import shlex
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence, TypeVar

from cadenza.bench.common.quiet import QuietPolicy, QuietReport
from cadenza.bench.common.report import environment, write_json
from cadenza.bench.common.setup import setup_process
from cadenza.bench.serving.serve_process import LaunchedServer, run_quietly_here, sigterm_raises, wait_idle

A = TypeVar("A")
METRICS_SETTLE = 1.3  # replicas report their engine metrics every second (cluster/dp_engine.py)


@dataclass(slots=True)
class ServerSpec:
    """How each arm's `cadenza serve` starts (LaunchedServer's arguments but the arm's own)."""

    model: str | None
    dtype: str
    config: str | None
    num_threads: int | None
    seed: int
    verbose: bool = False
    start_timeout: float = 600.0

    @classmethod
    def from_args(cls, args) -> "ServerSpec":
        return cls(args.model, args.dtype, args.config, args.num_threads, args.seed, args.verbose,
                   args.server_start_timeout)


class ArmOutcome(NamedTuple):
    value: Any  # what the arm's kept attempt returned
    quiet: QuietReport
    server_pid: int | None


def arm_order(arms: Sequence[A], repeats: int) -> Iterator[tuple[A, int]]:
    """(arm, repeat): every arm `repeats` times, the order reversed every other repeat (A B, B A, ...)."""
    for repeat in range(repeats):
        for arm in (arms if repeat % 2 == 0 else list(reversed(arms))):
            yield arm, repeat


def run_arm(spec: ServerSpec, label: str, attempt: Callable[[str, int], Any], policy: QuietPolicy, *,
            extra_args: Sequence[str], extra_env: dict[str, str], log: Callable[[str], None] = print) -> ArmOutcome:
    """One arm on a server of its own: launch `cadenza serve` (`spec`, then `extra_args` and
    `extra_env`), run `attempt(url, n)` under the quiet check, and stop the server by its process
    group, whatever ended the run. n is 0 for the first attempt and counts a disturbed run's
    retries: an attempt after the first wants fresh prompts (nothing cached from before)."""
    log(f"{label}: starting cadenza serve {' '.join(extra_args)} ...")
    with LaunchedServer(model=spec.model, dtype=spec.dtype, config=spec.config, num_threads=spec.num_threads,
                        seed=spec.seed, verbose=spec.verbose, start_timeout=spec.start_timeout,
                        extra_args=tuple(extra_args), extra_env=extra_env) as server:  # fmt: skip
        log(f"  listening on {server.url} (pid {server.pid})")
        attempts = itertools.count()
        value, quiet = run_quietly_here(lambda: attempt(server.url, next(attempts)), policy, server.pid)
    return ArmOutcome(value, quiet, server.pid)


def metrics_text(url: str) -> str:
    """The server's `/metrics` (Prometheus text)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def wait_settled(url: str) -> None:
    """Wait until the server is idle and its replicas have reported what the run added to `/metrics`."""
    wait_idle(url)
    time.sleep(METRICS_SETTLE)


def medians(figures: Sequence[dict]) -> dict:
    """Each figure's median over the repeats, and its spread (min..max); None where no repeat has it."""
    out = {}
    for key in figures[0] if figures else ():
        values = [f[key] for f in figures if f[key] is not None]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
    return out


class ArmsResult(Protocol):
    def render(self) -> str:
        """The table (and notes) printed at the end."""

    def as_dict(self) -> dict:
        """What the JSON file holds besides the command and its environment."""

    @property
    def failed(self) -> bool:
        """Whether the command exits 1."""


@dataclass(slots=True)
class ArmsCommand:
    """`cadenza bench serve --workload KIND` for a bench of arms: `start`, `announce`, `finish`."""

    args: Any
    kind: str
    rate: float
    policy: QuietPolicy
    spec: ServerSpec
    command: str = ""
    environment: dict = field(default_factory=dict)

    @classmethod
    def start(cls, args, kind: str, per: str, default_rate: float,
              positive: Sequence[tuple[str, float]] = ()) -> "ArmsCommand":
        """Refuse what a bench of launched servers cannot take (a --url, other than one finite
        positive rate, a --max-duration, --repeats or `positive` flag below 1), then set up the
        process. `per`: what each server is launched for ("router", "arm")."""
        if args.url:
            raise ValueError(f"--workload {kind} launches a server per {per}; leave out --url")
        rates = args.request_rates or [default_rate]
        if len(rates) != 1 or not 0 < rates[0] < float("inf"):
            raise ValueError(f"--workload {kind} takes one finite positive --request-rates, got {rates}")
        for flag, value in (("--max-duration", args.max_duration), ("--repeats", args.repeats), *positive):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        return cls(args, kind, rates[0], setup_process(args), ServerSpec.from_args(args))

    def announce(self, arms: str, workload: str) -> None:
        """Print the arms, the machine, the command line and the workload."""
        self.environment = env = environment(self.args.num_threads)
        self.command = shlex.join(getattr(self.args, "argv", None) or ["cadenza", *sys.argv[1:]])
        print(f"cadenza bench serve --workload {self.kind}: {arms} ({self.args.dtype}), {env['machine']}, "
              f"cadenza {env['cadenza_revision']}")
        print(f"command: {self.command}")
        print(f"workload: {workload}")

    def finish(self, measure: Callable[[], ArmsResult]) -> int:
        """Run `measure` with SIGTERM raising, so a launched server is stopped, not orphaned; print
        its result and write its JSON. The exit code: 1 on an error or a failed result, 130 on Ctrl-C."""
        try:
            with sigterm_raises():
                result = measure()
        except (RuntimeError, OSError) as exc:
            print(f"cadenza bench serve: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("cadenza bench serve: interrupted (the server was stopped)", file=sys.stderr)
            return 130
        print()
        print(result.render())
        args = self.args
        if args.json:
            write_json(args.json, {"bench": "serve", "workload_kind": self.kind, "command": self.command,
                                   "model": args.model, "dtype": args.dtype, "config": args.config,
                                   "environment": self.environment, **result.as_dict()})  # fmt: skip
        return 1 if result.failed else 0
