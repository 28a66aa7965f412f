"""Reasoning apart from the answer: vLLM's `reasoning_content` beside `content`.

A `ReasoningParser` knows one family's way of writing its reasoning. `stream(prompt_text)` gives a
`ReasoningStream` for one output: `feed(text, final)` turns each piece of generated text into the
reasoning and the content it completes, holding back only what may be the start of a tag, so a
client sees reasoning deltas, then content deltas, as the model writes them. `split` does the same
for a whole output.

Where an output starts is the prompt's business, not the model's: Qwen3's template leaves the
model to open `<think>` itself (or, with `enable_thinking` false, writes an empty `<think></think>`
into the prompt), while DeepSeek-R1's opens it in the prompt. So the stream starts in reasoning
exactly when the rendered prompt leaves a tag open (`starts_in_reasoning`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from cadenza.parsers.markers import FormatTokens, partial_suffix


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What a piece of output text completed: reasoning, then content (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream(ABC):
    """One output's reasoning and content as they are written."""

    @abstractmethod
    def feed(self, text: str, final: bool) -> ReasoningDelta:
        """Add `text`; return the reasoning and the content it completes. With `final` the output
        is over: nothing is held back."""


class ReasoningParser(FormatTokens, ABC):
    """One family's way of writing its reasoning before its answer (or, harmony, beside it)."""

    name: ClassVar[str]

    @abstractmethod
    def stream(self, prompt_text: str | None) -> ReasoningStream:
        """A stream for one output of the prompt rendered as `prompt_text` (None: a prompt that
        was not rendered from chat messages)."""

    def forced_call_reasoning(self, prompt_text: str | None, budget: int) -> str | None:
        """Lark rules (llguidance's dialect) for the reasoning the model may write before a call
        that `tool_choice` forces, for the prompt rendered as `prompt_text`, in at most `budget`
        tokens where the format can bound it (then it is closed, so the call has room): they
        define a rule named `reasoning` (helpers named `reasoning_*`), which the forcing grammar
        puts before the calls; the output then goes through `stream` as any other. None (the
        default): the call comes first, with no reasoning."""
        return None

    def split(self, text: str, prompt_text: str | None) -> tuple[str | None, str | None]:
        """A whole output as (reasoning or None when there is none, content or None when there is
        none), each without its surrounding whitespace."""
        delta = self.stream(prompt_text).feed(text, final=True)
        return delta.reasoning.strip() or None, delta.content.strip() or None


class ThinkTagStream(ReasoningStream):
    """Text between an opening and a closing tag is reasoning; after the closing tag, content. An
    output that begins with the opening tag (leading whitespace aside) opens the reasoning there;
    one that begins otherwise is content, unless the prompt opened the reasoning already."""

    def __init__(self, open_tag: str, close_tag: str, in_reasoning: bool) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.mode = "reasoning" if in_reasoning else "start"
        self.pending = ""
        self.strip_next = in_reasoning  # newlines right after a tag are the format's, not the text's

    def feed(self, text: str, final: bool) -> ReasoningDelta:
        self.pending += text
        reasoning, content = [], []
        while True:
            if self.mode == "start":
                head = self.pending.lstrip()
                if head.startswith(self.open_tag):
                    self.pending = head[len(self.open_tag):]
                    self.mode, self.strip_next = "reasoning", True
                    continue
                if self.open_tag.startswith(head) and not final:
                    break  # perhaps the opening tag, not all here yet
                self.mode = "content"
                continue
            if self.strip_next:
                self.pending = self.pending.lstrip("\n")
                if not self.pending and not final:
                    break  # still inside the newlines after a tag
                self.strip_next = False
            if self.mode == "content":
                content.append(self.pending)
                self.pending = ""
                break
            end = self.pending.find(self.close_tag)
            if end >= 0:
                reasoning.append(self.pending[:end])
                self.pending = self.pending[end + len(self.close_tag):]
                self.mode, self.strip_next = "content", True
                continue
            keep = 0 if final else partial_suffix(self.pending, self.close_tag)
            reasoning.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return ReasoningDelta("".join(reasoning), "".join(content))


class ThinkTagParser(ReasoningParser):
    """`<think>reasoning</think>answer`: Qwen3 (its template leaves the model to open the tag, or
    closes it in the prompt when `enable_thinking` is false), QwQ, and DeepSeek-R1 (its template
    opens the tag in the prompt)."""

    name = "think"
    open_tag, close_tag = "<think>", "</think>"

    def starts_in_reasoning(self, prompt_text: str | None) -> bool:
        """Whether the rendered prompt leaves the tag open for the model to reason in."""
        if not prompt_text:
            return False
        return prompt_text.rfind(self.open_tag) > prompt_text.rfind(self.close_tag)

    def stream(self, prompt_text: str | None) -> ReasoningStream:
        return ThinkTagStream(self.open_tag, self.close_tag, self.starts_in_reasoning(prompt_text))

    def forced_call_reasoning(self, prompt_text: str | None, budget: int) -> str | None:
        # The thought ends at its first closing tag (a lazy rule: llguidance's lexer cannot both
        # bound it and let the tag end it, so `budget` does not apply; max_tokens bounds it, as
        # vLLM's reasoning before structured output is bounded), then the format's blank lines.
        if prompt_text and prompt_text.rstrip().endswith(self.close_tag):
            return None  # the template closed an empty thought: thinking is off (enable_thinking false)
        close, blank = json.dumps(self.close_tag), r"/[ \t\r\n]+/?"
        rules = f"reasoning_text[lazy]: /(?s:.*)/ {close}\n"
        if self.starts_in_reasoning(prompt_text):  # the prompt opened it: the model closes it first
            return f"reasoning: reasoning_text {blank}\n{rules}"
        return f"reasoning: ({json.dumps(self.open_tag)} reasoning_text {blank})?\n{rules}"


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"


# Markers a chat template's text carries for its family's reasoning format, checked in order.
TEMPLATE_MARKERS = (("<|channel|>", "gpt_oss"), ("<think>", "qwen3"))


def parser_name_for_template(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template teaches its model (by its registered name), or None
    when the template writes no reasoning."""
    for marker, name in TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None
