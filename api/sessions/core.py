"""The core every conversation API shares: from a conversation and a new turn to prompt token ids.

`SessionCore.prepare` runs the turn's context providers (concurrently, under the deployment's
timeout), renders the conversation through the chat template, and when the prompt would not fit
(`max_model_len` minus the turn's `max_tokens`) asks the conversation's context policy what to
keep. It then commits the turn to the conversation; `settle` adds the answer or, for a cancelled or
failed turn, restores the history as it was before (the policy's cut included).

The prompt goes to the engine as token ids: the conversation is tokenized once, here, and the
ingress only checks the ids. WebSocket sessions (`api/sessions/websocket.py`), the Responses API
(`api/openai_ws/responses.py`) and the Realtime API (`api/openai_ws/realtime.py`) are front-ends over this module.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from pydantic import ValidationError

from cadenza.api.sessions.conversation import Conversation, flatten
from cadenza.api.state import ServerState
from cadenza.config import CadenzaConfig
from cadenza.models.prompts import PromptError, tokenize_prompt
from cadenza.models.tokenizer import ChatTemplateError
from cadenza.plugins.errors import PluginError
from cadenza.policies.context import (
    ContextOverflowError,
    ContextPolicy,
    ContextProvider,
    ContextWindow,
    Message,
    ProviderRequest,
    Turn,
    engine_embedder,
)
from cadenza.runtime.registries import Registries
from cadenza.sampling_params import SamplingParams

log = structlog.get_logger("cadenza.api.sessions")

# Conversations longer than this (in characters) are tokenized in a worker thread, off the event loop.
OFF_LOOP_CHARS = 4096
SUMMARY_REQUEST_SUFFIX = ":context"


class TurnError(Exception):
    """A turn that cannot be answered; `code` is stable (the WebSocket `error` code), `message`
    says what to fix. The session carries on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class ContextSettings:
    """A conversation's policy and providers: the deployment's, or what its session chose."""

    policy: str
    providers: tuple[str, ...] = ()


class ContextPlugins:
    """The deployment's context policies and providers, each built once at start-up with its
    `plugin_options`. A plugin whose options do not validate is left out (naming it in a session
    fails with the reason); the deployment's own defaults were already checked by `resolve_plugins`."""

    def __init__(self, config: CadenzaConfig, registries: Registries) -> None:
        self.defaults = ContextSettings(config.sessions.context_policy, tuple(config.sessions.context_providers))
        self.timeout = config.sessions.provider_timeout
        self.policies: dict[str, ContextPolicy] = {}
        self.providers: dict[str, ContextProvider] = {}
        self.unavailable: dict[str, str] = {}
        for registry, built in ((registries.context_policies, self.policies), (registries.context_providers, self.providers)):
            for name in registry.names():
                cls = registry.get(name)
                if registry is registries.context_providers and not inspect.iscoroutinefunction(cls.provide):
                    raise PluginError(f"context provider {name!r} ({registry.source_of(name)}): provide must be `async def`")
                try:
                    options = None if cls.options_model is None else cls.options_model.model_validate(config.plugin_options.get(name, {}))
                except ValidationError as exc:
                    self.unavailable[name] = f"plugin_options.{name}: {exc.errors(include_url=False)[0]['msg']}"
                    continue
                built[name] = cls(options) if cls.options_model is not None else cls()
        self.check(self.defaults)

    def check(self, settings: ContextSettings) -> ContextSettings:
        """`settings`, or a `TurnError("invalid_params")` naming the unknown plugin."""
        for kind, names, known in (("context policy", (settings.policy,), self.policies),
                                   ("context provider", settings.providers, self.providers)):  # fmt: skip
            for name in names:
                if name not in known:
                    why = self.unavailable.get(name) or f"known: {', '.join(sorted(known)) or 'none'}"
                    raise TurnError("invalid_params", f"no {kind} named {name!r} runs here ({why})")
        return settings


@dataclass
class PreparedTurn:
    """A turn committed to its conversation, with what `settle` needs to finish or undo it."""

    token_ids: list[int]
    turn: Turn  # the provider messages and the turn's own messages
    previous: list[Turn]  # the history before this turn, restored if it is undone
    policy: str
    turns_dropped: int = 0  # by the policy's cut; 0 when the conversation fitted
    messages_added: int = 0  # by the providers
    cut: bool = False

    def report(self) -> dict[str, Any]:
        """What a `done` says about the context: the cost of a cut shows in `cached_tokens`."""
        return {"policy": self.policy, "cut": self.cut, "turns_dropped": self.turns_dropped,
                "messages_added": self.messages_added}  # fmt: skip


@dataclass
class SessionCore:
    """One per server: turns prompts into token ids through providers, template and policy."""

    state: ServerState
    plugins: ContextPlugins

    @property
    def max_model_len(self) -> int:
        return self.state.engine.runtime.max_model_len

    def limits(self, params: SamplingParams) -> tuple[int, int]:
        """(budget, limit): the prompt tokens that leave room for the turn's whole `max_tokens`,
        and the most the engine takes at all (leaving room for one token)."""
        runtime = self.state.engine.runtime
        context = min(runtime.max_model_len, runtime.num_blocks * runtime.block_size)
        cap = self.state.config.server.max_prompt_tokens or context
        return min(context - (params.max_tokens or 1), cap), min(context - 1, cap)

    async def prepare(
        self,
        conversation: Conversation,
        new_messages: list[Message],
        params: SamplingParams,
        settings: ContextSettings,
        *,
        session_id: str,
        request_id: str,
    ) -> PreparedTurn:
        """Providers, template and policy; commits the turn (provider messages first) to the
        conversation. With no `new_messages`, the conversation's last turn is answered again if it
        has no answer yet (a Realtime `response.create` after `conversation.item.create`)."""
        previous = list(conversation.turns)
        history = list(previous)
        if not new_messages and history and not any(m["role"] == "assistant" for m in history[-1]):
            new_messages = history.pop()
        request = ProviderRequest(session_id, request_id, conversation.system() + flatten(history), flatten([new_messages]),
                                  embed=engine_embedder(self.state.engine, request_id))
        added = await self._provide(settings.providers, request)
        turn = [*added, *new_messages]
        budget, limit = self.limits(params)
        budget = max(1, budget)  # max_tokens over max_model_len: the engine clamps it, as without a policy
        system = conversation.system()
        ids = await self._tokenize(system + flatten(history) + flatten([turn]))
        prepared = PreparedTurn(ids, turn, previous, settings.policy, messages_added=len(added))
        if len(ids) > budget:
            kept = await self._fit(settings.policy, system, history, turn, (budget, limit), request_id)
            if kept != history:
                prepared.turns_dropped = max(0, len(history) - len(kept))
                prepared.cut = True
                history = kept
                prepared.token_ids = await self._tokenize(system + flatten(history) + flatten([turn]))
            if len(prepared.token_ids) > limit:
                message = f"context policy {settings.policy!r} kept {len(prepared.token_ids)} prompt tokens; at most {limit} fit"
                raise TurnError("prompt_too_long", message)
            if prepared.cut:
                log.info("Context cut", request_id=request_id, session_id=session_id, policy=settings.policy,
                         turns_dropped=prepared.turns_dropped, prompt_tokens=len(prepared.token_ids), budget=budget)  # fmt: skip
        conversation.turns[:] = [*history, turn] if turn else history
        return prepared

    def settle(self, conversation: Conversation, prepared: PreparedTurn, answer: Message | None) -> None:
        """Add the answer to the turn, or (`answer` None: cancelled, failed) undo the turn and the cut."""
        if answer is None:
            conversation.turns[:] = prepared.previous
        elif prepared.turn:
            prepared.turn.append(answer)
        elif conversation.turns:
            conversation.turns[-1].append(answer)
        else:
            conversation.turns.append([answer])

    async def _provide(self, names: tuple[str, ...], request: ProviderRequest) -> list[Message]:
        if not names:
            return []
        results: dict[str, list[Message]] = {}
        failure: TurnError | None = None

        async def run(name: str) -> None:
            nonlocal failure
            try:
                added = await self.plugins.providers[name].provide(request)
                results[name] = _checked_messages(f"context provider {name!r}", added, "context_provider_error")
            except TurnError as exc:
                failure = failure or exc
            except Exception as exc:  # a provider's bug fails this turn alone
                log.warning("Context provider failed", provider=name, request_id=request.request_id, error=repr(exc))
                failure = failure or TurnError("context_provider_error", f"context provider {name!r} failed: {exc!r}")

        with anyio.move_on_after(self.plugins.timeout) as scope:
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(run, name)
        if scope.cancelled_caught:
            late = [n for n in names if n not in results]
            raise TurnError("context_provider_timeout",
                            f"context provider(s) {', '.join(map(repr, late))} took longer than sessions.provider_timeout ({self.plugins.timeout} s)")  # fmt: skip
        if failure is not None:
            raise failure
        return [m for name in names for m in results[name]]

    async def _fit(self, policy_name: str, system: list[Message], history: list[Turn], turn: Turn, limits: tuple[int, int], request_id: str) -> list[Turn]:
        async def count(turns: list[Turn]) -> int:
            return len(await self._tokenize(system + flatten(turns) + flatten([turn])))

        async def count_messages(messages: list[Message]) -> int:
            return len(await self._tokenize(messages))

        async def generate(messages: list[Message], max_tokens: int) -> str:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            text, last = [], None
            async for out in self.state.engine.generate(messages, params, request_id=f"{request_id}{SUMMARY_REQUEST_SUFFIX}"):
                text.append(out.text)
                last = out
            if last is not None and last.finish_reason == "error":
                raise TurnError(last.error_code or "internal_error", f"context policy {policy_name!r}: {last.error}")
            return "".join(text)

        window = ContextWindow(system, list(history), list(turn), *limits, self.max_model_len, count, count_messages, generate)
        try:
            kept = await self.plugins.policies[policy_name].fit(window)
        except ContextOverflowError as exc:
            raise TurnError("prompt_too_long", str(exc)) from None
        except TurnError:
            raise
        except Exception as exc:
            log.warning("Context policy failed", policy=policy_name, request_id=request_id, error=repr(exc))
            raise TurnError("context_policy_error", f"context policy {policy_name!r} failed: {exc!r}") from None
        if not isinstance(kept, list) or not all(isinstance(t, list) for t in kept):
            raise TurnError("context_policy_error", f"context policy {policy_name!r} returned {type(kept).__name__}, not a list of turns")
        return [_checked_messages(f"context policy {policy_name!r}", t, "context_policy_error") for t in kept]

    async def _tokenize(self, messages: list[Message]) -> list[int]:
        tokenizer = self.state.engine.runtime.tokenizer
        vocab_size = self.state.engine.runtime.loaded.arch.vocab_size

        def tokenize() -> list[int]:
            try:
                return tokenize_prompt(messages, tokenizer, vocab_size)[1]
            except ChatTemplateError as exc:
                raise TurnError("invalid_messages", str(exc)) from None
            except PromptError as exc:
                raise TurnError("invalid_prompt", str(exc)) from None

        if sum(len(m["content"]) for m in messages) > OFF_LOOP_CHARS:
            return await anyio.to_thread.run_sync(tokenize)
        return tokenize()


_ROLES = ("system", "user", "assistant", "tool")
# What a message keeps through a plugin: a Responses turn's calls, their results and reasoning too.
_KEYS = ("role", "content", "id", "tool_calls", "tool_call_id", "reasoning_content")


def _checked_messages(plugin: str, messages: Any, code: str) -> list[Message]:
    """A plugin's messages as {role, content} dicts, or a `TurnError` naming what is wrong."""
    if not isinstance(messages, list):
        raise TurnError(code, f"{plugin} returned {type(messages).__name__}, not a list of messages")
    checked = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)):
            raise TurnError(code, f"{plugin} returned a bad message [{i}]: need a role in {_ROLES} and string content")
        checked.append({k: v for k, v in m.items() if k in _KEYS})
    return checked
