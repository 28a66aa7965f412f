"""Build a `tokenizers.Tokenizer` from the tokenizer a GGUF file describes in its metadata.

A GGUF carries no tokenizer.json. llama.cpp stores the vocabulary, the merges (or SentencePiece
scores), each token's type and the special ids under `tokenizer.ggml.*`, and picks the rest of the
pipeline (how text is split before BPE) from the name in `tokenizer.ggml.pre`. We rebuild that
pipeline the way llama.cpp runs it, because that is how the model saw text, so the ids match.

    reader = GGUFFile(path)  # or gguf.GGUFReader(path)
    tok = tokenizer_from_gguf(reader)
    tok.tokenizer.encode("<|im_start|>user\\nhi<|im_end|>").ids

Supported `tokenizer.ggml.model`: "gpt2" (byte-level BPE) and "llama" (SentencePiece BPE with
byte fallback). Anything else raises `ValueError` naming the supported ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import structlog
from gguf import GGUFValueType, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from cadenza.models.byte_level import BYTE_TO_CHAR, CHAR_TO_BYTE
from cadenza.models.gguf_file import GGUFFile

logger = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """A ready tokenizer and the facts about it the engine needs.

    `tokenizer` adds BOS/EOS on `encode(..., add_special_tokens=True)` exactly when `add_bos_token` /
    `add_eos_token` say so. `special_token_ids` are the ids `decode(..., skip_special_tokens=True)`
    drops: control and unknown tokens, plus the bos/eos/pad/unk ids.
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    special_token_ids: frozenset[int]


def read_field(reader: GGUFFile | gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata field `key`, or `default` when the file has no such field.

    Numbers and bools come back as Python `int`/`float`/`bool`, strings as `str` (UTF-8), arrays
    as a `list` of those. Nested arrays raise `ValueError`.
    """
    if isinstance(reader, GGUFFile):  # values already decoded
        value = reader.fields.get(key, default)
        if isinstance(value, list) and any(isinstance(v, list) for v in value):
            raise ValueError(f"GGUF field {key!r} is a nested array, which is not supported")
        return value
    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    if kind != GGUFValueType.ARRAY:
        return field.parts[-1].tolist()[0]
    if len(field.types) == 1:  # the reader records no item type for an empty array
        return []
    item = field.types[-1]
    if item == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    if item == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF field {key!r} is a nested array, which is not supported")
    # Each number is its own one-element part; one concatenate beats a Python loop of tolist().
    return np.concatenate([field.parts[i] for i in field.data]).tolist()


def tokenizer_from_gguf(reader: GGUFFile | gguf.GGUFReader) -> GGUFTokenizer:
    """Build the tokenizer described by `reader`'s `tokenizer.ggml.*` metadata.

    Raises `ValueError` for a tokenizer model or pre-tokenizer type we cannot rebuild, or a file
    without a vocabulary.
    """
    model = read_field(reader, "tokenizer.ggml.model")
    if model not in _BUILDERS:
        raise ValueError(
            f"Cannot build a tokenizer for GGUF tokenizer.ggml.model={model!r}; supported: {sorted(_BUILDERS)}"
        )
    tokens: list[str] | None = read_field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    token_types = read_field(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)

    def token_id(key: str) -> int | None:
        value = read_field(reader, f"tokenizer.ggml.{key}")
        # Some converters write -1 (or its uint32 spelling) for "none".
        return value if value is not None and 0 <= value < len(tokens) else None

    ids = {name: token_id(f"{name}_token_id") for name in ("bos", "eos", "padding", "unknown")}
    tokenizer, add_bos_default = _BUILDERS[model](reader, tokens, ids["unknown"])
    add_bos = bool(read_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(read_field(reader, "tokenizer.ggml.add_eos_token", False))

    special_ids = _register_added_tokens(tokenizer, tokens, token_types, ids.values())
    _set_post_processor(tokenizer, tokens, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None)
    return GGUFTokenizer(
        tokenizer=tokenizer,
        chat_template=read_field(reader, "tokenizer.chat_template"),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
        unk_token_id=ids["unknown"],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        special_token_ids=special_ids,
    )


# ---------------------------------------------------------------------------------------------
# gpt2: byte-level BPE, split first by the regexes llama.cpp ties to `tokenizer.ggml.pre`.


@dataclass(frozen=True, slots=True)
class _PreType:
    """How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` name (llama-vocab.cpp).

    `splits` are applied in turn, each one splitting further the pieces the last produced and
    keeping unmatched text as pieces of its own (llama.cpp's `regex_exprs`; tokenizers' "isolated").
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is already a token is taken whole
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_types() -> dict[str, _PreType]:
    # Grouped the way llama-vocab.cpp groups them; names are the `tokenizer.ggml.pre` strings.
    groups: list[tuple[tuple[str, ...], _PreType]] = [
        # llama.cpp's fallback for files converted before `pre` existed.
        (("default",), _PreType((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))),
        (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), _PreType((_GPT2_SPLIT,))),
        # Each digit on its own, then GPT-2's regex: SmolLM's tokenizer.json is
        # Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], the same thing.
        (
            ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
            _PreType((r"\p{N}", _GPT2_SPLIT)),
        ),
        (
            ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
            _PreType((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
        ),
        (("dbrx", "smaug-bpe"), _PreType((_LLAMA3_SPLIT,))),
        (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), _PreType((_QWEN2_SPLIT,))),
        (("falcon",), _PreType((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"))),
        (("tekken",), _PreType((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)),
        (("gpt-4o", "llama4"), _PreType((_GPT4O_SPLIT,))),
    ]
    return {name: pre for names, pre in groups for name in names}


_PRE_TYPES = _pre_types()
SUPPORTED_PRE_TYPES = frozenset(_PRE_TYPES)


def _byte_level_bpe(reader: GGUFFile | gguf.GGUFReader, tokens: list[str], unk_id: int | None) -> tuple[Tokenizer, bool]:
    pre_name = read_field(reader, "tokenizer.ggml.pre")
    if pre_name is None:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        pre_name = "default"
    pre = _PRE_TYPES.get(pre_name)
    if pre is None:
        raise ValueError(
            f"Unsupported GGUF pre-tokenizer type tokenizer.ggml.pre={pre_name!r}; supported: {sorted(_PRE_TYPES)}"
        )
    merges = read_field(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF byte-level (gpt2) tokenizer has no tokenizer.ggml.merges")

    tokens = _spell_byte_level(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = BPE(
        vocab=vocab,
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        unk_token=tokens[unk_id] if unk_id is not None else None,
        ignore_merges=pre.ignore_merges,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre.add_bos


def _spell_byte_level(tokens: list[str]) -> list[str]:
    """Tokens as the byte-level alphabet spells them.

    llama.cpp writes them that way already; a few converters wrote some in plain text, which BPE
    would never produce, so respell those (as transformers' GGUF loader does).
    """
    alphabet = CHAR_TO_BYTE.keys()
    if set("".join(tokens)) <= alphabet:  # the usual case: one pass, no per-token work
        return tokens
    return [
        token if set(token) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in token.encode("utf-8")) for token in tokens
    ]


# ---------------------------------------------------------------------------------------------
# llama: SentencePiece BPE (Llama 2, Mistral v0.1), rebuilt as BPE with byte fallback.


def _sentencepiece_bpe(reader: GGUFFile | gguf.GGUFReader, tokens: list[str], unk_id: int | None) -> tuple[Tokenizer, bool]:
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = read_field(reader, "tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = read_field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("GGUF SentencePiece (llama) tokenizer has neither merges nor scores")
        pairs = _merges_from_scores(tokens, scores, vocab)
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp puts a space before every stretch of text that starts the input or follows a
    # special token, then writes spaces as "▁". Prepend+Replace as a normalizer does exactly that,
    # since the normalizer runs on each stretch between added tokens. (Metaspace's prepend skips
    # text that already starts with a space, and "first" skips text after a special token.)
    add_space_prefix = bool(read_field(reader, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tokenizer, True  # llama.cpp adds BOS for SentencePiece vocabularies unless told not to


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens.

    SentencePiece (and llama.cpp) merge first the pair whose joined token scores highest, so rank
    merges by that score; ties go to the longer left piece, then the longer right, then vocabulary
    order, as transformers' `generate_merges` does.
    """
    candidates = []
    for token, score in zip(tokens, scores):
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


# ---------------------------------------------------------------------------------------------
# Shared: added tokens and the post-processor.


def _register_added_tokens(
    tokenizer: Tokenizer, tokens: list[str], token_types: list[int], named_ids: Iterable[int | None]
) -> frozenset[int]:
    """Make control/unknown tokens special and user-defined tokens whole; return the special ids.

    llama.cpp matches both kinds whole in the text, so they must be added tokens or BPE would cut
    them up. A token is only added under the id it already has: one whose text is not its own
    vocabulary entry (a byte-level "control" token written in plain text, a converter's mislabel,
    or the first of two duplicates) would otherwise get a new id past the model's vocabulary.
    """
    special_types = {TokenType.CONTROL, TokenType.UNKNOWN}
    special = {i for i, kind in enumerate(token_types) if kind in special_types}
    special.update(i for i in named_ids if i is not None)
    special = {i for i in special if tokenizer.token_to_id(tokens[i]) == i}
    user_defined = [
        i
        for i, kind in enumerate(token_types)
        if kind == TokenType.USER_DEFINED and i not in special and tokenizer.token_to_id(tokens[i]) == i
    ]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])
    return frozenset(special)


def _set_post_processor(tokenizer: Tokenizer, tokens: list[str], bos_id: int | None, eos_id: int | None) -> None:
    """Add BOS/EOS around an encoding with `add_special_tokens=True`; none when neither is wanted."""
    if bos_id is None and eos_id is None:
        return
    bos = [tokens[bos_id]] if bos_id is not None else []
    eos = [tokens[eos_id]] if eos_id is not None else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=[(tokens[i], i) for i in {bos_id, eos_id} if i is not None],
    )
