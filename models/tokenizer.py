"""A `tokenizers` tokenizer with the model's special ids and chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from cadenza.models.errors import ModelLoadError

ChatMessages = Sequence[dict[str, Any]]


class ChatTemplateError(ValueError):
    """The chat template could not render the given messages (the message says why)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@dataclass
class Tokenizer:
    """Encodes, decodes and renders chats the way the model was trained to see them."""

    backend: HFTokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def __post_init__(self) -> None:
        self._template = None
        if self.chat_template:
            # The same environment transformers renders templates in, so prompts match its own.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def load_hf_tokenizer(directory: Path, eos_token_ids: Sequence[int]) -> Tokenizer:
    """tokenizer.json plus tokenizer_config.json / chat_template.jinja from a HF directory."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read tokenizer: {exc}") from exc
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    eos_ids = list(eos_token_ids)
    if eos is not None and (eos_id := backend.token_to_id(eos)) is not None and eos_id not in eos_ids:
        eos_ids.append(eos_id)
    generation = _read_json(directory / "generation_config.json").get("eos_token_id")
    for extra in generation if isinstance(generation, list) else [generation]:
        if extra is not None and int(extra) not in eos_ids:
            eos_ids.append(int(extra))
    return Tokenizer(
        backend=backend,
        eos_token_ids=tuple(eos_ids),
        bos_token_id=backend.token_to_id(bos) if bos else None,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token
