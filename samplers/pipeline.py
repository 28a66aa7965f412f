"""One sampling step: the configured logits processors in order, then the sampler."""

from __future__ import annotations

from typing import Iterable, Sequence

import structlog
import torch

from cadenza.samplers.base import (
    LogitsProcessor,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingComponent,
    SamplingContext,
    SamplingError,
)
from cadenza.samplers.extra import ExtraParams, ExtraParamsError

log = structlog.get_logger(__name__)


class SamplingPipeline:
    """Applies each active processor to a batch's logits, in order, then calls the sampler.

    Built once at start-up; `__call__` runs on the per-token path, so it does no registry lookups.
    It also keeps the plugins' request lifecycle: a request whose `SamplingParams.extra` switches
    plugins on joins them the first time it is in a batch (`on_request_added`), and leaves them
    when the engine reports it gone (`finish_requests` -> `on_request_finished`).
    """

    def __init__(
        self, context: SamplingContext, processors: Sequence[LogitsProcessor], sampler: Sampler
    ) -> None:
        self.context = context
        self.processors = list(processors)
        self.sampler = sampler
        self._components: dict[str, SamplingComponent] = {c.name: c for c in (*self.processors, sampler)}
        self.extra_params = ExtraParams({name: type(c) for name, c in self._components.items()}, self._components.values())
        # Components a SamplingParams field switches on (`request_field`), e.g. structured outputs.
        self._field_components = [(c.request_field, c) for c in self._components.values() if c.request_field]
        self._joined: dict[str, list[SamplingComponent]] = {}  # request id -> components told of it
        self._one_pass = None  # kernels/triton/sampling.py where its kernels run (use_one_pass)

    def use_one_pass(self, kernel) -> None:
        """Sample batches that need nothing but temperatures and the exponential race with `kernel`
        (kernels/triton/sampling.py): one read of the logits per row instead of about ten passes.
        Taken where the sampler and every active processor say they fold into it
        (`folds_into_one_pass`) and no row wants log-probabilities; otherwise the torch path."""
        self._one_pass = kernel

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Pick one token per row of `logits` [B, V] (any float dtype).

        The pipeline owns `logits`: processors may edit them in place, so the caller must not reuse
        them afterwards. Log-probabilities are still taken from the raw values: the raw tensor is
        copied first whenever a processor would otherwise overwrite it.
        An all-greedy batch skips argmax-invariant processors, and when nothing else is left to
        run, no row wants log-probabilities and no row has params for the sampler, it is a bare
        argmax, without calling the sampler.
        """
        self._join(batch)
        active = self._active(batch)
        wants_logprobs = any(p.logprobs is not None for p in batch.params)
        if self._bare_argmax(batch, active, wants_logprobs):
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        if self._one_pass is not None and not wants_logprobs and self._folds_into_one_pass(batch, active):
            return SamplerOutput(token_ids=self._one_pass_tokens(logits, batch))

        raw = logits
        work = logits.float()  # a copy unless the logits already are float32
        if work is raw and active and wants_logprobs:
            work = work.clone()
        for processor in active:
            work = self._apply(processor, work, batch)
        try:
            output = self.sampler.sample(work, raw, batch)
        except Exception as exc:
            raise SamplingError(f"sampler {self.sampler.name!r}", list(range(len(batch))), exc) from exc
        if output.token_ids.shape != (len(batch),):
            raise SamplingError(
                f"sampler {self.sampler.name!r}", list(range(len(batch))),
                f"returned token ids of shape {tuple(output.token_ids.shape)}, expected ({len(batch)},)",
            )
        return output

    def is_argmax(self, batch: SamplingBatch) -> bool:
        """Whether sampling `batch` is a bare argmax of its logits, whatever the tokens before: a
        caller may then take the argmax of many positions in one call (speculative verification).
        Joins the batch's new requests first, raising SamplingError as a call would."""
        self._join(batch)
        return self._bare_argmax(batch, self._active(batch), any(p.logprobs is not None for p in batch.params))

    def _join(self, batch: SamplingBatch) -> None:
        failed = self.add_requests(batch)
        if failed:
            raise SamplingError("sampling plugins", sorted(failed), "on_request_added failed", failed)

    def _active(self, batch: SamplingBatch) -> list[LogitsProcessor]:
        all_greedy = batch.all_greedy
        return [p for p in self.processors if not (all_greedy and p.argmax_invariant) and p.is_active(batch)]

    def _bare_argmax(self, batch: SamplingBatch, active: list[LogitsProcessor], wants_logprobs: bool) -> bool:
        return batch.all_greedy and not active and not wants_logprobs and not self._sampler_has_rows(batch)

    def _folds_into_one_pass(self, batch: SamplingBatch, active: list[LogitsProcessor]) -> bool:
        return _folds(self.sampler) and all(_folds(p) for p in active) and not self._sampler_has_rows(batch)

    def _one_pass_tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The one-pass kernel's tokens: each row's temperature (0: greedy) and noise key, a seeded
        row's from its seed and position in its output (its tokens depend on its seed alone), the
        others' from one draw of the sampler's generator this step."""
        kernel = self._one_pass
        step = int(torch.randint(0, 2**62, (1,), generator=getattr(self.sampler, "generator", None)))
        temperatures, keys = [], []
        for row, (params, output) in enumerate(zip(batch.params, batch.output_token_ids)):
            temperatures.append(0.0 if params.is_greedy else float(params.temperature))
            keys.append(kernel.row_key(params.seed, len(output)) if params.seed is not None else kernel.row_key(step, row))
        device = logits.device
        return kernel.sample(logits, torch.tensor(temperatures, dtype=torch.float32, device=device),
                             torch.tensor(keys, dtype=torch.int64, device=device))

    def _sampler_has_rows(self, batch: SamplingBatch) -> bool:
        """A sampler given params for a row must see it, even a greedy one."""
        params = self.sampler.request_params
        return bool(params) and any(r in params for r in batch.request_ids)

    def add_requests(self, batch: SamplingBatch) -> dict[int, str]:
        """Join the batch's new requests to the plugins they switch on; failed rows -> why.

        Requests without `extra` or a plugin-served field are never recorded: the common case
        costs a check or two per row.
        """
        failed: dict[int, str] = {}
        for row, (request_id, params) in enumerate(zip(batch.request_ids, batch.params)):
            if request_id in self._joined:
                continue
            fields = [(c, getattr(params, f)) for f, c in self._field_components if getattr(params, f, None) is not None]
            if not params.extra and not fields:
                continue
            joined = self._joined[request_id] = []
            try:
                parsed = self.extra_params.validate(params.extra)
            except ExtraParamsError as exc:
                failed[row] = str(exc)
                continue
            for component, value in [*((self._components[n], v) for n, v in parsed.items()), *fields]:
                name = component.name
                try:
                    component.on_request_added(request_id, value)
                except Exception as exc:
                    failed[row] = f"{_kind(component)} {name!r} failed in on_request_added: {exc!r}"
                    break
                joined.append(component)
        return failed

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """The requests left the engine: tell each plugin that had joined them. Never raises."""
        for request_id in request_ids:
            for component in self._joined.pop(request_id, ()):
                try:
                    component.on_request_finished(request_id)
                except Exception as exc:
                    # The request is already over: there is no one left to fail, only to tell.
                    log.warning("Plugin failed in on_request_finished", plugin=component.name, request_id=request_id, error=repr(exc))

    @property
    def num_joined(self) -> int:
        """Requests the pipeline holds plugin state for (zero once every request has left)."""
        return len(self._joined)

    @staticmethod
    def _apply(processor: LogitsProcessor, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Run one processor; a raise or a wrong shape fails only the rows that use it."""
        shape = logits.shape
        try:
            result = processor.apply(logits, batch)
        except SamplingError:
            raise  # the processor named the rows at fault itself
        except Exception as exc:
            raise SamplingError(f"logits processor {processor.name!r}", _rows(processor, batch), exc) from exc
        if not isinstance(result, torch.Tensor) or result.shape != shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise SamplingError(
                f"logits processor {processor.name!r}", _rows(processor, batch), f"returned {got}, expected {tuple(shape)}"
            )
        return result


def _folds(component: SamplingComponent) -> bool:
    """`folds_into_one_pass` as the component's own class declares it: a subclass that changes how
    it samples or processes does not inherit it."""
    return bool(type(component).__dict__.get("folds_into_one_pass", False))


def _kind(component: SamplingComponent) -> str:
    return "logits processor" if isinstance(component, LogitsProcessor) else "sampler"


def _rows(processor: LogitsProcessor, batch: SamplingBatch) -> list[int]:
    try:
        return list(processor.rows_using(batch))
    except Exception:
        return list(range(len(batch)))
