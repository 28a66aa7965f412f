"""OpenAI's harmony format (gpt-oss): reasoning, answer and tool calls as messages on channels.

After the prompt's `<|start|>assistant` the model writes messages, each a header, `<|message|>`,
its text and an end (`<|end|>`; `<|return|>` after the answer, `<|call|>` after a tool call):

    <|channel|>analysis<|message|>Paris, so the weather tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The header's channel says what the text is: `analysis` the reasoning, `final` the answer,
`commentary` a preamble shown to the user or, with a recipient (`to=functions.NAME`), a tool call.
The recipient may also stand right after the role (`<|start|>assistant to=functions.f<|channel|>
commentary json<|message|>`, as gpt-oss's template renders past calls). The first message's
`<|start|>assistant` is the prompt's.

The markers are special tokens of gpt-oss's tokenizer, so both parsers here keep them in their text
(`keeps_special_tokens`) and `<|return|>` and `<|call|>` end the output (`end_tokens`), whatever
the model's config lists as its end. `HarmonyReasoningStream` routes each message's text by its
header: analysis to reasoning, final and commentary to content; a call to a function passes into
the content whole, as written (with the prompt's `<|start|>assistant` where the output began with
it), for `HarmonyToolParser`, which takes such calls out of that text or out of a raw output; a
call to a built-in tool (python, browser) is the model's own work, its text reasoning.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from cadenza.parsers.markers import partial_suffix
from cadenza.parsers.reasoning import ReasoningDelta, ReasoningParser, ReasoningStream
from cadenza.parsers.tool_calls import Consumed, ToolCall, ToolParser, settled_name
from cadenza.parsers.tool_schemas import closed_arguments, json_rule

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)  # what ends a message
BREAKS = (*ENDS, START)  # what ends a message's text: its end, or (its end missing) the next message
FUNCTIONS = "functions."
# What a header may begin with: the next message's start, or (the first message) its channel or recipient.
OPENERS = (START, CHANNEL, "to=")
MAX_HEADER = 512  # characters; a header is a few words, so longer text before <|message|> is not one

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_FUNCTION = re.compile(r"to=" + re.escape(FUNCTIONS) + r"([^\s<]*)")


@dataclass(frozen=True, slots=True)
class Header:
    """What a message's header says: its channel, and its recipient when it is a call."""

    channel: str | None
    recipient: str | None

    @property
    def function(self) -> str | None:
        """The function a call to `functions.NAME` calls."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]


def read_header(text: str) -> Header:
    """The header's last channel (gpt-oss-20b sometimes writes a stray `<|channel|>commentary`
    before the real one) and its recipient: a function where one is named; `to=assistant`, which
    such a stray part may carry, is no call."""
    channels = _CHANNEL.findall(text)
    recipients = [r for r in _RECIPIENT.findall(text) if r != "assistant"]
    function = next((r for r in recipients if r.startswith(FUNCTIONS)), None)
    return Header(channels[-1] if channels else None, function or (recipients[-1] if recipients else None))


def _first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """(where the first of `markers` in `text` from `start` is, which one), or (-1, "")."""
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found) if found else (-1, "")


def _opens(text: str, final: bool) -> bool:
    """Whether `text` (blanks aside) begins a header, or (not `final`) may be the start of one."""
    head = text.lstrip()
    return any(head.startswith(o) or (not final and o.startswith(head)) for o in OPENERS) if head else not final


def _arguments(body: str) -> str:
    """A call's arguments as JSON text: its body re-written where it is JSON, else as written."""
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):
        return body.strip()


# --- reasoning ----------------------------------------------------------------------------------


class HarmonyReasoningStream(ReasoningStream):
    """One output's messages, each routed as its header arrives. Reasoning and content may
    alternate (an analysis after a preamble); two messages of one field are a paragraph apart."""

    def __init__(self, opened: str | None = None) -> None:
        self.pending = ""
        self.route: str | None = None  # the open message's: "reasoning", "content" or "call"; None: in a header
        self.written = {"reasoning": False, "content": False}  # the field has text already
        self.fresh = False  # the open message has written nothing yet
        # The prompt opened a message (its header, from its <|start|>): the output is its text.
        self.opening = "" if opened is None else self._open(opened)

    def feed(self, text: str, final: bool) -> ReasoningDelta:
        self.pending += text
        out: dict[str, list[str]] = {"reasoning": [], "content": [self.opening]}
        self.opening = ""
        while True:
            if self.route is None:
                if not self._read_header(out, final):
                    break
                continue
            stop, marker = _first(self.pending, BREAKS)
            if stop < 0:
                keep = 0 if final else max(partial_suffix(self.pending, m) for m in BREAKS)
                self._write(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            self._write(out, self.pending[:stop])
            if self.route == "call" and marker != START:
                out["content"].append(marker)  # the call whole, for the tool parser
            self.pending = self.pending[stop + (0 if marker == START else len(marker)) :]
            self.route = None
        return ReasoningDelta("".join(out["reasoning"]), "".join(out["content"]))

    def _read_header(self, out: dict[str, list[str]], final: bool) -> bool:
        """Read the header `pending` begins with; True when a message's text begins (or what
        follows is no harmony at all: content), False when the header is not all here yet."""
        if not _opens(self.pending, final) or len(self.pending) > MAX_HEADER and MESSAGE not in self.pending:
            self.route, self.fresh = "content", True  # no header: text as the model wrote it
            return True
        begin = self.pending.find(MESSAGE)
        broken, marker = _first(self.pending, ENDS)
        if 0 <= broken and (begin < 0 or broken < begin):  # a header that ends before its text: markup only
            self.pending = self.pending[broken + len(marker) :]
            return True
        if begin < 0:
            if final:
                self.pending = ""  # a header cut short: no text
            return False
        header, self.pending = self.pending[:begin], self.pending[begin + len(MESSAGE) :]
        out["content"].append(self._open(header))
        return True

    def _open(self, header: str) -> str:
        """Begin the message whose header is `header` (as written, up to its `<|message|>`);
        returns the content it adds at once: a call's header, for the tool parser."""
        said = read_header(header)
        self.fresh, self.route = True, "content"  # final, or a commentary preamble
        if said.function is not None:
            self.route = "call"
            head = header.lstrip()
            if not head.startswith(START):  # the first message: its start was the prompt's
                head = START + "assistant" + (" " if head.startswith("to=") else "") + head
            return head + MESSAGE
        if said.recipient is not None or said.channel == "analysis":
            self.route = "reasoning"  # built-in tools (python, browser) are the model's own work
        return ""

    def _write(self, out: dict[str, list[str]], text: str) -> None:
        if not text:
            return
        field = "content" if self.route == "call" else self.route
        if self.route != "call":
            if self.fresh and self.written[field]:
                text = "\n\n" + text
            self.written[field] = True
        self.fresh = False
        out[field].append(text)


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony: analysis is reasoning; final and commentary are content."""

    name = "gpt_oss"
    keeps_special_tokens = True
    end_tokens = (RETURN, CALL)

    def stream(self, prompt_text: str | None) -> ReasoningStream:
        return HarmonyReasoningStream(self._opened(prompt_text))

    @staticmethod
    def _opened(prompt_text: str | None) -> str | None:
        """The header of the message the prompt leaves open, or None. The prompt ends with
        `<|start|>assistant`, the header to come; or, where it wrote a header too (a continued
        answer), inside that message's text."""
        tail = prompt_text.rpartition(START)[2] if prompt_text and START in prompt_text else ""
        header, opened, text = tail.partition(MESSAGE)
        inside = tail.startswith("assistant") and opened and not any(m in text for m in ENDS)
        return START + header if inside else None


    def forced_call_reasoning(self, prompt_text: str | None, budget: int) -> str | None:
        # An analysis message may come before the call, as gpt-oss writes one; its text holds no
        # special token, so it ends at the message's end. A prompt inside a message already
        # (a continued answer) has no room for one.
        if self._opened(prompt_text) is not None:
            return None
        return (f'reasoning: ({CHANNEL} "analysis" {MESSAGE} reasoning_text {END} {START} "assistant")?\n'
                f"reasoning_text[max_tokens={max(1, budget)}]: /(?s:.*)/\n")


class HarmonyReasoningParser(GptOssReasoningParser):
    name = "harmony"


# --- tool calls ---------------------------------------------------------------------------------


class HarmonyToolParser(ToolParser):
    """A message to `functions.NAME` is a call, its text the JSON arguments; each such message
    another call. Everything else stays as written: the reasoning parser's content (plain text,
    with the calls it passed on), or a raw output's other messages, markers and all (with
    `reasoning_parser: none`, or a forced call's output)."""

    name = "harmony"
    keeps_special_tokens = True
    end_tokens = (RETURN, CALL)

    def consume(self, text: str, final: bool) -> Consumed:
        content, calls, position = [], [], 0
        while True:
            begin = self._next_header(text, position, final)
            if begin < 0:
                keep = 0 if final else partial_suffix(text[position:], START)
                content.append(text[position : len(text) - keep])
                return Consumed("".join(content), calls, text[len(text) - keep :])
            content.append(text[position:begin])
            head = begin + (len(START) if text.startswith(START, begin) else 0)
            found = text.find(MESSAGE, head)
            broken, _ = _first(text, BREAKS, head)
            if found < 0 and broken < 0 and not final:
                return Consumed("".join(content), calls, text[begin:])  # the header, not all here yet
            if found < 0 or 0 <= broken < found:  # no header after all: as written
                position = broken if broken >= 0 else len(text)
                content.append(text[begin:position])
                continue
            body = found + len(MESSAGE)
            function = read_header(text[begin:found]).function
            if function is None:  # another message: as written
                content.append(text[begin:body])
                position = body
                continue
            stop, marker = _first(text, BREAKS, body)
            if stop < 0 and not final:
                return Consumed("".join(content), calls, text[begin:])  # the call, not all here yet
            calls.append(ToolCall(function, _arguments(text[body : stop if stop >= 0 else len(text)])))
            position = len(text) if stop < 0 else stop + (0 if marker == START else len(marker))

    @staticmethod
    def _next_header(text: str, position: int, final: bool) -> int:
        """Where the next header that may be a call begins: at `position` when the text there
        opens one (a raw output's first message), else at the next `<|start|>`; -1: none."""
        if _opens(text[position:], final) and text[position:].strip():
            return position + len(text[position:]) - len(text[position:].lstrip())
        return text.find(START, position)

    def parse_forced(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        calls = []
        for block in text.split(START):
            if not block.strip():
                continue  # nothing written yet (before the first call, or between two)
            header, opened, body = block.partition(MESSAGE)
            match = _FUNCTION.search(header)
            written = match[1] if match else ""
            closed = match is not None and match.end() < len(header)  # something follows the name
            name = written if closed else settled_name(written, names)
            stop = _first(body, ENDS)[0]
            body = body[:stop] if stop >= 0 else body
            try:
                arguments = json.dumps(json.loads(body), ensure_ascii=False)
            except (json.JSONDecodeError, RecursionError):  # cut short: the arguments as far as they got
                arguments = body.rstrip(" \t\n\r") if opened else ""
            calls.append(ToolCall(name, arguments))
        return calls

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        # <|...|> (unquoted) is llguidance's name for a special token; quoted text never matches one.
        rules = []
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = json_rule(closed_arguments(function.get("parameters")))
            header = json.dumps(f"commentary to={FUNCTIONS}{function['name']} ")
            rules.append(f'call_{i}: {CHANNEL} {header} {CONSTRAIN} "json" {MESSAGE} {schema} {CALL}')
        start = f'start: call ({START} "assistant" call)*' if parallel else "start: call"
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"
