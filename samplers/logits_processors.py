"""Built-in logits processors: bans, biases, temperature and the truncation filters.

Each runs once over the batch's float32 logits [B, V]. Python loops only walk rows, to build small
parameter tensors; the vocabulary is touched by masked, scatter and sort ops alone. Token ids a
request names beyond the logits' width are skipped rather than raised on: one bad request must
never fail the whole batch's step (ingress is where ids get validated against the tokenizer).
"""

from __future__ import annotations

import torch

from cadenza.kernels.rows import row_column
from cadenza.kernels.top_k_top_p import NEG_INF as _NEG_INF
from cadenza.kernels.top_k_top_p import mask_top_k_top_p
from cadenza.samplers.base import LogitsProcessor, SamplingBatch


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(cols, dtype=torch.long, device=device),
    )


class MinTokensProcessor(LogitsProcessor):
    """Bans EOS and the row's stop token ids until the row has `min_tokens` output tokens.

    EOS is banned even under `ignore_eos`: a row that must not stop early must not emit it either.
    """

    name = "min_tokens"

    def _is_short(self, params, output) -> bool:
        return params.min_tokens > 0 and len(output) < params.min_tokens

    def is_active(self, batch: SamplingBatch) -> bool:
        return any(self._is_short(p, out) for p, out in zip(batch.params, batch.output_token_ids))

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows: list[int] = []
        cols: list[int] = []
        for i, (params, output) in enumerate(zip(batch.params, batch.output_token_ids)):
            if self._is_short(params, output):
                banned = {*self.context.eos_token_ids, *params.stop_token_ids}
                ids = [t for t in banned if t < vocab]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits[_index(rows, cols, logits.device)] = _NEG_INF
        return logits


class LogitBiasProcessor(LogitsProcessor):
    """Adds `logit_bias[token]` to that token's logit (OpenAI semantics: before any sampling)."""

    name = "logit_bias"

    def is_active(self, batch: SamplingBatch) -> bool:
        return any(p.logit_bias for p in batch.params)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows: list[int] = []
        cols: list[int] = []
        biases: list[float] = []
        for i, params in enumerate(batch.params):
            for token, bias in (params.logit_bias or {}).items():
                if 0 <= token < vocab:
                    rows.append(i)
                    cols.append(token)
                    biases.append(bias)
        if rows:
            values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
            logits.index_put_(_index(rows, cols, logits.device), values, accumulate=True)
        return logits


class TemperatureProcessor(LogitsProcessor):
    """Divides each sampled row by its temperature; greedy rows (temperature ~ 0) are left as is."""

    name = "temperature"
    argmax_invariant = True
    folds_into_one_pass = True  # the one-pass sampler divides by each row's temperature itself

    def is_active(self, batch: SamplingBatch) -> bool:
        return any(not p.is_greedy and p.temperature != 1.0 for p in batch.params)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        temps = [1.0 if p.is_greedy else p.temperature for p in batch.params]
        # A temperature past the dtype's largest value would become inf, and -inf / inf (a masked
        # logit) NaN: at the largest finite value every logit is ~0, as the temperature asks.
        return logits.div_(row_column(temps, logits).clamp_(max=torch.finfo(logits.dtype).max))


class MinPProcessor(LogitsProcessor):
    """Masks tokens whose probability is below `min_p` times the row's largest probability.

    The threshold is a ratio of probabilities, so it reads the same before or after truncation by
    another filter; the most likely token always survives.
    """

    name = "min_p"
    argmax_invariant = True

    def is_active(self, batch: SamplingBatch) -> bool:
        # Greedy rows take the argmax whatever the filter does, so they never need it.
        return any(not p.is_greedy and p.min_p > 0.0 for p in batch.params)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        min_p = row_column([0.0 if p.is_greedy else p.min_p for p in batch.params], logits)
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill_(probs < threshold, _NEG_INF)


class TopKTopPProcessor(LogitsProcessor):
    """Keeps each row's `top_k` most likely tokens, then the nucleus of what is left.

    The nucleus is the smallest set of most likely tokens whose probability (renormalized after
    top-k) reaches `top_p`; the top token is always kept. Ties at the k-th logit all survive, as in
    HF's `TopKLogitsWarper`. Top-k alone uses `topk`; a full sort happens only when a row sets
    top-p. CUDA logits go to cupy's fused kernel instead (kernels/cuda/top_k_top_p.py), which sorts
    nothing, where it is available.
    """

    name = "top_k_top_p"
    argmax_invariant = True

    def _row_params(self, batch: SamplingBatch, vocab: int) -> tuple[list[int], list[float]]:
        ks, ps = [], []
        for p in batch.params:
            off = p.is_greedy  # greedy rows ignore truncation: keep them untouched
            ks.append(vocab if off or p.top_k <= 0 else min(p.top_k, vocab))
            ps.append(1.0 if off else p.top_p)
        return ks, ps

    def is_active(self, batch: SamplingBatch) -> bool:
        return any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in batch.params)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        ks, ps = self._row_params(batch, logits.shape[-1])
        if logits.is_cuda:
            # One fused cupy kernel, no sort; it calls `filter` where cupy's kernels are unavailable.
            from cadenza.kernels.cuda.top_k_top_p import top_k_top_p

            return top_k_top_p(logits, ks, ps)
        return self.filter(logits, ks, ps)

    @staticmethod
    def filter(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
        """The torch implementation (`kernels/top_k_top_p.py`): row i of `logits` keeps its
        `ks[i]` largest (V: off), then the nucleus reaching `ps[i]` (1: off); the rest become
        -inf, in place."""
        return mask_top_k_top_p(logits, ks, ps)
