"""Contracts for logits processors and samplers.

A step's sampling runs once over the whole batch: the runner builds a `SamplingBatch` (one row per
request that needs a token this step), the configured logits processors transform the batch's
logits in order, and the sampler picks one token per row. Nothing here loops over the vocabulary in
Python; a processor may loop over rows only to build its parameter tensors.

Plugins take two kinds of parameters, both pydantic models so bad values fail with the field named:
per-request params (`params_model`, from `SamplingParams.extra[name]`, validated at ingress) and
deployment options (`options_model`, from the config's `plugin_options[name]`, validated at start-up).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from pydantic import BaseModel

from cadenza.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingContext:
    """What a processor or sampler factory is told once, at engine start-up.

    `tokenizer` is the model's `cadenza.models.tokenizer.Tokenizer` (None in bare unit tests), for
    plugins that work on text; `cadenza.samplers.vocab.token_bytes` turns it into per-token bytes.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    tokenizer: Any = None


@dataclass(slots=True)
class SamplingBatch:
    """The rows that sample this step, in the row order of the logits tensor.

    `prompt_token_ids[i]` and `output_token_ids[i]` are row i's prompt and the tokens its request
    has generated so far: the runner's own record, kept per request and appended to as tokens are
    sampled (no copy is made per step), so read them during the call and keep no reference.
    `generators[i]` is the request's own generator when it set a seed (so the same seed gives the
    same tokens whatever else is in the batch), else None. `request_ids[i]` names row i's request
    (stable across steps, so plugins can keep per-request state); left out, rows are named
    "row0", "row1", ... (handy in unit tests).
    """

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]
    generators: Sequence[torch.Generator | None]
    request_ids: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not self.request_ids and self.params:
            self.request_ids = [f"row{i}" for i in range(len(self.params))]

    def __len__(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return all(p.is_greedy for p in self.params)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One chosen token per row, and log-probabilities where a request asked for them.

    `logprobs[i]` is the chosen token's log-probability under the model's raw distribution;
    `top_logprobs` holds (token ids [B, K], log-probabilities [B, K]) with K the largest `logprobs`
    any row asked for. Both are None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class SamplingComponent:
    """What logits processors and samplers share: a name, parameters, and join/leave hooks.

    A request switches a component on with `SamplingParams.extra[name]` (a dict of params, or True
    for the defaults; absent, None or False is off). The pipeline validates that value against
    `params_model` once, when the request first appears in a batch, and hands the model to
    `on_request_added`; `on_request_finished` follows when the request leaves the engine (finished,
    aborted or failed; not when it is merely preempted). The default hooks keep the models in
    `self.request_params`, by request id, which the default `is_active` / `rows_using` read.
    """

    name: ClassVar[str]
    params_model: ClassVar[type[BaseModel] | None] = None
    options_model: ClassVar[type[BaseModel] | None] = None
    # A `SamplingParams` field that switches this component on, as `extra[name]` does for plugins:
    # a request whose field is not None joins with the field's value (validated by SamplingParams).
    request_field: ClassVar[str | None] = None

    def __init__(self, context: SamplingContext, options: BaseModel | None = None) -> None:
        self.context = context
        if options is None and self.options_model is not None:
            options = self.options_model()
        self.options = options
        self.request_params: dict[str, Any] = {}

    def prepare_request(self, params: Any) -> None:
        """Slow per-request set-up (compiling a grammar), done at the ingress in a worker thread
        before the request is admitted, with the params `on_request_added` will get. It may run
        while `apply` runs in another thread: touch only thread-safe state. Raising `ValueError`
        refuses the request (`invalid_value`, the message naming the problem)."""

    def on_request_added(self, request_id: str, params: Any) -> None:
        """A request that switched this component on joins: `params` is its validated model
        (or the raw `extra` value when there is no `params_model`). Raising fails that request."""
        self.request_params[request_id] = params

    def on_request_finished(self, request_id: str) -> None:
        """A request this component was told about has left the engine: drop its state. Errors
        are logged, never raised to anyone."""
        self.request_params.pop(request_id, None)

    def params_for(self, batch: SamplingBatch) -> list[Any]:
        """Each row's validated params, None for rows whose request did not switch this on."""
        params = self.request_params
        return [params.get(r) for r in batch.request_ids]


class LogitsProcessor(SamplingComponent, ABC):
    """Transforms a batch's logits before a token is picked.

    Subclasses set `name`, and `argmax_invariant = True` when they never change which token has
    the largest logit (greedy rows may then skip them). A processor with a `params_model` is
    opt-in: by default it is active only for rows whose request switched it on.
    """

    argmax_invariant: ClassVar[bool] = False
    # True only where the processor's whole effect is the one-pass sampler's own (the temperature):
    # the pipeline may then skip it and sample in one pass (SamplingPipeline.use_one_pass).
    folds_into_one_pass: ClassVar[bool] = False

    def is_active(self, batch: SamplingBatch) -> bool:
        """Whether any row needs this processor; inactive processors cost nothing. An inactive
        processor must stay inactive while the rows' outputs grow: speculative verification asks
        once for all of a step's guessed positions (`SamplingPipeline.is_argmax`)."""
        if self.params_model is None:
            return True
        params = self.request_params
        return bool(params) and any(r in params for r in batch.request_ids)

    def rows_using(self, batch: SamplingBatch) -> list[int]:
        """The rows whose requests use this processor: the ones that fail if it raises."""
        if self.params_model is None:
            return list(range(len(batch)))
        params = self.request_params
        return [i for i, r in enumerate(batch.request_ids) if r in params]

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return the transformed float32 logits [B, V] (in place is allowed)."""


class SamplingError(RuntimeError):
    """A processor or sampler failed; `rows` are the batch rows whose requests it takes down.

    `messages` may give a row its own message (several plugins failing their own rows at once).
    """

    def __init__(
        self, component: str, rows: list[int], cause: BaseException | str, messages: dict[int, str] | None = None
    ) -> None:
        self.component, self.rows, self.cause = component, rows, cause
        self.messages = messages or {}
        super().__init__(f"{component} failed: {cause!r}" if isinstance(cause, BaseException) else f"{component}: {cause}")

    def message_for(self, row: int) -> str:
        return self.messages.get(row, str(self))


class Sampler(SamplingComponent, ABC):
    """Picks one token per row from processed logits. It runs for every row; a sampler with a
    `params_model` reads `params_for(batch)` and treats rows without params its default way."""

    # True only where the sampler draws exactly from softmax(logits) (argmax where greedy), as the
    # one-pass sampler does: the pipeline may then sample in one pass instead of calling it.
    folds_into_one_pass: ClassVar[bool] = False

    @abstractmethod
    def sample(
        self, logits: torch.Tensor, raw_logits: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        """`logits` went through the processors (float32); `raw_logits` did not (for logprobs; in
        the LM head's dtype, bfloat16 on a bfloat16 model: up-cast before a log_softmax)."""


