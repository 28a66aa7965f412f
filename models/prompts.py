"""Turning what a caller sends (text, token ids or chat messages) into prompt token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from cadenza.models.tokenizer import Tokenizer

# Variables the chat template is always given by the renderer, never by a caller's extra ones.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages and the tools the model may call, rendered together by the chat template
    (`tools=` reaches the template as with Hugging Face's `apply_chat_template`), with any extra
    template variables (`template_kwargs`: vLLM's `chat_template_kwargs`, Qwen3's
    `enable_thinking`)."""

    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    # vLLM's: the model goes on with the last (assistant) message, rather than answering it: the
    # prompt ends inside that message (Anthropic's "prefill"). `add_generation_prompt` False: the
    # prompt ends where the messages do, with no new turn opened.
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    def render(self, tokenizer: Tokenizer) -> str:
        """The prompt text the chat template makes of it: with the generation prompt, or (continue
        the final message) cut right after the last message's text."""
        reserved = sorted(set(self.template_kwargs or ()) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise PromptError(f"chat template variables {', '.join(reserved)} are set by the renderer, not the caller")
        kwargs = dict(self.template_kwargs or {})
        if self.tools:
            kwargs["tools"] = list(self.tools)
        if not self.continue_final_message:
            return tokenizer.apply_chat_template(self.messages, add_generation_prompt=self.add_generation_prompt, **kwargs)
        last = self.messages[-1] if self.messages else {}
        text = last.get("content") if isinstance(last.get("content"), str) else ""
        if last.get("role") != "assistant" or not text.strip():
            raise PromptError("continue_final_message needs a last message from the assistant, with text to go on from")
        rendered = tokenizer.apply_chat_template(self.messages, add_generation_prompt=False, **kwargs)
        # The template closes the message after its text (an end-of-turn token, a newline): the
        # prompt stops where the text does, as transformers' continue_final_message cuts it.
        end = rendered.rfind(text.strip())
        if end < 0:
            raise PromptError("continue_final_message: the chat template does not write the last message's text as given")
        return rendered[: end + len(text.strip())]


Prompt = Union[str, Sequence[int], Sequence[dict[str, Any]], ChatPrompt, Mapping[str, Any]]
# vLLM's TextPrompt {"prompt": ...} and TokensPrompt {"prompt_token_ids": [...]}.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class PromptError(ValueError):
    """The prompt is malformed, empty or too long; the message says which."""


def is_single_prompt(prompts: Any) -> bool:
    """A bare string, a list of token ids, a list of chat messages or one vLLM-style prompt dict
    ({"prompt": ...} or {"prompt_token_ids": [...]}) is one prompt, not a batch."""
    if isinstance(prompts, (str, ChatPrompt, Mapping)):
        return True
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
        return True
    return (isinstance(prompts, Sequence) and bool(prompts) and all(isinstance(p, dict) for p in prompts)
            and not any(_is_prompt_dict(p) for p in prompts))


def _is_prompt_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and any(key in value for key in _PROMPT_KEYS)


def tokenize_prompt(prompt: Prompt, tokenizer: Tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids); chat messages go through the model's chat template."""
    if isinstance(prompt, Mapping):
        if not _is_prompt_dict(prompt) or set(prompt) - {*_PROMPT_KEYS, "multi_modal_data", "mm_processor_kwargs"}:
            raise PromptError(f"a prompt dict has 'prompt' (text) or 'prompt_token_ids'; got keys {sorted(prompt)}")
        if "multi_modal_data" in prompt:
            raise PromptError("multi_modal_data: this model takes text only")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str):
                raise PromptError("prompt_token_ids must be a list of token ids")
            return tokenize_prompt(list(ids), tokenizer, vocab_size)
        if not isinstance(prompt["prompt"], str):
            raise PromptError("'prompt' must be a string")
        return tokenize_prompt(prompt["prompt"], tokenizer, vocab_size)
    if isinstance(prompt, str):
        check_encodable(prompt, "the prompt")
        ids = tokenizer.encode(prompt)
        text: str | None = prompt
    elif isinstance(prompt, ChatPrompt) or (isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt)):
        chat = prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(prompt)
        for i, message in enumerate(chat.messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise PromptError(f"messages[{i}] needs string 'role' and 'content' fields")
            check_encodable(message["content"], f"messages[{i}].content")
        text = chat.render(tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids, text = list(prompt), None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    else:
        raise PromptError("a prompt is a string, a list of token ids, or a list of chat messages")
    if not ids:
        raise PromptError("the prompt is empty")
    return text, ids


def check_encodable(text: str, what: str) -> None:
    """Text a tokenizer can take: valid Unicode (a lone surrogate is not, though `json.loads` lets one by)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{what} is not valid Unicode: {exc.reason} at position {exc.start}") from None
