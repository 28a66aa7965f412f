"""The acceptance rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

A guess x drawn from a proposal q is kept with probability min(1, p(x) / q(x)), p the target's
distribution at that position; on rejection the token is drawn from norm(max(0, p - q)). The kept
or redrawn token is then distributed exactly as p. cadenza's proposers are deterministic: q is a
point mass on x, so x is kept with probability p(x) and the redraw is p without x, renormalised.
That is the same as sampling the target and keeping x only when the sample equals it, which is how
the runner verifies (`ModelRunner._verify`): through the configured sampler, so a sampler plugin's
own distribution is what is preserved. `rejection_sample` is the general rule, for proposers that
draw from a distribution of their own.
"""

from __future__ import annotations

import torch


def residual(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension; p itself where p <= q everywhere (then a
    rejection cannot happen, but the result stays a distribution)."""
    left = (target - proposal).clamp_min_(0)
    total = left.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, left / total.clamp_min(torch.finfo(left.dtype).tiny), target)


def acceptance_probability(target: torch.Tensor, proposal: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) per row, for guesses x [B] under p, q [B, V]."""
    p = target.gather(-1, guess.unsqueeze(-1)).squeeze(-1)
    q = proposal.gather(-1, guess.unsqueeze(-1)).squeeze(-1)
    return torch.where(q > 0, (p / q.clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1), torch.zeros_like(p))


def rejection_sample(
    target: torch.Tensor, proposal: torch.Tensor | None, guess: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [B] bool, token [B]): the guess where accepted, else a draw from the residual.

    `proposal` None means the point mass on `guess` (a deterministic proposer).
    """
    if proposal is None:
        proposal = torch.zeros_like(target).scatter_(-1, guess.unsqueeze(-1), 1.0)
    chance = acceptance_probability(target, proposal, guess)
    accepted = torch.rand(chance.shape, generator=generator, dtype=chance.dtype) < chance
    redraw = torch.multinomial(residual(target, proposal), 1, generator=generator).squeeze(-1)
    return accepted, torch.where(accepted, guess, redraw)


def output_distribution(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """The exact distribution of `rejection_sample`'s token when the guess is drawn from q:
    sum_x q(x) [a(x) 1_x + (1 - a(x)) r], which equals p (the point of the rule; for tests)."""
    vocab = target.shape[-1]
    guesses = torch.arange(vocab).expand(*target.shape[:-1], vocab)
    keep = torch.stack([acceptance_probability(target, proposal, guesses[..., x]) for x in range(vocab)], dim=-1)
    rejected = (proposal * (1 - keep)).sum(dim=-1, keepdim=True)
    return proposal * keep + rejected * residual(target, proposal)
