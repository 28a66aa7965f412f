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
        return (
            f"{self.num_requests} requests, prompts {a}..{b} ({self.num_prompt_tokens} tokens), "
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
