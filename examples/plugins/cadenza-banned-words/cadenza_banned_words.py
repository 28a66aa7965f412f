"""cadenza-banned-words: keep banned words out of generated text, however the model spells them.

A word is often several tokens ("Paris" may be "Par" + "is"), and a token may carry the end of one
word and the start of the next. So the processor does not ban token ids: at each step it bans the
candidate tokens that would *complete* a banned word, given the text generated so far. A word `w`
is completed by token `t`, whose text is `s`, after the text `T` when an occurrence of `w` in
`T + s` ends inside `s`. Either

1. `w` lies inside `s`: a fixed set per word, found once when a request joins, by binary search
   in a suffix array of the vocabulary; or
2. `w` = `a + b`, `T` ends with `a` and `s` starts with `b`: the tokens starting with `b` are one
   contiguous range of the vocabulary sorted by bytes, found by binary search.

So each step costs, per row, one dictionary lookup on `T`'s last byte, a few `endswith` checks and
binary searches, and one indexed write into the logits for the whole batch: no loop over the
vocabulary and no per-row calls into the model. Matching is on UTF-8 bytes (`token_bytes`), which
is exact across token boundaries even when a token holds half a character.

Per request: `SamplingParams(extra={"banned_words": {"words": ["Paris"], "ignore_case": True}})`.
Per deployment (words banned for every request that switches it on):
`plugin_options: {banned_words: {words: [...]}}`.
"""

from __future__ import annotations

import bisect
from typing import Annotated, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from cadenza.plugins.hookspecs import hookimpl
from cadenza.samplers.base import LogitsProcessor, SamplingBatch, SamplingContext
from cadenza.samplers.vocab import token_bytes

__version__ = "0.1.0"

Word = Annotated[str, Field(min_length=1, max_length=64)]


class BannedWordsParams(BaseModel):
    """What a request sends as `extra["banned_words"]` (or `true` for the deployment's words)."""

    model_config = ConfigDict(extra="forbid")

    words: list[Word] = Field(default_factory=list, max_length=256, description="Substrings the output must not contain.")
    ignore_case: bool = Field(False, description="Match ASCII letters in either case.")


class BannedWordsOptions(BaseModel):
    """The deployment's `plugin_options.banned_words`."""

    model_config = ConfigDict(extra="forbid")

    words: list[Word] = Field(default_factory=list, description="Banned for every request that switches the processor on.")


def _after(prefix: bytes) -> bytes | None:
    """The smallest byte string above every string that starts with `prefix` (None: no bound)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


def _sorted(strings: list[bytes], ids: list[int]) -> tuple[list[bytes], torch.Tensor]:
    order = sorted(range(len(strings)), key=strings.__getitem__)
    return [strings[i] for i in order], torch.from_numpy(np.asarray(ids, dtype=np.int64)[np.asarray(order, dtype=np.int64)])


class VocabIndex:
    """The vocabulary's byte strings, sorted, for the tokens starting with some bytes; and their
    proper suffixes, sorted, for the tokens containing a word (a suffix array: a word is inside a
    token iff it starts the token or one of its suffixes). So a request's words cost binary
    searches, never a scan of the vocabulary. Building it takes about half a second for 50k tokens.
    """

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        self._starts, self._start_ids = _sorted(self.pieces, list(range(len(self.pieces))))
        suffixes, owners = [], []
        for token, piece in enumerate(self.pieces):
            for k in range(1, len(piece)):
                suffixes.append(piece[k:])
                owners.append(token)
        self._suffixes, self._suffix_ids = _sorted(suffixes, owners)

    @staticmethod
    def _range(sorted_bytes: list[bytes], prefix: bytes) -> tuple[int, int]:
        lo = bisect.bisect_left(sorted_bytes, prefix)
        upper = _after(prefix)
        return lo, len(sorted_bytes) if upper is None else bisect.bisect_left(sorted_bytes, upper, lo)

    def starting_with(self, prefix: bytes) -> torch.Tensor:
        lo, hi = self._range(self._starts, prefix)
        return self._start_ids[lo:hi]

    def containing(self, word: bytes) -> torch.Tensor:
        lo, hi = self._range(self._suffixes, word)
        return torch.unique(torch.cat([self.starting_with(word), self._suffix_ids[lo:hi]]))

    def tail(self, token_ids: Sequence[int], n: int) -> bytes:
        """The last `n` bytes of the text `token_ids` spell (all of it when shorter)."""
        parts, size = [], 0
        for token in reversed(token_ids):
            if size >= n:
                break
            piece = self.pieces[token] if 0 <= token < len(self.pieces) else b""
            parts.append(piece)
            size += len(piece)
        return b"".join(reversed(parts))[-n:] if n else b""


class BannedWords:
    """One request's words, compiled against a vocabulary index."""

    def __init__(self, words: Sequence[str], index: VocabIndex, ignore_case: bool) -> None:
        encoded = {w.encode().lower() if ignore_case else w.encode() for w in words}
        self.index = index
        self.keep = max(len(w) for w in encoded) - 1  # tail bytes that can start a word
        self.inside = torch.unique(torch.cat([index.containing(w) for w in encoded]))
        # Last byte of `a` -> the (a, b) splits of every word ending its `a` with that byte, so a
        # step only checks the splits the text's last byte could complete.
        self.splits: dict[int, list[tuple[bytes, bytes]]] = {}
        for w in encoded:
            for k in range(1, len(w)):
                self.splits.setdefault(w[k - 1], []).append((w[:k], w[k:]))

    def banned_next(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """Ids of the tokens that would complete a banned word after `output_token_ids`."""
        tail = self.index.tail(output_token_ids, self.keep)
        parts = [self.inside]
        if tail:
            for a, b in self.splits.get(tail[-1], ()):
                if tail.endswith(a):
                    parts.append(self.index.starting_with(b))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class BannedWordsProcessor(LogitsProcessor):
    """Masks, per row, every token that would complete one of the request's banned words."""

    name = "banned_words"
    params_model = BannedWordsParams
    options_model = BannedWordsOptions

    def __init__(self, context: SamplingContext, options: BannedWordsOptions | None = None) -> None:
        super().__init__(context, options)
        if context.tokenizer is None:
            raise ValueError("banned_words needs the model's tokenizer in its SamplingContext")
        # Both indexes are built here, once (about a second for 50k tokens), so no request's
        # step ever waits for one.
        pieces = token_bytes(context.tokenizer, context.vocab_size)
        self._indexes = {False: VocabIndex(pieces), True: VocabIndex([p.lower() for p in pieces])}

    def _index(self, ignore_case: bool) -> VocabIndex:
        return self._indexes[ignore_case]

    def on_request_added(self, request_id: str, params: BannedWordsParams) -> None:
        words = [*self.options.words, *params.words]
        if words:  # nothing to ban: the request stays out of this processor's rows
            self.request_params[request_id] = BannedWords(words, self._index(params.ignore_case), params.ignore_case)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows, cols = [], []
        for row, words in enumerate(self.params_for(batch)):
            if words is not None:
                ids = words.banned_next(batch.output_token_ids[row])
                rows.append(torch.full_like(ids, row))
                cols.append(ids)
        if cols:
            row_index, col_index = torch.cat(rows), torch.cat(cols)
            fits = col_index < logits.shape[-1]
            logits[row_index[fits].to(logits.device), col_index[fits].to(logits.device)] = float("-inf")
        return logits


@hookimpl
def register_samplers(register) -> None:
    register(BannedWordsProcessor.name, BannedWordsProcessor)
