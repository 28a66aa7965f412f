"""`model.load_format: dummy`: a real model's shape from its config.json, with random weights and a
stand-in tokenizer, for benchmarks with nothing to download (vLLM's `--load-format dummy`).

Weights are uniform in [-1e-3, 1e-3] (vLLM's range), norm weights 1, so activations stay small and
finite through any depth. Each tensor is drawn on the target device, in the target dtype, by its
own generator seeded from `model.seed` and the tensor's Hugging Face name: the same (seed, name,
dtype, device) always gives the same tensor, in any order, so a transformers model of the same
config can be filled with the very weights cadenza runs (`fill_module`).

The tokenizer has the config's vocabulary: ids 0-255 are the 256 bytes (text encodes to byte ids),
every other id renders as a short text of its own (" t1234"), and the config's EOS/BOS ids are
special tokens. Token-id prompts are the intended input; text and chat prompts work, byte by byte.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import torch

from cadenza.models.config import ModelArchConfig
from cadenza.models.errors import ModelLoadError

SHAPES_PACKAGE = "cadenza.config.shapes"
LOW, HIGH = -1e-3, 1e-3
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def shipped_shapes() -> list[str]:
    """The shape names `model.path` may give with load_format dummy (config/shapes/*.json)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(SHAPES_PACKAGE).iterdir() if p.name.endswith(".json"))


def read_dummy_config(path: str | Path | None) -> tuple[dict[str, Any], str]:
    """(the raw config.json, where it was read) for `path`: a config.json file, a directory
    holding one, or a shipped shape name such as "llama-3.2-1b"."""
    names = ", ".join(shipped_shapes())
    if path is None:
        raise ModelLoadError(f"model.load_format dummy needs model.path: a config.json, a directory holding one, "
                             f"or a shipped shape ({names})")
    given = Path(path).expanduser()
    if given.is_dir():
        given = given / "config.json"
    if given.is_file():
        text, source = given.read_text(encoding="utf-8"), str(given)
    else:
        shape = resources.files(SHAPES_PACKAGE) / f"{str(path).removesuffix('.json')}.json"
        if "/" in str(path) or not shape.is_file():
            raise ModelLoadError(f"model.path {str(path)!r} is not a config.json file, a directory holding one, "
                                 f"or a shipped shape; shipped shapes: {names}")
        text, source = shape.read_text(encoding="utf-8"), str(shape)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{source}: invalid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: expected a JSON object (a Hugging Face config.json)")
    return raw, source


def read_dummy_arch(path: str | Path | None) -> tuple[ModelArchConfig, str]:
    raw, source = read_dummy_config(path)
    try:
        return ModelArchConfig.from_hf(raw, source=source), source
    except KeyError as exc:
        raise ModelLoadError(f"{source}: missing required key {exc.args[0]!r}") from exc


def hf_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `arch` holds, by name, in checkpoint order (a tied
    LM head is not a tensor of its own)."""
    h, inter, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
    # Canonical names (models/families.py): a mixture's experts as `mlp.experts.N.gate_proj`.
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (rows, h)
            if arch.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if arch.qk_norm:
            full = arch.qk_norm == "full"
            shapes[p + "self_attn.q_norm.weight"] = (q if full else arch.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv if full else arch.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if arch.moe is not None and i in arch.moe.layers:
            shapes[p + "mlp.gate.weight"] = (arch.moe.num_experts, h)
            mlps = [(f"{p}mlp.experts.{e}.", arch.moe.intermediate_size) for e in range(arch.moe.num_experts)]
        else:
            mlps = [(f"{p}mlp.", inter)]
        for prefix, width in mlps:
            for name, shape in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
                shapes[f"{prefix}{name}.weight"] = shape
                if arch.mlp_bias:
                    shapes[f"{prefix}{name}.bias"] = shape[:1]
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def num_parameters(arch: ModelArchConfig) -> int:
    """The model's parameter count, from its shape alone (nothing allocated)."""
    return sum(_numel(shape) for shape in hf_weight_shapes(arch).values())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, seed: int) -> torch.Tensor:
    """The dummy value of checkpoint tensor `name`: ones for a norm weight, else uniform in
    [LOW, HIGH] from a generator of its own on `device` (drawn there, in `dtype`)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).uniform_(LOW, HIGH, generator=generator)


def iter_dummy_weights(arch: ModelArchConfig, dtype: torch.dtype, device: str | torch.device, seed: int
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every checkpoint tensor of `arch`, one at a time, as a loader streams them."""
    for name, shape in hf_weight_shapes(arch).items():
        yield name, dummy_tensor(name, shape, dtype, device, seed)


@torch.no_grad()
def fill_module(module: torch.nn.Module, arch: ModelArchConfig, seed: int) -> None:
    """Copy the dummy weights into a module whose parameters carry Hugging Face names (a
    transformers model of the same config), each drawn in that parameter's dtype and on its device;
    every parameter must be filled."""
    params = dict(module.named_parameters())
    for name, shape in hf_weight_shapes(arch).items():
        param = params.pop(name, None)
        if param is None or tuple(param.shape) != shape:
            found = None if param is None else tuple(param.shape)
            raise ValueError(f"{type(module).__name__}: parameter {name} is {found}, the dummy weights have {shape}")
        param.copy_(dummy_tensor(name, shape, param.dtype, param.device, seed))
    if params:
        raise ValueError(f"{type(module).__name__}: parameters the dummy weights do not fill: {', '.join(sorted(params)[:8])}")


def dummy_tokenizer(arch: ModelArchConfig):
    """cadenza's `Tokenizer` over a stand-in vocabulary of `arch.vocab_size` ids (see the module doc)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from cadenza.models.byte_level import BYTE_TO_CHAR
    from cadenza.models.tokenizer import Tokenizer

    size = arch.vocab_size
    eos_ids = tuple(i for i in arch.eos_token_ids if 0 <= i < size)
    special = {i: f"<|eos_{i}|>" if len(eos_ids) > 1 else "<|eos|>" for i in eos_ids}
    if arch.bos_token_id is not None and 0 <= arch.bos_token_id < size and arch.bos_token_id not in special:
        special[arch.bos_token_id] = "<|bos|>"
    # A byte-level BPE with no merges: text encodes to one id per byte; "Ġ" is the space.
    vocab = {special.get(i) or (BYTE_TO_CHAR[i] if i < 256 else f"Ġt{i}"): i for i in range(size)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special.values()])
    return Tokenizer(
        backend=backend,
        eos_token_ids=eos_ids,
        chat_template=CHAT_TEMPLATE,
        eos_token=special[eos_ids[0]] if eos_ids else None,
    )
