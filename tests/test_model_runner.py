"""ModelRunner's per-request records, with a pretend model: what sampling reads of each request
(prompt, tokens sampled so far, seeded generator) is kept by the runner, not copied into every step."""

from __future__ import annotations

import torch

from cadenza.runner.model_runner import ModelRunner
from cadenza.samplers.base import SamplerOutput
from cadenza.sampling_params import SamplingParams
from cadenza.step import PENDING_TOKEN, ScheduledChunk

VOCAB = 16


class FakeModel:
    def __call__(self, input_ids, positions, kv_caches, meta, backend):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], VOCAB)


class RecordingPipeline:
    """Samples 1, 2, 3, ... per request; remembers each batch's rows."""

    def __init__(self) -> None:
        self.batches = []
        self.finished = []

    def __call__(self, logits, batch):
        self.batches.append(
            [(r, list(o), o, p, g) for r, o, p, g in zip(batch.request_ids, batch.output_token_ids, batch.prompt_token_ids, batch.generators)]
        )
        return SamplerOutput(torch.tensor([len(o) + 1 for o in batch.output_token_ids]))

    def finish_requests(self, request_ids):
        self.finished += list(request_ids)


def make_runner() -> tuple[ModelRunner, RecordingPipeline]:
    pipeline = RecordingPipeline()
    return ModelRunner(FakeModel(), [], None, pipeline, 4, torch.device("cpu")), pipeline


def chunk(request_id, tokens, start, num_output_tokens=None, seed=None, prompt=(5, 6, 7)):
    params = SamplingParams(temperature=1.0, seed=seed)
    return ScheduledChunk(request_id, tokens, start, (0, 1, 2), True, params, prompt, num_output_tokens)


def test_the_runner_keeps_each_request_s_outputs_without_copying_them_per_step():
    runner, pipeline = make_runner()
    prompt = (5, 6, 7)
    runner.execute([chunk("a", prompt, 0, 0, prompt=prompt)])
    runner.execute([chunk("a", [PENDING_TOKEN], 3, 1, prompt=prompt)])  # the placeholder is filled in
    runner.execute([chunk("a", [2], 4, 2, prompt=prompt)])
    rows = [batch[0] for batch in pipeline.batches]
    assert [outputs for _, outputs, _, _, _ in rows] == [[], [1], [1, 2]]
    assert rows[0][2] is rows[2][2]  # one list, appended to
    assert all(p is prompt for _, _, _, p, _ in rows)
    runner.finish_requests(["a"])
    assert pipeline.finished == ["a"] and not runner._requests


def test_tokens_beyond_the_scheduler_s_count_are_dropped():
    # a's second token was sampled by a step planned before a preemption: the scheduler dropped
    # it, and the recompute's last chunk says a has one output token.
    runner, pipeline = make_runner()
    runner.execute([chunk("a", (5, 6, 7), 0, 0)])
    runner.execute([chunk("a", [1], 3, 1)])
    runner.execute([chunk("a", (5, 6, 7, 1), 0, 1)])
    assert pipeline.batches[-1][0][1] == [1]
    assert runner._requests["a"].output_token_ids == [1, 2]


def test_a_seeded_request_draws_from_one_generator_across_a_recompute():
    runner, pipeline = make_runner()
    runner.execute([chunk("a", (5, 6, 7), 0, 0, seed=3)])
    first = pipeline.batches[-1][0][4]
    expected = torch.Generator().manual_seed(3)
    assert torch.equal(first.get_state(), expected.get_state())
    torch.rand(4, generator=first)  # sampling advances it
    runner.execute([chunk("a", (5, 6, 7, 1), 0, 1, seed=3)])  # recomputed after a preemption
    assert pipeline.batches[-1][0][4] is first
    runner.finish_requests(["a"])
    runner.execute([chunk("a", (5, 6, 7), 0, 0, seed=3)])  # the id again, a new request
    fresh = pipeline.batches[-1][0][4]
    assert fresh is not first and torch.equal(fresh.get_state(), expected.get_state())


def test_a_seed_torch_refuses_fails_only_its_request():
    runner, pipeline = make_runner()
    bad = ScheduledChunk("bad", (5,), 0, (3,), True, SamplingParams.model_construct(**{**SamplingParams().model_dump(), "seed": 2**64}))
    result = runner.execute([chunk("a", (5, 6, 7), 0, 0), bad])
    assert result.request_ids == ["a"] and result.sampled.token_ids.tolist() == [1]
    assert [request_id for request_id, _ in result.failed] == ["bad"] and "runner" in result.failed[0][1]


def test_a_seeded_requests_generator_is_made_on_the_runners_device(monkeypatch):
    """The generator follows the device the logits live on: a CPU generator cannot draw a CUDA
    tensor's noise (torch refuses), which failed every request batched with a seeded one."""
    runner, pipeline = make_runner()
    devices = []
    real = torch.Generator

    def spy(device="cpu"):
        devices.append(torch.device(device))
        return real()  # a CPU stand-in: this machine may have no GPU to make one on

    monkeypatch.setattr(torch, "Generator", spy)
    runner.device = torch.device("cuda")  # as the runner of a CUDA model holds it
    runner._record(chunk("a", (5, 6, 7), 0, 0, seed=3))
    assert devices == [torch.device("cuda")]
