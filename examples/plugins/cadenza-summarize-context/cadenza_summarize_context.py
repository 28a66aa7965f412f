"""A cadenza context policy: summarise the oldest turns with the served model itself."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cadenza.plugins.hookspecs import hookimpl
from cadenza.policies.context import ContextPolicy, ContextWindow, Message, Turn

INSTRUCTION = (
    "Summarise the conversation below in a few sentences for whoever continues it. "
    "Keep names, numbers, facts and decisions; leave out greetings."
)
SUMMARY_PREFIX = "(Summary of our earlier conversation) "


class SummarizeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_turns: int = Field(2, ge=0, le=64, description="The most recent turns kept word for word.")
    summary_tokens: int = Field(96, ge=8, le=1024, description="The longest summary, in tokens.")


class SummarizePolicy(ContextPolicy):
    name = "summarize"
    options_model = SummarizeOptions

    def __init__(self, options: SummarizeOptions | None = None) -> None:
        super().__init__(options or SummarizeOptions())

    async def fit(self, window: ContextWindow) -> list[Turn]:
        turns = window.turns
        keep = min(self.options.keep_turns, len(turns))
        old, recent = turns[: len(turns) - keep], turns[len(turns) - keep :]
        kept = list(recent)
        summary = await self._summarise(window, old) if old else ""
        if summary:
            kept.insert(0, [{"role": "user", "content": SUMMARY_PREFIX + summary}, {"role": "assistant", "content": "Noted."}])
        # Still too long: drop kept turns after the summary, oldest first, then the summary itself.
        while kept and await window.count(kept) > window.budget:
            kept.pop(1 if summary and len(kept) > 1 else 0)
        return kept

    async def _summarise(self, window: ContextWindow, old: list[Turn]) -> str:
        """A summary of `old`: of as many of its latest turns as the summary's prompt can hold."""
        room = window.max_model_len - self.options.summary_tokens
        first = 0
        while first < len(old) and await window.count_messages(_prompt(old[first:])) > room:
            first += 1  # the oldest turns go first; one render per turn that does not fit
        if first == len(old):
            return ""
        return (await window.generate(_prompt(old[first:]), self.options.summary_tokens)).strip()


def _prompt(turns: list[Turn]) -> list[Message]:
    transcript = "\n".join(f"{m['role']}: {m['content']}" for turn in turns for m in turn)
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": transcript}]


@hookimpl
def register_context_policies(register):
    register(SummarizePolicy.name, SummarizePolicy)
