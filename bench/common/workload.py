"""A seeded offline workload in the manner of nano-vllm's bench: random token-id prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    """N requests with prompt lengths uniform in `prompt_len` and outputs uniform in `output_len`.

    Every request ignores EOS, so each produces exactly `max_tokens` tokens whatever the engine.
    """

    requests: list[BenchRequest]
    seed: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    temperature: float
    preset: str = ""  # a named workload's name ("nano-vllm")

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> str:
        (a, b), (c, d) = self.prompt_len, self.output_len
        named = f"{self.preset}: " if self.preset else ""
        return (
            f"{named}{self.num_requests} requests, prompts {a}..{b} ({self.num_prompt_tokens} tokens), "
            f"outputs {c}..{d} ({self.num_output_tokens} tokens), temperature {self.temperature}, "
            f"ignore_eos, seed {self.seed}"
        )


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    *,
    seed: int = 0,
    vocab_size: int = 10_000,
    temperature: float = 0.6,
) -> Workload:
    """Token ids uniform in [0, min(vocab_size, 10000)), as nano-vllm draws them."""
    for name, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name}: need 1 <= low <= high, got {low}..{high}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    rng = random.Random(seed)
    top = min(vocab_size, 10_000)
    requests = [
        BenchRequest(
            prompt_token_ids=[rng.randrange(top) for _ in range(rng.randint(*prompt_len))],
            max_tokens=rng.randint(*output_len),
        )
        for _ in range(num_requests)
    ]
    return Workload(requests, seed, tuple(prompt_len), tuple(output_len), temperature)


def random_prompt(length: int, *, seed: int, vocab_size: int = 10_000) -> list[int]:
    """One random prompt; a new seed gives a prompt no prefix cache has seen."""
    rng = random.Random(seed)
    top = min(vocab_size, 10_000)
    return [rng.randrange(top) for _ in range(length)]


NANO_VLLM = {"num_requests": 256, "prompt_len": (100, 1024), "output_len": (100, 1024)}
DEFAULT = {"num_requests": 64, "prompt_len": (32, 512), "output_len": (32, 256)}


def nano_vllm_workload(*, seed: int = 0, vocab_size: int = 10_001, temperature: float = 0.6) -> Workload:
    """nano-vllm's bench.py, draw for draw: `seed(0)`, then 256 prompts, each of `randint(100, 1024)`
    token ids `randint(0, 10000)`, then 256 output lengths `randint(100, 1024)`; temperature 0.6,
    ignore_eos. Seed 0 gives its 133,966 output tokens. Token ids stay below a smaller vocabulary."""
    rng = random.Random(seed)
    n, (a, b), (c, d) = NANO_VLLM["num_requests"], NANO_VLLM["prompt_len"], NANO_VLLM["output_len"]
    top = min(vocab_size - 1, 10_000)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(a, b))] for _ in range(n)]
    requests = [BenchRequest(prompt, rng.randint(c, d)) for prompt in prompts]
    return Workload(requests, seed, (a, b), (c, d), temperature, preset="nano-vllm")


def bench_workload(args, vocab_size: int) -> Workload:
    """`bench throughput`'s workload: `--workload nano-vllm`, or the sizes its flags give."""
    given = {"--num-requests": args.num_requests, "--prompt-len": args.prompt_len, "--output-len": args.output_len}
    if args.workload == "nano-vllm":
        fixed = [flag for flag, value in given.items() if value is not None]
        if fixed:
            raise ValueError(f"--workload nano-vllm fixes the requests; leave out {', '.join(fixed)}")
        return nano_vllm_workload(seed=args.seed, vocab_size=vocab_size, temperature=args.temperature)
    if args.workload is not None:
        raise ValueError(f"unknown workload {args.workload!r}; known: nano-vllm")
    sizes = {k: DEFAULT[k] if v is None else v for k, v in
             zip(DEFAULT, (args.num_requests, args.prompt_len, args.output_len))}
    return make_workload(sizes["num_requests"], tuple(sizes["prompt_len"]), tuple(sizes["output_len"]), seed=args.seed,
                         vocab_size=vocab_size, temperature=args.temperature)
