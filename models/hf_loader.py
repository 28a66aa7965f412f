"""Reads a Hugging Face model directory: config.json and one or sharded safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from cadenza.models.config import ModelArchConfig
from cadenza.models.errors import ModelLoadError
from cadenza.models.families import FAMILIES, Family
from cadenza.models.moe import is_router_weight

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: Path) -> ModelArchConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no config.json; is this a Hugging Face model directory?")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc
    try:
        return ModelArchConfig.from_hf(raw, source=str(path))
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing required key {exc.args[0]!r}") from exc


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files, in the order the shard index names them (never a pickle)."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: invalid shard index: {exc!r}") from exc
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded)" if pickles else ""
        raise ModelLoadError(f"{directory}: no *.safetensors weights{hint}")
    return files


def safetensors_shapes(files: list[Path], family: Family = FAMILIES["llama"]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under its canonical name, read from the files' headers (no tensor is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    canonical, shape = family.canonical_name(name), tuple(handle.get_slice(name).get_shape())
                    if family.gpt_oss and _is_stacked_experts(canonical):
                        meta = torch.empty(shape, device="meta")
                        shapes.update((n, tuple(t.shape)) for n, t in split_stacked_experts(canonical, meta))
                    else:
                        shapes[canonical] = shape
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return shapes


_STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj",
            ".mlp.experts.down_proj_bias")


def _is_stacked_experts(name: str) -> bool:
    return name.endswith(_STACKED)


def split_stacked_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's experts, stored as one tensor per layer and projection with the inputs first
    ([experts, in, out]) and gate and up interleaved (gate: even outputs, up: odd), as the
    per-expert canonical tensors the decoder loads (`...experts.N.gate_proj.weight` [out, in])."""
    prefix, _, kind = name.rpartition(".")
    for e in range(tensor.shape[0]):
        base = f"{prefix}.{e}"
        if kind == "gate_up_proj":
            yield f"{base}.gate_proj.weight", tensor[e, :, 0::2].t().contiguous()
            yield f"{base}.up_proj.weight", tensor[e, :, 1::2].t().contiguous()
        elif kind == "gate_up_proj_bias":
            yield f"{base}.gate_proj.bias", tensor[e, 0::2].contiguous()
            yield f"{base}.up_proj.bias", tensor[e, 1::2].contiguous()
        elif kind == "down_proj":
            yield f"{base}.down_proj.weight", tensor[e].t().contiguous()
        else:
            yield f"{base}.down_proj.bias", tensor[e]


def iter_safetensors(files: list[Path], dtype: torch.dtype, family: Family = FAMILIES["llama"]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its canonical name (`family`'s renames), in `dtype` (a router's in float32)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    canonical = family.canonical_name(name)
                    wanted = torch.float32 if is_router_weight(canonical) else dtype
                    if family.gpt_oss and _is_stacked_experts(canonical):
                        for part, tensor in split_stacked_experts(canonical, handle.get_tensor(name)):
                            yield part, tensor.to(wanted)
                        continue
                    yield canonical, handle.get_tensor(name).to(wanted)
        except SafetensorError as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
