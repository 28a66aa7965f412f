"""Command-line flags for the config keys people set most, generated from the config schema.

Each `ConfigFlag` names a flag (vLLM's name where vLLM has one) and the YAML key it sets; its help
is that key's description, its choices the key's literal values, and `--help` shows the key
beside it. `cadenza serve`, `generate`, `config show` and `bench` add their flags from this one
table, so a flag and its key cannot drift apart. Importing this costs no torch.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from pydantic import BaseModel

from cadenza.config.schema import CadenzaConfig


@dataclass(frozen=True, slots=True)
class ConfigFlag:
    """`flag` sets the config key `path` (dotted, as in the YAML); `type` parses its value."""

    flag: str
    path: str
    type: Callable[[str], Any] = str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


CONFIG_FLAGS: tuple[ConfigFlag, ...] = (
    ConfigFlag("--model", "model.path"),
    ConfigFlag("--dtype", "model.dtype"),
    ConfigFlag("--device", "model.device"),
    ConfigFlag("--load-format", "model.load_format"),
    ConfigFlag("--max-model-len", "model.max_model_len", int),
    ConfigFlag("--num-threads", "model.num_threads", int),
    ConfigFlag("--thread-policy", "model.thread_policy"),
    ConfigFlag("--thread-binding", "model.thread_binding"),
    ConfigFlag("--quantization", "model.quantization"),
    ConfigFlag("--cuda-graphs", "model.cuda_graphs"),
    ConfigFlag("--attention-backend", "attention_backend"),
    ConfigFlag("--block-size", "cache.block_size", int),
    ConfigFlag("--kv-cache-memory", "cache.memory_budget"),
    ConfigFlag("--kv-cache-dtype", "cache.dtype"),
    ConfigFlag("--max-num-seqs", "scheduler.max_num_seqs", int),
    ConfigFlag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", int),
    ConfigFlag("--tensor-parallel-size", "parallel.tensor_parallel_size", int),
    ConfigFlag("--data-parallel-size", "parallel.data_parallel_size", int),
    ConfigFlag("--router", "parallel.router"),
    ConfigFlag("--launcher", "parallel.launcher"),
    ConfigFlag("--ray-placement", "parallel.ray_placement"),
    ConfigFlag("--prefill-replicas", "parallel.disaggregation.prefill", int),
    ConfigFlag("--decode-replicas", "parallel.disaggregation.decode", int),
    ConfigFlag("--kv-connector", "parallel.disaggregation.connector"),
    ConfigFlag("--speculative-method", "speculative.method"),
    ConfigFlag("--num-speculative-tokens", "speculative.num_tokens", int),
)
BY_FLAG = {f.flag: f for f in CONFIG_FLAGS}


def schema_field(path: str):
    """The pydantic `FieldInfo` of a dotted config key (KeyError naming the key if there is none)."""
    model: type[BaseModel] = CadenzaConfig
    *sections, name = path.split(".")
    for section in sections:
        if section not in model.model_fields:
            raise KeyError(f"config key {path!r} does not exist")
        model = model.model_fields[section].annotation  # a section's type is its model
    if name not in model.model_fields:
        raise KeyError(f"config key {path!r} does not exist")
    return model.model_fields[name]


def _choices(annotation) -> list[str] | None:
    """A Literal's values (also inside `X | None`), else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
    return None


def add_config_flags(parser: argparse.ArgumentParser, flags: Iterable[str] | None = None,
                     notes: dict[str, str] | None = None) -> None:
    """Add `flags` (all of CONFIG_FLAGS by default) to `parser`; `notes[flag]` is appended to a
    flag's help (what a command does with it beyond setting the key)."""
    for name in flags if flags is not None else BY_FLAG:
        flag = BY_FLAG[name]
        field = schema_field(flag.path)
        help_text = f"{field.description.rstrip('.')} [YAML: {flag.path}]"
        if notes and name in notes:
            help_text += f" {notes[name]}"
        # argparse formats help with %: a literal percent in a description must be doubled.
        parser.add_argument(flag.flag, dest=flag.dest, type=flag.type, choices=_choices(field.annotation),
                            metavar=flag.path.rsplit(".", 1)[-1].upper() if _choices(field.annotation) is None else None,
                            help=help_text.replace("%", "%%"))  # fmt: skip


def flag_overrides(args: argparse.Namespace, flags: Iterable[str] | None = None) -> dict[str, Any]:
    """The config overrides (dotted key -> value) of the flags given on the command line."""
    names = flags if flags is not None else BY_FLAG
    return {BY_FLAG[n].path: value for n in names if (value := getattr(args, BY_FLAG[n].dest, None)) is not None}
