"""Short names for the config keys people set most, generated from the config schema: one table,
read by the command line (flags) and the Python API (`LLM`'s keyword arguments).

Each `ConfigAlias` names a YAML key and, by default, derives both short names from its last part
(`scheduler.max_num_seqs`: `--max-num-seqs`, `max_num_seqs=`); vLLM's name is written out where
it differs, and either name is None where that surface does not offer the key. A flag's help is its
key's description, its choices the key's literal values, its type the key's (an int key parses
ints), and `--help` shows the key beside it. `cadenza serve`, `generate`, `config show` and `bench`
add their flags from this table, and `LLM(...)` maps its keywords through it, so a short name and
its key cannot drift apart. Importing this costs no torch.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from pydantic import BaseModel

from cadenza.config.schema import CadenzaConfig

DERIVED = "derived"  # a short name made from the key's last part


@dataclass(frozen=True, slots=True)
class ConfigAlias:
    """The config key `path` (dotted, as in the YAML), its command-line flag and its `LLM` keyword."""

    path: str
    flag: str | None = DERIVED
    keyword: str | None = DERIVED

    def __post_init__(self) -> None:
        leaf = self.path.rsplit(".", 1)[-1]
        if self.flag == DERIVED:
            object.__setattr__(self, "flag", "--" + leaf.replace("_", "-"))
        if self.keyword == DERIVED:
            object.__setattr__(self, "keyword", leaf)


@dataclass(frozen=True, slots=True)
class ConfigFlag:
    """`flag` sets the config key `path`; `type` parses its value (the key's own type)."""

    flag: str
    path: str
    type: Callable[[str], Any] = str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


ALIASES: tuple[ConfigAlias, ...] = (
    ConfigAlias("model.path", "--model", None),  # `LLM(model)` takes it as its first argument
    ConfigAlias("model.dtype"),
    ConfigAlias("model.device"),
    ConfigAlias("model.load_format"),
    ConfigAlias("model.max_model_len"),
    ConfigAlias("model.num_threads"),
    ConfigAlias("model.thread_policy"),
    ConfigAlias("model.thread_binding"),
    ConfigAlias("model.quantization"),
    ConfigAlias("model.moe_experts_on"),
    ConfigAlias("model.cuda_graphs"),
    ConfigAlias("model.seed", flag=None),
    ConfigAlias("model.cpu_kernels", flag=None),
    ConfigAlias("attention_backend"),
    ConfigAlias("cache.block_size"),
    ConfigAlias("cache.memory_budget", "--kv-cache-memory"),
    ConfigAlias("cache.dtype", "--kv-cache-dtype", "kv_cache_dtype"),
    ConfigAlias("cache.num_blocks", flag=None),
    ConfigAlias("cache.eviction_policy", flag=None),
    ConfigAlias("cache.enable_prefix_caching", flag=None),
    ConfigAlias("cache.host_size", "--kv-host-size", "kv_host_size"),
    ConfigAlias("cache.disk_path", "--kv-disk-path", "kv_disk_path"),
    ConfigAlias("cache.disk_size", "--kv-disk-size", "kv_disk_size"),
    ConfigAlias("cache.host_eviction_policy", "--kv-host-eviction-policy", "kv_host_eviction_policy"),
    ConfigAlias("cache.disk_eviction_policy", "--kv-disk-eviction-policy", "kv_disk_eviction_policy"),
    ConfigAlias("scheduler.max_num_seqs"),
    ConfigAlias("scheduler.max_num_batched_tokens"),
    ConfigAlias("scheduler.chunk_size", flag=None),
    ConfigAlias("parallel.tensor_parallel_size"),
    ConfigAlias("parallel.data_parallel_size"),
    ConfigAlias("parallel.router"),
    ConfigAlias("parallel.launcher"),
    ConfigAlias("parallel.ray_placement"),
    ConfigAlias("parallel.disaggregation.prefill", "--prefill-replicas", "prefill_replicas"),
    ConfigAlias("parallel.disaggregation.decode", "--decode-replicas", "decode_replicas"),
    ConfigAlias("parallel.disaggregation.connector", "--kv-connector", "kv_connector"),
    ConfigAlias("speculative.method", "--speculative-method", "speculative_method"),
    ConfigAlias("speculative.num_tokens", "--num-speculative-tokens", "num_speculative_tokens"),
    ConfigAlias("speculative", None, "speculative_config"),  # vLLM's: {"method": "ngram", "num_tokens": 8}
    ConfigAlias("server.reasoning_parser", keyword=None),
    ConfigAlias("server.tool_parser", "--tool-call-parser", None),  # vLLM's flag  # vLLM's --reasoning-parser; the server's concern
    ConfigAlias("sampling.sampler", flag=None),
    ConfigAlias("sampling.logits_processors", flag=None),
    ConfigAlias("plugins", flag=None),
    ConfigAlias("plugin_options", flag=None),
)


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


def _parser(annotation) -> Callable[[str], Any]:
    """How a flag parses its key's value: int for an int key (also `int | None`), else the string
    (a key that takes `512MiB` as well as a number parses in the schema)."""
    return int if annotation is int or set(typing.get_args(annotation)) == {int, type(None)} else str


# What the command line offers, and what `LLM(...)` takes: both read off ALIASES.
CONFIG_FLAGS: tuple[ConfigFlag, ...] = tuple(
    ConfigFlag(a.flag, a.path, _parser(schema_field(a.path).annotation)) for a in ALIASES if a.flag is not None
)
BY_FLAG = {f.flag: f for f in CONFIG_FLAGS}
KEYWORDS: dict[str, str] = {a.keyword: a.path for a in ALIASES if a.keyword is not None}


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
