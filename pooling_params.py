"""How an embedding request turns the prompt's hidden states into one vector.

Plain data (no torch): the scheduler and the messages carry it inside `SamplingParams.pooling`,
which marks a request as an embedding request: prefill only, no token sampled, its blocks freed
once its last prompt chunk has run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Pooling = Literal["last", "mean"]


class PoolingParams(BaseModel):
    """One embedding request's pooling of the decoder's last hidden states (after the final norm).

    `last`: the last prompt token's state; `mean`: the mean over every prompt token's state (the
    prompt is then computed whole, never taken from the prefix cache, as every row is needed).
    `dimensions` keeps the first that many values (then renormalized when `normalize`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling: Pooling = Field("last", description="last: the last prompt token's hidden state; mean: the mean over the prompt.")
    normalize: bool = Field(True, description="Scale the vector to unit L2 norm (after any truncation).")
    dimensions: int | None = Field(None, ge=1, description="Keep the first this many values; null: all (the hidden size).")
