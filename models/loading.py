"""`load_model`: a path (HF directory or .gguf file) or None (the embedded default) to a ready model;
with `load_format="dummy"`, a config.json (or a shipped shape's name) with random weights."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog
import torch

from cadenza.kernels.cpu.features import cpu_has_native_bf16
from cadenza.models.config import ModelArchConfig
from cadenza.models.default_model import default_model_path
from cadenza.models.dual_linear import use_dual_precision
from cadenza.models.errors import ModelLoadError
from cadenza.models.families import FAMILIES
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.quantized_linear import block_layouts
from cadenza.models.rotary import RotaryEmbedding
from cadenza.models.tokenizer import Tokenizer, load_hf_tokenizer
from cadenza.models.weight_arena import WeightArena

log = structlog.get_logger(__name__)

QUANTIZATION_MODES = ("auto", "none", "int8")
LOAD_FORMATS = ("auto", "dummy")
MOE_EXPERTS_ON = ("device", "cpu")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    source: str
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    compute_dtype: torch.dtype  # activations and KV cache: float32 when the weights are dual precision
    quantized_weights: int = 0  # linears on block-quantized weights, whose activations round to int8


def load_model(
    path: str | Path | None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    cpu_fp32_matmul: str = "auto",
    cpu_kernels: str = "off",
    quantization: str = "none",
    transform: Callable[[LlamaForCausalLM], object] | None = None,
    load_format: str = "auto",
    seed: int = 0,
    moe_experts_on: str = "device",
) -> LoadedModel:
    """`cpu_fp32_matmul`: "auto" keeps a float32 copy of bf16/fp16 linear weights for batched
    matmuls when the CPU has no native bf16 (see `models/dual_linear.py`); "on" always, "off" never.
    `cpu_kernels`: "auto", "on" or "off", whether a CPU model computing in float32 runs its hot ops
    through `cadenza.kernels.cpu.loader` (see there).
    `quantization`: "auto" keeps a GGUF's weights of the types cadenza has kernels for as raw
    blocks (`models/quantized_linear.py`) where those kernels run (a CPU, `cpu_kernels` not "off",
    and a 16-bit `dtype`: float32 asks for the exact de-quantized weights); "none" de-quantizes
    every weight to `dtype`; "int8" also quantizes a float checkpoint's linears to Q8_0 blocks on
    load (`models/int8_weights.py`), and runs a GGUF as "auto" does, whatever `dtype`.
    `transform`: called with the model once its weights are in, before dual-precision copies and
    kernels are set up (tensor parallelism cuts the model to a rank's shard there).
    `load_format`: "auto" reads `path`'s weights; "dummy" makes random ones, seeded by `seed`, of
    the shape `path` gives (a config.json, a directory holding one, or a shipped shape's name; see
    `models/dummy.py`), with a stand-in tokenizer.
    `moe_experts_on`: "device" keeps a mixture's experts with the rest; "cpu", on a GPU, keeps them
    in host memory and runs them on the CPU (a GGUF's quantized experts as their blocks on the CPU
    kernels, as `quantization` allows there), the attention and router on the GPU (llama.cpp's
    `--cpu-moe`): a model whose experts do not fit the GPU still runs its attention there."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {quantization!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {load_format!r}")
    if moe_experts_on not in MOE_EXPERTS_ON:
        raise ValueError(f"moe_experts_on must be one of {', '.join(MOE_EXPERTS_ON)}, not {moe_experts_on!r}")
    started = time.perf_counter()
    device = torch.device(device)
    host_experts = moe_experts_on == "cpu" and device.type != "cpu"
    kernels = None
    arena_bytes = 0  # a GGUF's blocks go straight into a weight arena of this size (0: none)
    if load_format == "dummy":
        kernels = _int8_kernels(quantization, device, dtype, cpu_kernels)
        arch, weights, tokenizer, native, source = _read_dummy(path, dtype, device, seed, int8=quantization == "int8")
    else:
        resolved = default_model_path() if path is None else Path(path).expanduser()
        if not resolved.exists():
            raise ModelLoadError(f"model path {str(resolved)!r} does not exist")
        source = str(resolved)
        if resolved.is_file() and resolved.suffix == ".gguf":
            why_not, kernels = _why_not_native(quantization, device, dtype, cpu_kernels)
            # Experts kept on the host run as the CPU runs them: their blocks where its kernels can.
            why_not_experts = _why_not_native(quantization, torch.device("cpu"), dtype, cpu_kernels)[0] if host_experts else why_not
            arch, weights, tokenizer, native, arena_bytes = _read_gguf(resolved, dtype, source, why_not, why_not_experts)
        elif resolved.is_dir():
            kernels = _int8_kernels(quantization, device, dtype, cpu_kernels)
            arch, weights, tokenizer, native = _read_hf(
                resolved, dtype, int8=quantization == "int8",
                why_not_native=lambda: _why_not_native(quantization, device, dtype, cpu_kernels)[0])
        else:
            raise ModelLoadError(f"{source}: expected a Hugging Face model directory or a .gguf file")
    limit = arch.max_position_embeddings if max_model_len is None else max_model_len
    if limit > arch.max_position_embeddings:
        raise ModelLoadError(
            f"{source}: max_model_len={limit} exceeds the model's context length {arch.max_position_embeddings}"
        )
    host_experts = host_experts and arch.moe is not None
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions=1)
        model.use_quantized_weights(native)
    model = _materialize(model.to(dtype=dtype), device, host_experts)
    if arch.tie_word_embeddings and isinstance(model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(arch.rope, arch.rotated_dims, limit).to(device)
    if arch.local_rope is not None:
        model.local_rotary = RotaryEmbedding(arch.local_rope, arch.rotated_dims, limit).to(device)
    # A shard (`transform`) cuts its blocks out of the whole model's: those go to an arena of their own later.
    arena = WeightArena(arena_bytes) if arena_bytes and transform is None else None
    model.load_weights(weights, source, arena)
    del weights, arena  # the file's map goes with the last view of it
    model.eval()
    if transform is not None:
        transform(model)
    if host_experts:
        from cadenza.kernels.cpu import loader as cpu

        host_kernels = cpu.configure(cpu_kernels) if cpu_kernels != "off" else None
        for module in _mixtures(model):
            module.keep_experts_on_host(host_kernels)
    elif device.type == "cuda" and arch.moe is not None:  # each mixture as two grouped GEMMs a step
        for module in _mixtures(model):
            module.use_grouped_gemm()
    dual = 0
    wants_dual = cpu_fp32_matmul == "on" or (cpu_fp32_matmul == "auto" and not cpu_has_native_bf16())
    # Quantized linears take float32 activations: the rest of the model then computes in float32 too
    # (not the experts kept on the host: the host path hands them float32 itself).
    if (native and not host_experts) or (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and wants_dual):
        dual = use_dual_precision(model)
        model.compute_dtype = torch.float32
    if device.type == "cpu" and (model.compute_dtype or dtype) == torch.float32:
        from cadenza.kernels.cpu import loader as cpu

        kernels = kernels or cpu.configure(cpu_kernels)
        model.use_cpu_kernels(kernels)
        for layout in block_layouts(model, kernels) if native else ():
            if layout.pop("packed"):
                log.info("Quantized weights packed a group of rows at a time for the CPU kernels", **layout)
            elif kernels is None or layout["reason"].startswith("rows not a multiple"):
                log.info("Quantized weights run in the file's layout", **layout)
            else:  # a type this build has no packed products for: its products run 2-4x slower
                log.warning("Quantized weights run in the file's layout, 2-4x slower a byte than packed ones", **layout)
    log.info(
        "Loaded model",
        source=source,
        model_type=arch.model_type,
        dtype=str(dtype).removeprefix("torch."),
        layers=arch.num_layers,
        fp32_matmul_copies=dual,
        quantized_weights=len(native),
        cpu_kernels=model.kernels is not None,
        seconds=round(time.perf_counter() - started, 2),
    )
    release_free_memory()
    return LoadedModel(model, arch, tokenizer, source, limit, dtype, device, model.compute_dtype or dtype, len(native))


def load_tokenizer(path: str | Path | None, max_model_len: int | None = None, load_format: str = "auto"
                   ) -> tuple[ModelArchConfig, Tokenizer, int]:
    """(architecture, tokenizer, context limit) of a model without loading its weights: what a
    server that only routes requests to engine replicas needs."""
    if load_format == "dummy":
        from cadenza.models.dummy import dummy_tokenizer, read_dummy_arch

        arch, _ = read_dummy_arch(path)
        return arch, dummy_tokenizer(arch), arch.max_position_embeddings if max_model_len is None else max_model_len
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"model path {str(resolved)!r} does not exist")
    if resolved.is_file() and resolved.suffix == ".gguf":
        arch, _, tokenizer, _, _ = _read_gguf(resolved, torch.float32, str(resolved), "only the tokenizer is needed")
    elif resolved.is_dir():
        arch, _, tokenizer, _ = _read_hf(resolved, torch.float32, int8=False)
    else:
        raise ModelLoadError(f"{resolved}: expected a Hugging Face model directory or a .gguf file")
    return arch, tokenizer, arch.max_position_embeddings if max_model_len is None else max_model_len


def _read_hf(directory: Path, dtype: torch.dtype, int8: bool, why_not_native: Callable[[], str | None] | None = None):
    """(arch, weights, tokenizer, names given as raw blocks). A gpt-oss checkpoint's MXFP4 experts
    stay MXFP4 blocks where `why_not_native()` (as for a GGUF's blocks) says nothing against it,
    else they are de-quantized to `dtype`."""
    from cadenza.models.hf_loader import (
        iter_safetensors,
        mxfp4_expert_names,
        read_hf_config,
        safetensors_files,
        safetensors_shapes,
    )
    from cadenza.models.int8_weights import iter_int8_weights, plan_int8_weights

    arch = read_hf_config(directory)
    family = FAMILIES[arch.model_type]
    files = safetensors_files(directory)
    tokenizer = load_hf_tokenizer(directory, arch.eos_token_ids)
    mxfp4 = mxfp4_expert_names(files, family)
    why = (why_not_native() if why_not_native is not None else "only the tokenizer is needed") if mxfp4 else None
    if why is not None:
        log.info("MXFP4 experts de-quantized", tensors=len(mxfp4), dtype=str(dtype).removeprefix("torch."), reason=why)
    mxfp4_native = bool(mxfp4) and why is None
    kept = mxfp4 if mxfp4_native else frozenset()
    weights = iter_safetensors(files, dtype, family, mxfp4_native)
    if not int8:
        return arch, weights, tokenizer, kept
    native = plan_int8_weights(safetensors_shapes(files, family))
    # Quantized from float32 (exact for any checkpoint dtype), not from a bf16 rounding of it.
    float32 = iter_safetensors(files, torch.float32, family, mxfp4_native)
    return arch, iter_int8_weights(float32 if native else weights, native), tokenizer, native | kept


def _read_dummy(path, dtype: torch.dtype, device: torch.device, seed: int, int8: bool):
    """(arch, weights, tokenizer, quantized names, source) of random weights in `path`'s shape:
    each tensor drawn on `device` in `dtype` (float32 on the host, to be quantized, for int8)."""
    from cadenza.models.dummy import dummy_tokenizer, hf_weight_shapes, iter_dummy_weights, read_dummy_arch
    from cadenza.models.int8_weights import iter_int8_weights, plan_int8_weights

    arch, source = read_dummy_arch(path)
    log.warning("Weights are random (model.load_format dummy): a benchmark of the shape; the text means nothing",
                config=source, seed=seed)
    tokenizer = dummy_tokenizer(arch)
    if not int8:
        return arch, iter_dummy_weights(arch, dtype, device, seed), tokenizer, frozenset(), source
    native = plan_int8_weights(hf_weight_shapes(arch))
    return arch, iter_int8_weights(iter_dummy_weights(arch, torch.float32, "cpu", seed), native), tokenizer, native, source


def _int8_kernels(quantization: str, device: torch.device, dtype: torch.dtype, cpu_kernels: str):
    """The CPU kernels a float checkpoint's `quantization: int8` runs on (None for other modes);
    raises where they cannot run."""
    if quantization != "int8":
        return None
    why_not, kernels = _why_not_native(quantization, device, dtype, cpu_kernels)
    if why_not is not None:
        raise ModelLoadError(f"model.quantization int8 cannot run here: {why_not}")
    return kernels


def _why_not_native(quantization: str, device: torch.device, dtype: torch.dtype, cpu_kernels: str):
    """(why a GGUF's quantized weights cannot run natively, or None; the CPU kernels where they can)."""
    if quantization == "none":
        return "model.quantization is none", None
    if device.type != "cpu":
        return f"the quantized kernels run on the CPU, not {device.type}", None
    if dtype == torch.float32 and quantization != "int8":
        return "model.dtype float32 asks for the exact de-quantized weights", None
    if cpu_kernels == "off":
        return "model.cpu_kernels is off", None
    from cadenza.kernels.cpu import loader as cpu

    kernels = cpu.configure(cpu_kernels)
    if kernels is None:
        return f"the CPU kernels are unavailable: {cpu.build_error()}", None
    return None, kernels


def _mixtures(model: LlamaForCausalLM) -> list:
    from cadenza.models.moe import SparseMoE

    return [module for module in model.modules() if isinstance(module, SparseMoE)]


def _materialize(model: LlamaForCausalLM, device: torch.device, host_experts: bool) -> LlamaForCausalLM:
    """The meta-device skeleton's tensors allocated (uninitialised: the checkpoint fills them) on
    `device`, a mixture's experts on the CPU where `host_experts`."""
    # Not `to_empty`: its empty_like of a meta tensor runs PyTorch's Python references, which
    # import sympy (34 MiB resident and 0.23 s, measured here).
    if not host_experts:
        return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    on_host = {id(m) for moe in _mixtures(model) for m in moe.experts.modules()}
    for module in model.modules():
        target = torch.device("cpu") if id(module) in on_host else device
        module._apply(lambda t, target=target: torch.empty(t.shape, dtype=t.dtype, device=target), recurse=False)
    return model


def _read_gguf(path: Path, dtype: torch.dtype, source: str, why_not: str | None, why_not_experts: str | None = None):
    from cadenza.models.gguf_loader import (
        iter_gguf_weights,
        native_nbytes,
        open_gguf,
        plan_native_weights,
        read_gguf_config,
    )
    from cadenza.models.gguf_tokenizer import tokenizer_from_gguf

    reader = open_gguf(path)
    arch = read_gguf_config(reader, source)
    built = tokenizer_from_gguf(reader)
    eos_ids = tuple(dict.fromkeys([*arch.eos_token_ids, *([built.eos_token_id] if built.eos_token_id is not None else [])]))
    vocab = built.tokenizer
    tokenizer = Tokenizer(
        backend=vocab,
        eos_token_ids=eos_ids,
        bos_token_id=built.bos_token_id,
        chat_template=built.chat_template,
        bos_token=vocab.id_to_token(built.bos_token_id) if built.bos_token_id is not None else None,
        eos_token=vocab.id_to_token(built.eos_token_id) if built.eos_token_id is not None else None,
    )
    native = plan_native_weights(reader, why_not)
    if why_not_experts != why_not:  # the experts on the host: planned as the CPU runs them
        native = frozenset(n for n in native if ".mlp.experts." not in n) | frozenset(
            n for n in plan_native_weights(reader, why_not_experts) if ".mlp.experts." in n)
    return arch, iter_gguf_weights(reader, arch, dtype, source, native), tokenizer, native, native_nbytes(reader, native)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim(0)`; nothing
    elsewhere). A load frees many blocks of a few hundred KiB to a few MiB (parsed metadata, the
    tokenizer's build, re-ordered rows), and glibc keeps free memory up to a trim threshold that
    rises with the largest block freed: 5 MiB after the default model's load, 45 MiB before its
    weights went straight into their arena."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        trim = None
    if trim is not None:
        trim(0)
