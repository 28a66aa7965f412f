"""The default sampler: argmax for greedy rows, an exponential race for the others."""

from __future__ import annotations

import torch

from cadenza.samplers.base import Sampler, SamplerOutput, SamplingBatch, SamplingContext


class DefaultSampler(Sampler):
    """Greedy rows take the argmax of the processed logits; sampled rows draw from their softmax.

    Sampling uses the exponential race: `argmax(probs / E)` with `E ~ Exponential(1)` per token
    picks token i with probability `probs[i] / sum(probs)`, so no normalization, cumsum or
    `multinomial` is needed and each row's draw is just V independent noise values. A seeded row
    draws its noise from its own `batch.generators[i]`, so its tokens depend on its seed alone, not
    on the other rows or its position; unseeded rows share one draw from `generator` (the torch
    default generator when None).
    """

    name = "default"
    folds_into_one_pass = True  # the exponential race draws from softmax(logits), as Gumbel-max does

    def __init__(self, context: SamplingContext, generator: torch.Generator | None = None) -> None:
        super().__init__(context)
        self.generator = generator

    def sample(
        self, logits: torch.Tensor, raw_logits: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        sampled_rows = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        if len(sampled_rows) == len(batch):
            token_ids = self._race(logits, batch.generators)
        else:
            token_ids = logits.argmax(dim=-1)
            if sampled_rows:
                index = torch.tensor(sampled_rows, device=logits.device)
                generators = [batch.generators[i] for i in sampled_rows]
                token_ids[index] = self._race(logits.index_select(0, index), generators)
        return self._with_logprobs(token_ids, raw_logits, batch)

    def _race(self, logits: torch.Tensor, generators) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            _exponential_(noise, self.generator)
        else:
            if unseeded:
                index = torch.tensor(unseeded, device=probs.device)
                shared = torch.empty((len(unseeded), probs.shape[-1]), device=probs.device)
                noise.index_copy_(0, index, _exponential_(shared, self.generator))
            for j, generator in enumerate(generators):
                if generator is not None:
                    _exponential_(noise[j], generator)
        # A zero draw would turn a masked token's 0/0 into NaN, which argmax would pick.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def _with_logprobs(
        self, token_ids: torch.Tensor, raw_logits: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        requested = [p.logprobs for p in batch.params if p.logprobs is not None]
        if not requested:
            return SamplerOutput(token_ids=token_ids)
        # Log-probabilities report the model's own distribution, before any processor.
        logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_values, top_ids = logprobs.topk(max(requested), dim=-1)  # sorted, most likely first
        return SamplerOutput(token_ids, logprobs=chosen, top_logprobs=(top_ids, top_values))


def _exponential_(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill with Exponential(1) draws as -log(U): the same distribution as `exponential_`, about
    5x cheaper on CPU (measured 7 ms against 35 ms for 32 rows of a 49k vocabulary)."""
    return noise.uniform_(generator=generator).log_().neg_()
