"""A step's model inputs, packed on the host and sent to the device in one copy.

Every integer a step needs (token ids, positions, KV slots, query starts, sequence and context
lengths, block tables, the rows whose logits are sampled) goes into one int64 array, laid out as
`StepLayout` says; on CUDA that array lives in pinned memory and reaches the GPU in one
non-blocking copy, and every device tensor of the step is a view of the copy. Nothing in the
model call then waits on the host: no `.item()`, `.tolist()` or `.cpu()` (a test compiles the
decode call with `torch.compile(fullgraph=True)`, which refuses any).

A step may be padded to a batch-size bucket (`pad_to`, for the CUDA-graph decode): padding rows
carry token 0 at position 0, slot -1 (the backends skip the write) and sequence length 0.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from cadenza.attention_backends.base import AttentionMetadata
from cadenza.step import ScheduledChunk

PAD_SLOT = -1


# Every field starts at a multiple of this many int64s (64 bytes): Triton specializes a kernel on
# each pointer's 16-byte alignment, and fields packed end to end started at offsets that differ from
# bucket to bucket, so each CUDA-graph bucket could compile its own variants of the kernels.
FIELD_ALIGN = 8


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Offsets of each field in the packed array for `num_tokens` rows of `num_seqs` sequences,
    block tables `table_width` wide and `num_sample_rows` sampled rows.

    A padded step (`padded`, the CUDA-graph decode) keeps its block table last and column-major
    ([table_width, num_seqs], seen as [num_seqs, table_width] with strides (1, num_seqs)): a
    graph's table is as wide as the longest sequence may grow, but a step fills and sends only
    the columns its sequences use, a prefix of the array (`sent`)."""

    num_tokens: int
    num_seqs: int
    table_width: int
    num_sample_rows: int
    padded: bool = False

    def spans(self) -> dict[str, tuple[int, int]]:
        """Field -> (start, end); computed once per layout (a step's packing asks every time)."""
        return _spans(self)

    def _compute_spans(self) -> dict[str, tuple[int, int]]:
        t, b = self.num_tokens, self.num_seqs
        sizes = [("input_ids", t), ("positions", t), ("slot_mapping", t), ("query_start_loc", b + 1), ("seq_lens", b),
                 ("context_lens", b)]
        tables = ("block_tables", b * self.table_width)
        sizes += [("sample_rows", self.num_sample_rows), tables] if self.padded else [tables, ("sample_rows", self.num_sample_rows)]
        spans, offset = {}, 0
        for name, size in sizes:
            spans[name] = (offset, offset + size)
            offset += -(-size // FIELD_ALIGN) * FIELD_ALIGN
        return spans

    @property
    def size(self) -> int:
        return _size(self)

    def sent(self, columns: int) -> int:
        """Elements a step sends whose sequences use `columns` table columns."""
        if not self.padded:
            return self.size
        return self.spans()["block_tables"][0] + columns * self.num_seqs


@functools.lru_cache(maxsize=1024)
def _spans(layout: StepLayout) -> dict[str, tuple[int, int]]:
    return layout._compute_spans()


@functools.lru_cache(maxsize=1024)
def _size(layout: StepLayout) -> int:
    return max(end for _, end in _spans(layout).values())


@dataclass(slots=True)
class StepInputs:
    """The step's device tensors (views of one buffer) and the host facts the runner keeps."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the model's output whose logits are computed
    num_real_tokens: int  # rows before any padding
    num_sent: int  # int64s packed and sent to the device for this step


def views(buffer, layout: StepLayout) -> dict:
    """The named fields of `layout` inside `buffer`, a tensor or a numpy array (no copies)."""
    out = {name: buffer[start:end] for name, (start, end) in layout.spans().items()}
    tables = out["block_tables"]
    if layout.padded:
        out["block_tables"] = tables.reshape(layout.table_width, layout.num_seqs).T
    else:
        out["block_tables"] = tables.reshape(layout.num_seqs, layout.table_width)
    return out


class StepPacker:
    """Packs steps into reused host arrays and sends each to the device in one copy.

    On CUDA two pinned host buffers alternate, each guarded by the event of the copy that last
    read it, so packing step n+1 never overwrites what step n's copy has not read yet. On the CPU
    the tensors are views of the host array itself (no copy at all).
    """

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self._on_cuda = self.device.type == "cuda"
        self._host: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self._host_np: list[np.ndarray] = [h.numpy() for h in self._host]  # the same memory, for packing
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _host_buffer(self, size: int) -> int:
        """The turn whose host buffer holds at least `size` and is free to overwrite."""
        turn = self._turn = 1 - self._turn if self._on_cuda else 0
        if (event := self._copied[turn]) is not None:
            event.synchronize()  # the copy issued two steps ago: long done in practice
        if self._host[turn].numel() < size:
            grown = max(size, 2 * self._host[turn].numel(), 1024)
            self._host[turn] = torch.empty(grown, dtype=torch.int64, pin_memory=self._on_cuda)
            self._host_np[turn] = self._host[turn].numpy()
        return turn

    def pack(self, chunks: Sequence[ScheduledChunk], sample_rows: Sequence[int], *, pad_to: int | None = None,
             table_width: int | None = None, into: torch.Tensor | None = None) -> StepInputs:
        """`chunks`' inputs (every token id resolved), logits at flat rows `sample_rows`; padded
        to `pad_to` one-token sequences (decode only) with tables `table_width` wide when given;
        copied into the device buffer `into` (the graph runner's static one) when given."""
        block_size = self.block_size
        query_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start_position for c in chunks), dtype=np.int64, count=len(chunks))
        seq_lens = starts + query_lens
        widths = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=len(chunks))
        short = np.flatnonzero(widths * block_size < seq_lens)
        if short.size:
            row = int(short[0])
            raise ValueError(f"request {chunks[row].request_id}: block table covers {int(widths[row]) * block_size} tokens, "
                             f"step needs {int(seq_lens[row])}")
        num_real, num_seqs = int(query_lens.sum()), len(chunks)
        if pad_to is not None:
            if into is None or table_width is None:
                raise ValueError("a padded step goes into a static buffer (into) with a static table_width")
            if (num_seqs and int(query_lens.max()) != 1) or pad_to < num_seqs:
                raise ValueError(f"only a decode of at most {pad_to} sequences pads to {pad_to}")
            num_seqs = pad_to
        widest = int(widths.max()) if len(chunks) else 0
        width = widest if table_width is None else table_width
        if width < widest:
            raise ValueError(f"a block table of {widest} blocks is wider than the static {width}")
        num_tokens = num_real if pad_to is None else pad_to
        padded = pad_to is not None
        # A padded step reserves a sampled row a sequence, so the table's offset never moves.
        layout = StepLayout(num_tokens, num_seqs, width, num_seqs if padded else len(sample_rows), padded)
        sent = layout.sent(max(widest, 1))
        turn = self._host_buffer(layout.size)
        fields = views(self._host_np[turn][:sent], replace(layout, table_width=max(widest, 1)) if padded else layout)
        n = len(chunks)
        ids, positions, slots, tables = fields["input_ids"], fields["positions"], fields["slot_mapping"], fields["block_tables"]
        tables.fill(0)  # the used columns only, for a padded step: the kernels read no further
        # Every row's table and token ids in one pass each at C speed (chained, then scattered):
        # a Python loop over rows cost about 5 us a row, 1.4 ms a step of 256 decodes.
        total_blocks = int(widths.sum())
        flat = np.fromiter(itertools.chain.from_iterable(c.block_table for c in chunks), dtype=np.int64, count=total_blocks)
        block_rows = np.repeat(np.arange(n), widths)
        row_starts = np.cumsum(widths) - widths
        tables[block_rows, np.arange(total_blocks) - row_starts[block_rows]] = flat
        ids[:num_real] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=num_real)
        query_start_loc = fields["query_start_loc"]
        query_start_loc[0] = 0
        np.cumsum(query_lens, out=query_start_loc[1 : n + 1])
        seq_index = np.repeat(np.arange(n), query_lens)
        positions[:num_real] = starts[seq_index] + np.arange(num_real) - query_start_loc[seq_index]
        slots[:num_real] = tables[seq_index, positions[:num_real] // block_size] * block_size + positions[:num_real] % block_size
        fields["seq_lens"][:n], fields["context_lens"][:n] = seq_lens, starts
        fields["sample_rows"][: len(sample_rows)] = sample_rows
        fields["sample_rows"][len(sample_rows) :] = 0  # a padded step's unused ones (the buffer is reused uninitialised)
        if num_tokens > num_real:  # padding rows: token 0 at position 0, no KV write, no keys
            ids[num_real:], positions[num_real:], slots[num_real:] = 0, 0, PAD_SLOT
            query_start_loc[n + 1 :] = np.arange(num_real + 1, num_tokens + 1)
            fields["seq_lens"][n:], fields["context_lens"][n:] = 0, 0
        device_buffer = self._send(self._host[turn][:sent], into)
        if into is not None:
            device_buffer = into  # the whole static buffer: its tables' unsent columns are never read
        out = views(device_buffer, layout)
        out["sample_rows"] = out["sample_rows"][: len(sample_rows)]
        q_list, s_list = query_lens.tolist(), seq_lens.tolist()
        if num_seqs > n:
            q_list, s_list = q_list + [1] * (num_seqs - n), s_list + [0] * (num_seqs - n)
        meta = AttentionMetadata(
            query_start_loc=out["query_start_loc"], seq_lens=out["seq_lens"], context_lens=out["context_lens"],
            block_tables=out["block_tables"], slot_mapping=out["slot_mapping"], query_lens_list=q_list,
            seq_lens_list=s_list, max_query_len=max(q_list), max_seq_len=max(s_list),
        )  # fmt: skip
        return StepInputs(out["input_ids"], out["positions"], meta, out["sample_rows"], num_real, sent)

    def _send(self, host: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        if into is not None:
            target = into[: host.numel()]
            target.copy_(host, non_blocking=True)
        elif self.device.type == "cpu":
            return host
        else:
            target = host.to(self.device, non_blocking=True)
        if self._on_cuda:
            event = self._copied[self._turn] = torch.cuda.Event()
            event.record()
        return target
