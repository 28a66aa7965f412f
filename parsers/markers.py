"""What every parser needs of the tags it looks for: holding back a tag arriving in pieces, and,
for a format written in special tokens, the text and the ends it asks of the engine."""

from __future__ import annotations

from typing import Callable, ClassVar, Sequence

from cadenza.sampling_params import SamplingParams


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker`: what a stream holds
    back, as it may be the tag arriving in pieces."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class FormatTokens:
    """What a format written in special tokens asks of the output it is given; both kinds of
    parser carry it (`ReasoningParser`, `ToolParser`), and `format_params` applies it."""

    # The format's markers are special tokens (harmony's <|channel|>, <|message|>, ...), which a
    # detokenizer that skips special tokens would hide: the output is decoded with them kept, and
    # the parser leaves them out of what it returns.
    keeps_special_tokens: ClassVar[bool] = False
    # Special tokens that end the model's turn in this format: the output stops on each one the
    # vocabulary has, whatever the model's config lists as its end (a GGUF names a single EOS).
    end_tokens: ClassVar[tuple[str, ...]] = ()


def format_params(
    params: SamplingParams, formats: Sequence[FormatTokens], token_id: Callable[[str], int | None]
) -> SamplingParams:
    """`params` for an output that `formats` (the request's parsers) will read: special tokens
    kept where one keeps them, and each end token `token_id` finds a stop token. Unchanged where
    they ask nothing."""
    update: dict = {}
    if any(f.keeps_special_tokens for f in formats):
        update["skip_special_tokens"] = False
    ends = [i for f in formats for t in f.end_tokens if (i := token_id(t)) is not None]
    if [i for i in ends if i not in params.stop_token_ids]:
        update["stop_token_ids"] = list(dict.fromkeys([*params.stop_token_ids, *ends]))
    return params.model_copy(update=update) if update else params
