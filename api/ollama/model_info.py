"""What /api/tags, /api/show and /api/ps say about the served model, read once from its files.

`size` is the bytes of its weight files; `digest` a sha256 of its name, files, sizes and
modification times (not of the contents: hashing gigabytes per listing costs too much, and it still
changes when the files do); `parameter_size` counts the tensors' elements in the files' headers;
`quantization_level` is a GGUF's file type, else the weights' dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

from cadenza.api.ollama.translate import listed_name
from cadenza.api.state import ServerState

log = structlog.get_logger("cadenza.api")

_WEIGHTS = ("*.safetensors", "*.gguf", "*.bin")


@dataclass(frozen=True)
class ModelFiles:
    """What the weight files say: their bytes, newest modification, digest, format, parameters and
    GGUF file type ("" when unknown)."""

    size: int
    modified_at: str
    digest: str
    format: str
    parameter_count: int
    file_type: str


@lru_cache(maxsize=4)
def model_files(path: str | None) -> ModelFiles:
    source = Path(path) if path else None
    files = []
    if source is not None and source.is_file():
        files = [source]
    elif source is not None and source.is_dir():
        files = sorted(f for pattern in _WEIGHTS for f in source.glob(pattern))
    stats = [f.stat() for f in files]
    identity = [path, [(f.name, s.st_size, s.st_mtime_ns) for f, s in zip(files, stats)]]
    digest = hashlib.sha256(json.dumps(identity).encode())
    newest = max((s.st_mtime for s in stats), default=0.0)
    gguf = bool(files) and files[0].suffix == ".gguf"
    count, file_type = 0, ""
    try:
        if gguf:
            count, file_type = _read_gguf(files[0])
        else:
            count = sum(_safetensors_count(f) for f in files if f.suffix == ".safetensors")
    except Exception as exc:  # a header cadenza could load but not read here: the listing says less
        log.warning("Could not read the model's headers for Ollama's details", error=repr(exc))
    return ModelFiles(
        size=sum(s.st_size for s in stats),
        modified_at=datetime.fromtimestamp(newest, timezone.utc).isoformat().replace("+00:00", "Z"),
        digest=digest.hexdigest(),
        format="gguf" if gguf else "safetensors",
        parameter_count=count,
        file_type=file_type,
    )


def _read_gguf(path: Path) -> tuple[int, str]:
    import gguf

    from cadenza.models.gguf_file import GGUFFile

    read = GGUFFile(path)
    count = sum(math.prod(int(d) for d in t.shape) for t in read.tensors)
    kind = read.fields.get("general.file_type")
    name = gguf.LlamaFileType(int(kind)).name.removeprefix("MOSTLY_").removeprefix("ALL_") if kind is not None else ""
    return count, name


def _safetensors_count(path: Path) -> int:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")


def parameter_size(count: int) -> str:
    """Ollama's way: 134.52M, 8.0B."""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    if count >= 1_000_000:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.2f}K" if count else ""


def weights_path(state: ServerState) -> str | None:
    loaded = state.engine.runtime.loaded
    source = getattr(loaded, "source", None) or state.config.model.path
    if source is None:
        try:
            from cadenza.models.default_model import default_model_path

            source = str(default_model_path())
        except Exception:
            return None
    return str(source)


def details(state: ServerState) -> dict[str, Any]:
    files = model_files(weights_path(state))
    family = state.engine.runtime.loaded.arch.model_type
    loaded = state.engine.runtime.loaded
    dtype = str(getattr(loaded, "dtype", state.config.model.dtype)).removeprefix("torch.")
    level = files.file_type or {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype, dtype.upper())
    return {"parent_model": "", "format": files.format, "family": family, "families": [family],
            "parameter_size": parameter_size(files.parameter_count), "quantization_level": level}


def listing(state: ServerState) -> dict[str, Any]:
    """The model as /api/tags and /api/ps list it."""
    files = model_files(weights_path(state))
    name = listed_name(state.model_name)
    return {"name": name, "model": name, "modified_at": files.modified_at, "size": files.size,
            "digest": files.digest, "details": details(state)}


def unloaded_listing(name: str, path: str | None) -> dict[str, Any]:
    """A model of the server's `models` that is not loaded, as /api/tags lists it: from its files."""
    files = model_files(path)
    return {"name": listed_name(name), "model": listed_name(name), "modified_at": files.modified_at,
            "size": files.size, "digest": files.digest, "details": {"format": files.format}}


def wall_clock(monotonic_at: float) -> str:
    """A `time.monotonic()` instant as Ollama writes times (RFC 3339, UTC)."""
    at = time.time() + (monotonic_at - time.monotonic())
    return datetime.fromtimestamp(at, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def model_info(state: ServerState) -> dict[str, Any]:
    """/api/show's `model_info`, under GGUF's key names."""
    arch = state.engine.runtime.loaded.arch
    family = arch.model_type
    files = model_files(weights_path(state))
    return {
        "general.architecture": family, "general.basename": state.model_name,
        "general.parameter_count": files.parameter_count,
        f"{family}.context_length": state.engine.runtime.max_model_len,
        f"{family}.embedding_length": arch.hidden_size, f"{family}.feed_forward_length": arch.intermediate_size,
        f"{family}.block_count": arch.num_layers, f"{family}.attention.head_count": arch.num_heads,
        f"{family}.attention.head_count_kv": arch.num_kv_heads, f"{family}.vocab_size": arch.vocab_size,
    }  # fmt: skip


def capabilities(state: ServerState) -> list[str]:
    """What the served model does: completion and embedding always (any decoder's pooled states),
    tools when its chat template shows the model tools, thinking when a reasoning parser reads it."""
    template = state.engine.runtime.tokenizer.chat_template or ""
    found = ["completion"]
    if "tools" in template:
        found.append("tools")
    if state.reasoning_parser is not None:
        found.append("thinking")
    return [*found, "embedding"]


def parameters(state: ServerState) -> str:
    """/api/show's `parameters`: the deployment's sampling defaults, in a Modelfile's words."""
    d = state.config.sampling.defaults
    values = {"num_ctx": state.engine.runtime.max_model_len, "num_predict": d.max_tokens if d.max_tokens else -1,
              "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
              "repeat_penalty": d.repetition_penalty, "presence_penalty": d.presence_penalty,
              "frequency_penalty": d.frequency_penalty}  # fmt: skip
    return "\n".join(f"{name:<30} {value}" for name, value in values.items())


def modelfile(state: ServerState) -> str:
    template = state.engine.runtime.tokenizer.chat_template or ""
    lines = ["# Modelfile generated by cadenza (its template is Jinja, not Go's text/template)",
             f"FROM {weights_path(state) or state.model_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER {line}" for line in parameters(state).splitlines()]
    return "\n".join(lines) + "\n"
