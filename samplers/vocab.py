"""The vocabulary as bytes, for plugins that work on generated text rather than token ids.

Decoding one token at a time is wrong for byte-level tokenizers: a token may hold half of a UTF-8
character, which decodes to U+FFFD. Each token's *bytes* are exact, and the output text's UTF-8
is the concatenation of its tokens' bytes, so text checks done on bytes hold across token
boundaries (UTF-8 is self-synchronizing: a byte substring match is a character substring match).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from cadenza.models.byte_level import CHAR_TO_BYTE

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_types(config: dict[str, Any] | None) -> set[str]:
    if not config:
        return set()
    if config.get("type") == "Sequence":
        return {t for d in config.get("decoders", []) for t in _decoder_types(d)}
    return {config.get("type", "")}


def _speller(backend) -> Callable[[str, int], bytes]:
    """How a token's vocabulary entry becomes the bytes it adds to the text."""
    decoder = backend.decoder
    types = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
    if "ByteLevel" in types:
        def byte_level(piece: str, token_id: int) -> bytes:
            if all(ch in CHAR_TO_BYTE for ch in piece):
                return bytes(CHAR_TO_BYTE[ch] for ch in piece)
            return piece.encode()

        return byte_level
    if types & {"Metaspace", "Replace", "ByteFallback"}:  # SentencePiece: "▁" is a space

        def sentencepiece(piece: str, token_id: int) -> bytes:
            match = _BYTE_TOKEN.match(piece)
            if match and "ByteFallback" in types:
                return bytes([int(match.group(1), 16)])
            return piece.replace("▁", " ").encode()

        return sentencepiece
    return lambda piece, token_id: backend.decode([token_id], skip_special_tokens=True).encode()


def token_bytes(tokenizer, size: int | None = None) -> list[bytes]:
    """The bytes each token id adds to decoded text, for ids `0 .. size - 1`.

    `tokenizer` is cadenza's `Tokenizer` (or a `tokenizers.Tokenizer`); `size` defaults to its
    vocabulary and may be larger (a model's padded vocabulary): ids it lacks, and special tokens
    (which `skip_special_tokens` drops from the text), add b"". Known limit: a SentencePiece
    decoder that strips the text's first space is not modelled, so the first token keeps it.
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    size = backend.get_vocab_size(with_added_tokens=True) if size is None else size
    bytes_of = token_bytes_lookup(backend)
    return [bytes_of(token_id) for token_id in range(size)]


def token_bytes_lookup(tokenizer, keep_special: bool = False) -> Callable[[int], bytes]:
    """token id -> the bytes it adds to decoded text (special tokens: b"", or their text when
    `keep_special`, as a decode with `skip_special_tokens=False` shows them)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    spell = _speller(backend)
    added = backend.get_added_tokens_decoder()

    def bytes_of(token_id: int) -> bytes:
        special = added.get(token_id)
        if special is not None:
            return special.content.encode() if keep_special or not special.special else b""
        piece = backend.id_to_token(token_id)
        return b"" if piece is None else spell(piece, token_id)

    return bytes_of
