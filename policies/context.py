"""Context policies and context providers: what a long-lived conversation does when it outgrows
the model's window, and what is retrieved or remembered before each of its turns.

Both are plugins, registered through `register_context_policies` and `register_context_providers`;
the built-in policies `error` and `drop_oldest` are registered by this module exactly as a
third-party package registers its own. docs/plugins.md has the contracts; `api/sessions/core.py`
is the one caller.

A conversation is a system prompt and a list of turns. A turn is whole: the messages a context
provider added for it, the user's message and the assistant's answer. Policies cut whole turns
and never the system prompt or the turn being answered.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar

import anyio
from pydantic import BaseModel, ConfigDict, Field

from cadenza.plugins.hookspecs import hookimpl

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}
Turn = list[Message]
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]  # texts -> one vector each, in order


class ContextOverflowError(Exception):
    """A policy's refusal: the conversation does not fit and the policy will not cut it.
    The request fails with `prompt_too_long` and this message."""


@dataclass
class ContextWindow:
    """What a policy sees: a conversation whose next prompt is over `budget` tokens.

    `count(turns)` is the prompt length, in tokens, of the system prompt, `turns` and the new turn,
    rendered through the chat template exactly as they would be sent; `count_messages(messages)`
    that of any chat (a summary's prompt, say). `generate(messages,
    max_tokens)` runs the served model greedily on a chat and returns its text (for a policy that
    summarises); its prompt must itself fit the model.
    """

    system: list[Message]
    turns: list[Turn]  # the history, oldest first
    new_turn: Turn  # the turn being answered; always kept
    budget: int  # the prompt tokens that leave room for the turn's whole max_tokens
    limit: int  # the most prompt tokens the engine takes at all (then generating fewer than max_tokens)
    max_model_len: int
    count: Callable[[list[Turn]], Awaitable[int]]
    count_messages: Callable[[list[Message]], Awaitable[int]]
    generate: Callable[[list[Message], int], Awaitable[str]]


class ContextPolicy:
    """Decides what a conversation keeps when its next prompt would not fit.

    One instance serves the whole deployment (every session): keep no per-session state.
    """

    name: ClassVar[str]
    options_model: ClassVar[type[BaseModel] | None] = None

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    async def fit(self, window: ContextWindow) -> list[Turn]:
        """The history to keep instead of `window.turns` (the new turn excluded), such that
        `await window.count(result) <= window.budget` (or at least `<= window.limit`: the turn then
        generates at most `max_model_len` minus its prompt). It may drop, shorten or replace turns (a
        summary); the result becomes the session's history. Raise `ContextOverflowError` to refuse.
        Called only when the prompt is over the budget."""
        raise NotImplementedError


class ContextProvider:
    """Adds messages to a conversation turn before it is tokenized: retrieved passages,
    remembered facts. One instance serves the whole deployment, built once at start-up
    (build indexes in `__init__`, not per turn); `provide` may run for many sessions at once."""

    name: ClassVar[str]
    options_model: ClassVar[type[BaseModel] | None] = None

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    async def provide(self, request: "ProviderRequest") -> list[Message]:
        """Messages to put before the turn's own messages (usually one `system` message), or [].
        Runs under the deployment's `sessions.provider_timeout`; raising or running out of time
        fails this turn alone (`context_provider_error`, `context_provider_timeout`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ProviderRequest:
    """A turn about to be answered: the conversation so far and the turn's new messages."""

    session_id: str
    request_id: str
    conversation: list[Message]  # the system prompt and the history, oldest first
    new_messages: list[Message]  # the turn's messages (usually one user message)
    # The served model's embeddings (`engine_embedder`); None where the front-end offers none.
    embed: Embed | None = field(default=None, repr=False, compare=False)

    @property
    def query(self) -> str:
        """The turn's text: its user messages, joined."""
        return "\n".join(m["content"] for m in self.new_messages if m["role"] == "user")


def engine_embedder(engine: Any, request_id: str) -> Embed:
    """`ProviderRequest.embed` over an `AsyncEngine`, for the front-end that builds the request.

    `await embed(texts)` returns one vector per text, in order, pooled as the deployment's
    `embeddings` section says (as `LLM.embed` and `/v1/embeddings` do: the same text gives the same
    vector). Every text is an engine request of its own, all sent at once, so the scheduler batches
    them with each other and with generation. A text longer than the engine takes is cut to its
    first tokens that fit; a request that fails raises `RuntimeError` (the turn then fails)."""
    ids = itertools.count()  # the providers of one turn share it: request ids stay unique

    async def embed(texts: list[str]) -> list[list[float]]:
        # Imported here: importing this module stays cheap (no tokenizer, no torch).
        from cadenza.models.prompts import tokenize_prompt
        from cadenza.pooling_params import PoolingParams
        from cadenza.sampling_params import SamplingParams

        runtime = engine.runtime
        section = runtime.config.embeddings
        # Through `generate`, as /v1/embeddings does: every engine kind (data-parallel too) serves it.
        params = SamplingParams(max_tokens=1, pooling=PoolingParams(pooling=section.pooling, normalize=section.normalize))
        cap = runtime.config.server.max_prompt_tokens or runtime.max_model_len
        fits = min(runtime.max_model_len - 1, runtime.num_blocks * runtime.block_size - 1, cap)
        vocab_size = runtime.loaded.arch.vocab_size

        def tokenize() -> list[list[int]]:
            return [tokenize_prompt(text, runtime.tokenizer, vocab_size)[1][:fits] for text in texts]

        prompts = await anyio.to_thread.run_sync(tokenize)  # a folder's worth of text is not loop work
        vectors: list[list[float]] = [[] for _ in texts]

        async def one(i: int) -> None:
            async for out in engine.generate(prompts[i], params, request_id=f"{request_id}:embed-{next(ids)}"):
                if out.finished and out.embedding is None:  # the last output carries the vector or the error
                    raise RuntimeError(f"embedding failed ({out.error_code}): {out.error}")
                if out.finished:
                    vectors[i] = list(out.embedding)

        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)
        return vectors

    return embed


# --- the built-in policies ----------------------------------------------------------------------


class ErrorPolicy(ContextPolicy):
    """Cut nothing. A prompt the engine still takes runs as it always has (generating fewer than
    max_tokens if it must); a longer one fails with `prompt_too_long`, the history left as it was."""

    name = "error"

    async def fit(self, window: ContextWindow) -> list[Turn]:
        needed = await window.count(window.turns)
        if needed <= window.limit:
            return window.turns
        raise ContextOverflowError(
            f"the conversation needs {needed} prompt tokens; at most {window.limit} fit (max_model_len "
            f"{window.max_model_len}); the session's context policy is 'error': reset or truncate the "
            "conversation, or choose a policy such as drop_oldest"
        )


class DropOldestOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trim_to: float = Field(
        0.75, gt=0, le=1,
        description="After a cut the prompt fills at most this fraction of the budget, so that the "
        "next turns fit without another cut: each cut recomputes the prompt after the system "
        "prompt, which the prefix cache cannot serve.",
    )


class DropOldest(ContextPolicy):
    """Drop whole turns, oldest first, keeping the system prompt and the new turn."""

    name = "drop_oldest"
    options_model = DropOldestOptions

    def __init__(self, options: DropOldestOptions | None = None) -> None:
        super().__init__(options or DropOldestOptions())

    async def fit(self, window: ContextWindow) -> list[Turn]:
        if await window.count([]) > window.limit:
            raise ContextOverflowError(
                f"the system prompt and the new turn alone need more than {window.limit} prompt "
                f"tokens (max_model_len {window.max_model_len})"
            )
        for limit in (max(1, int(window.budget * self.options.trim_to)), window.budget):
            dropped = await _fewest_dropped(window, limit)
            if dropped is not None:
                return window.turns[dropped:]
        return []  # only the new turn fits, and not with its whole max_tokens


async def _fewest_dropped(window: ContextWindow, limit: int) -> int | None:
    """The fewest oldest turns to drop so the prompt is at most `limit` tokens, or None.
    Binary search: a prompt only shrinks as turns go (one template render per probe)."""
    turns = window.turns
    if await window.count([]) > limit:
        return None
    low, high = 0, len(turns)  # count(turns[high:]) <= limit holds
    while low < high:
        middle = (low + high) // 2
        if await window.count(turns[middle:]) <= limit:
            high = middle
        else:
            low = middle + 1
    return low


@hookimpl
def register_context_policies(register):
    register(ErrorPolicy.name, ErrorPolicy)
    register(DropOldest.name, DropOldest)
