"""Repetition, presence and frequency penalties, in one batched pass.

Repetition follows HF/vLLM: over every token seen in the prompt or the output, a positive logit is
divided by the penalty and a negative one multiplied, so a penalty above 1 always makes the token
less likely. Presence and frequency follow OpenAI and look at output tokens only:
`logit -= frequency * count + presence * (count > 0)`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cadenza.kernels.rows import row_column
from cadenza.samplers.base import LogitsProcessor, SamplingBatch


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: float32 [len(seqs), vocab].

    Sequences are padded with an extra column `vocab` that is dropped afterwards, so one
    `scatter_add_` counts them all; ids beyond the vocabulary land in that column too.
    """
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, seq in enumerate(seqs):
        if len(seq):
            ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    ids = ids.clamp_(0, vocab).to(device)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


class PenaltiesProcessor(LogitsProcessor):
    """Applies each row's repetition, presence and frequency penalties; rows without any are
    neither counted nor touched."""

    name = "penalties"

    def is_active(self, batch: SamplingBatch) -> bool:
        return any(p.uses_penalties for p in batch.params)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = [i for i, p in enumerate(batch.params) if p.uses_penalties]
        params = [batch.params[i] for i in rows]
        whole = len(rows) == len(batch)
        row_index = None if whole else torch.tensor(rows, device=logits.device)
        sub = logits if whole else logits.index_select(0, row_index)
        vocab = logits.shape[-1]

        counts = token_counts([batch.output_token_ids[i] for i in rows], vocab, logits.device)
        output_seen = counts > 0

        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            prompts = [batch.prompt_token_ids[i] for i in rows]
            seen = output_seen | (token_counts(prompts, vocab, logits.device) > 0)
            # Within the dtype's finite positive range: a penalty that rounds to 0 or inf would
            # turn a masked logit (-inf * 0) or a zero one (0 * inf) into NaN; and a division
            # that overflows stops at the largest finite logit (two +inf would make NaN too).
            finfo = torch.finfo(sub.dtype)
            penalty = row_column(repetition, sub).clamp_(finfo.tiny, finfo.max)
            penalized = torch.where(sub > 0, (sub / penalty).clamp_(max=finfo.max), sub * penalty)
            sub = torch.where(seen, penalized, sub)

        frequency = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        if any(frequency) or any(presence):
            penalty = row_column(frequency, sub) * counts + row_column(presence, sub) * output_seen
            sub = sub - penalty

        if whole:
            return sub
        return logits.index_copy_(0, row_index, sub)
