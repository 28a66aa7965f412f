"""A server-held conversation: a system prompt and whole turns, and the ways to edit it.

Plain data, no engine: the WebSocket session protocol, the Responses API (one conversation per
stored response) and the Realtime API all keep their history in a `Conversation`. The KV cache
holds nothing for a conversation: a follow-up reuses the previous turn's blocks through the prefix
cache because its prompt starts with the same tokens, so forking or truncating frees nothing and
leaks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cadenza.policies.context import Message, Turn


@dataclass
class Conversation:
    """`turns`, oldest first; a turn is whole: the messages a context provider added for it, the
    user's message(s) and the assistant's answer. Messages may carry an "id" (Realtime items)."""

    system_prompt: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def system(self) -> list[Message]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def history(self) -> list[Message]:
        """Every message after the system prompt, as {role, content}."""
        return [plain(m) for turn in self.turns for m in turn]

    def messages(self) -> list[Message]:
        """What the chat template renders: the system prompt, then the history."""
        return self.system() + self.history()

    def fork(self, turns: int | None = None) -> "Conversation":
        """A copy, of the first `turns` turns when given. Messages are copied, so neither side's
        edits show in the other; the prompts start alike, so the fork hits the prefix cache."""
        kept = self.turns if turns is None else self.turns[:turns]
        return Conversation(self.system_prompt, [[dict(m) for m in turn] for turn in kept])

    def truncate(self, turns: int) -> int:
        """Keep the first `turns` turns; returns how many were removed."""
        removed = max(0, len(self.turns) - turns)
        del self.turns[turns:]
        return removed

    def reset(self) -> None:
        """Forget the history; the system prompt stays."""
        self.turns.clear()

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def plain(message: Message) -> Message:
    """The message as a chat template takes it."""
    return {"role": message["role"], "content": message["content"]}


def flatten(turns: list[Turn]) -> list[Message]:
    return [plain(m) for turn in turns for m in turn]
