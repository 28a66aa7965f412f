"""Decode steps padded to a batch-size bucket over static buffers, replayed as CUDA graphs on CUDA.

A decode step's launches (hundreds of small kernels for a small model) cost more than its math
at small batches; one graph per bucket replays them all in one launch. Each bucket's graph reads
its inputs from one static device buffer, laid out as the padded `StepLayout` of its bucket
says (the block table last and column-major, so a step sends only the columns it uses), into which `StepPacker` copies each step (padded to the bucket) in one non-blocking copy;
its output is the graph's own static hidden-state tensor. Prefill and speculative steps (more
than one token a sequence) stay eager, as do decodes wider than the largest bucket or whose
block tables outgrow `table_width`.

Without capture (on the CPU, or `capture=False`), the same padded step over the same buffer runs
eagerly: the tests check that its tokens equal the unpadded step's, so the GPU's padding and
buffer logic is tested where no GPU is.
"""

from __future__ import annotations

from typing import Sequence

import structlog
import torch

from cadenza.runner.step_inputs import StepInputs, StepLayout, StepPacker, views
from cadenza.step import ScheduledChunk

log = structlog.get_logger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to `max_num_seqs` (the last bucket is `max_num_seqs` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphRunner:
    """Runs decode steps of up to `max(buckets)` sequences as their bucket's padded step."""

    def __init__(self, model, backend, kv_caches: list, packer: StepPacker, *, max_num_seqs: int, table_width: int,
                 capture: bool) -> None:
        if not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {backend.name!r} cannot run padded decode steps (supports_cuda_graphs)")
        self.model, self.backend, self.kv_caches, self.packer = model, backend, kv_caches, packer
        self.buckets = batch_buckets(max_num_seqs)
        self.table_width = table_width
        self.capture = capture and packer.device.type == "cuda"
        largest = self.buckets[-1]
        size = StepLayout(largest, largest, table_width, largest, padded=True).size
        self.static = torch.zeros(size, dtype=torch.int64, device=packer.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def takes(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether this step is a decode the runner can pad: one token a sequence, few enough
        sequences, block tables within the static width."""
        return (
            len(chunks) <= self.buckets[-1]
            and all(len(c.token_ids) == 1 for c in chunks)
            and all(len(c.block_table) <= self.table_width for c in chunks)
        )

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, chunks: Sequence[ScheduledChunk], sample_rows: Sequence[int]) -> tuple[StepInputs, torch.Tensor]:
        """(the padded step's inputs, hidden states of all its rows, padding included)."""
        bucket = self.bucket(len(chunks))
        inputs = self.packer.pack(chunks, sample_rows, pad_to=bucket, table_width=self.table_width, into=self.static)
        if not self.capture:
            return inputs, self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)
        graph, hidden = self._graphs.get(bucket) or self._capture(bucket, inputs)
        graph.replay()
        return inputs, hidden

    def capture_all(self) -> None:
        """Capture every bucket's graph now, largest first (smaller ones reuse its memory pool),
        so no request pays for a capture."""
        if not self.capture:
            return
        for bucket in reversed(self.buckets):
            self._capture(bucket, self._padding_inputs(bucket))
        log.info("Captured decode CUDA graphs", buckets=self.buckets, table_width=self.table_width)

    def _padding_inputs(self, bucket: int) -> StepInputs:
        """The bucket's views of the static buffer, filled as an all-padding step."""
        return self.packer.pack([], [], pad_to=bucket, table_width=self.table_width, into=self.static)

    def _capture(self, bucket: int, inputs: StepInputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Every step of this bucket packs into these very views: the graph reads them in place.
        fields = views(self.static, StepLayout(bucket, bucket, self.table_width, bucket, padded=True))
        assert fields["block_tables"].data_ptr() == inputs.meta.block_tables.data_ptr()

        def step() -> torch.Tensor:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread makes meanwhile (the event loop's) is not an error
        # of this capture, as the global mode would make it.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = step()
        self._pool = graph.pool()
        self._graphs[bucket] = (graph, hidden)
        return graph, hidden
