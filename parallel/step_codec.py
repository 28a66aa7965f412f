"""What rank 0 sends the other ranks: a fixed header of ints, then one flat payload.

A step's inputs (token ids, positions and the attention metadata) travel as one int64 tensor, the
header carrying the shapes needed to cut it apart: two broadcasts a step, never a pickle. Commands:

    STEP    header [STEP, T, B, M, max_query_len, max_seq_len], payload int64
            [ids(T) | positions(T) | query_start_loc(B+1) | seq_lens(B) | context_lens(B) |
             block_tables(B*M) | slot_mapping(T)]
    LOGITS  header [LOGITS, rows, hidden, dtype], payload float32 [rows * hidden]: the hidden states
            the LM head multiplies (the sampled rows, or a re-sample's survivors), cast back to
            `dtype` on arrival
    NOOP    header only: a heartbeat while the engine idles, so a waiting rank's timeout means death
    STOP    header only: leave the loop
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from cadenza.attention_backends.base import AttentionMetadata
from cadenza.parallel.groups import ParallelContext
from cadenza.parallel.tensor_parallel import record

HEADER_LEN = 8


class Command(IntEnum):
    STEP = 1
    LOGITS = 2
    NOOP = 3
    STOP = 4


@dataclass(frozen=True, slots=True)
class Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True, slots=True)
class Logits:
    hidden: torch.Tensor


# Hidden-state dtypes by code in a LOGITS header (sent as float32, which holds each exactly).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnknownCommandError(RuntimeError):
    """A header named no command: the ranks are out of step."""


class StepChannel:
    """Broadcasts from rank 0 to the others over the group; `receive` on the others."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=ctx.device)
        self.bytes_sent = 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        dist.broadcast(tensor, src=0, group=self.ctx.group)
        record(time.perf_counter() - started, tensor.numel() * tensor.element_size())

    def _send_header(self, *fields: int) -> None:
        self.header.zero_()
        self.header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self._broadcast(self.header)
        self.bytes_sent += HEADER_LEN * 8

    # --- rank 0 --------------------------------------------------------------------------------

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        tables = meta.block_tables
        self._send_header(Command.STEP, input_ids.shape[0], meta.num_seqs, tables.shape[1], meta.max_query_len, meta.max_seq_len)
        payload = torch.cat([
            input_ids, positions, meta.query_start_loc, meta.seq_lens, meta.context_lens, tables.reshape(-1), meta.slot_mapping,
        ]).to(device=self.ctx.device, dtype=torch.int64)  # fmt: skip
        self._broadcast(payload)
        self.bytes_sent += payload.numel() * 8

    def send_logits(self, hidden: torch.Tensor) -> None:
        rows, width = hidden.shape
        self._send_header(Command.LOGITS, rows, width, _DTYPES.index(hidden.dtype))
        payload = hidden.to(device=self.ctx.device, dtype=torch.float32).contiguous().view(-1)
        self._broadcast(payload)
        self.bytes_sent += payload.numel() * 4

    def send(self, command: Command) -> None:
        """A command without payload (NOOP, STOP)."""
        self._send_header(command)

    # --- the other ranks -----------------------------------------------------------------------

    def receive(self) -> Step | Logits | Command:
        self._broadcast(self.header)
        fields = self.header.tolist()
        match fields[0]:
            case Command.STEP:
                return self._receive_step(*fields[1:6])
            case Command.LOGITS:
                rows, width, dtype = fields[1:4]
                payload = torch.empty(rows * width, dtype=torch.float32, device=self.ctx.device)
                self._broadcast(payload)
                return Logits(payload.view(rows, width).to(_DTYPES[dtype]))
            case Command.NOOP | Command.STOP:
                return Command(fields[0])
            case other:
                raise UnknownCommandError(f"rank {self.ctx.rank} received an unknown command {other}")

    def _receive_step(self, tokens: int, seqs: int, cols: int, max_query_len: int, max_seq_len: int) -> Step:
        payload = torch.empty(3 * tokens + 3 * seqs + 1 + seqs * cols, dtype=torch.int64, device=self.ctx.device)
        self._broadcast(payload)
        ids, positions, starts, seq_lens, context_lens, tables, slots = payload.split(
            [tokens, tokens, seqs + 1, seqs, seqs, seqs * cols, tokens]
        )
        starts_list = starts.tolist()
        meta = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=seq_lens,
            context_lens=context_lens,
            block_tables=tables.view(seqs, cols),
            slot_mapping=slots,
            query_lens_list=[b - a for a, b in zip(starts_list, starts_list[1:])],
            seq_lens_list=seq_lens.tolist(),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        return Step(ids, positions, meta)
