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
from cadenza.models.quantized_linear import QuantizedTensor

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
                    if family.gpt_oss and canonical.endswith(_MXFP4_SUFFIXES):
                        continue  # MXFP4 experts: raw blocks or de-quantized (`iter_safetensors`), never re-quantized
                    if family.gpt_oss and _is_stacked_experts(canonical):
                        meta = torch.empty(shape, device="meta")
                        shapes.update((n, tuple(t.shape)) for n, t in split_stacked_experts(canonical, meta))
                    else:
                        shapes[canonical] = shape
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return shapes


_MXFP4_SUFFIXES = ("_blocks", "_scales")


def mxfp4_expert_names(files: list[Path], family: Family) -> frozenset[str]:
    """The per-expert canonical weight names a gpt-oss checkpoint stores as MXFP4 (`*_blocks` and
    `*_scales`, read from the headers), which `iter_safetensors(mxfp4_native=True)` hands over as
    raw GGUF blocks."""
    if not family.gpt_oss:
        return frozenset()
    names: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    canonical = family.canonical_name(name)
                    if canonical.endswith("_blocks"):
                        stem = canonical.removesuffix("_blocks")
                        experts = handle.get_slice(name).get_shape()[0]
                        names.update(n for e in range(experts) for n, _ in _expert_parts(stem, e))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return frozenset(names)


def _expert_parts(stem: str, expert: int) -> list[tuple[str, slice]]:
    """(canonical name, its outputs of the stack) of expert `expert` of one of gpt-oss's expert
    stacks (`...experts.gate_up_proj`, its `_bias`, `down_proj` or its `_bias`): gate and up are
    interleaved in gate_up, gate the even outputs and up the odd."""
    prefix, _, kind = stem.rpartition(".")
    base, suffix = f"{prefix}.{expert}", "bias" if kind.endswith("_bias") else "weight"
    if kind.startswith("gate_up_proj"):
        return [(f"{base}.gate_proj.{suffix}", slice(0, None, 2)), (f"{base}.up_proj.{suffix}", slice(1, None, 2))]
    return [(f"{base}.down_proj.{suffix}", slice(None))]


def _split_mxfp4_experts(stem: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, native: bool,
                         source: str) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """An MXFP4 expert stack (blocks [experts, out, n, 16], scales [experts, out, n]: [out, in]
    already, unlike the float layout) as each expert's weights: GGUF MXFP4 blocks, exactly as
    llama.cpp's converter writes them, or (not `native`) de-quantized to `dtype`, one expert at a time."""
    from cadenza.models.mxfp4 import QTYPE, dequantize_mxfp4, mxfp4_from_hf

    if blocks.shape[:-1] != scales.shape or blocks.dim() != 4:
        raise ModelLoadError(f"{source}: {stem}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                             "do not match")
    in_features = blocks.shape[2] * 32
    for e in range(blocks.shape[0]):
        raw = mxfp4_from_hf(blocks[e], scales[e])  # [out, n * 17]
        for name, rows in _expert_parts(stem, e):
            part = raw[rows].contiguous()
            yield name, QuantizedTensor(part, QTYPE, in_features) if native else dequantize_mxfp4(part).to(dtype)


_STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj",
            ".mlp.experts.down_proj_bias")


def _is_stacked_experts(name: str) -> bool:
    return name.endswith(_STACKED)


def split_stacked_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's experts, stored as one tensor per layer and projection with the inputs first
    ([experts, in, out]; biases [experts, out]) and gate and up interleaved, as the per-expert
    canonical tensors the decoder loads (`...experts.N.gate_proj.weight` [out, in])."""
    for e in range(tensor.shape[0]):
        for part, outputs in _expert_parts(name, e):
            if tensor.dim() == 2:  # biases
                yield part, tensor[e, outputs].contiguous()
            else:
                yield part, tensor[e, :, outputs].t().contiguous()


def iter_safetensors(files: list[Path], dtype: torch.dtype, family: Family = FAMILIES["llama"],
                     mxfp4_native: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Every tensor under its canonical name (`family`'s renames), in `dtype` (a router's in float32);
    gpt-oss's MXFP4 experts as raw GGUF blocks (`mxfp4_native`) or de-quantized."""
    pending: dict[str, torch.Tensor] = {}  # an MXFP4 stack's blocks or scales, until the other arrives
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    canonical = family.canonical_name(name)
                    if family.gpt_oss and canonical.endswith(_MXFP4_SUFFIXES):
                        stem, kind = canonical[:-7], canonical[-6:]
                        partner = pending.pop(stem + ("_scales" if kind == "blocks" else "_blocks"), None)
                        if partner is None:
                            pending[canonical] = handle.get_tensor(name)
                            continue
                        tensor = handle.get_tensor(name)
                        blocks, scales = (tensor, partner) if kind == "blocks" else (partner, tensor)
                        yield from _split_mxfp4_experts(stem, blocks, scales, dtype, mxfp4_native, str(path))
                        continue
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
    if pending:
        raise ModelLoadError(f"MXFP4 tensors without their other half (blocks or scales): {', '.join(sorted(pending))}")
