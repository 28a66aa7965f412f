"""GPT-2's byte-level alphabet: the printable character that stands for each byte in the
vocabulary of a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM).

Printable Latin-1 bytes stand for themselves; the other 68 bytes take U+0100 onwards, in byte
order. Plain data, no torch and no `tokenizers`: the GGUF tokenizer spells tokens with it and the
samplers' vocabulary-as-bytes reads them back.
"""

from __future__ import annotations

_PRINTABLE = (*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1))


def _byte_to_char() -> dict[int, str]:
    table = {b: chr(b) for b in _PRINTABLE}
    for extra, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + extra)
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()  # byte -> its stand-in; do not mutate
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}  # stand-in -> byte
