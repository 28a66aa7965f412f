"""Linears and embeddings over GGUF's quantized blocks as the file stores them.

The weights stay raw blocks (a uint8 tensor [rows, bytes per row] of one GGML type): resident
weight memory is the file's tensor bytes, and a decode step reads those bytes, not a de-quantized
copy. Products run through cadenza's CPU kernels (`kernels/cpu/quant.h`): activations are quantized
to int8 on the fly with a scale per 32 values (per 256 for the K-quants and IQ4_XS, as llama.cpp's Q8_K), so outputs differ from the float product of the de-quantized
weights by that rounding (what llama.cpp does too). An embedding lookup de-quantizes only the rows
looked up; a tied LM head multiplies the embedding's own blocks.

Steps of many rows (prefill) are compute-bound, and there a GEMM beats the int8 kernel (AVX2:
~2x at 128 rows and more, measured at the default model's shapes): from `GEMM_MIN_ROWS` rows on,
the weight is de-quantized into a per-thread scratch buffer (one weight at a time, never kept) and
multiplied by PyTorch. On CPUs that multiply bfloat16 natively (AVX512-BF16, AMX) the scratch
weight (de-quantized straight to bfloat16) and the activations are bfloat16: that GEMM is 4-5x the
float32 one there (M=512, the default model's shapes), so the crossover moves down to
`GEMM_MIN_ROWS_BF16` rows (measured on Sapphire Rapids over the default model's layers: the int8
kernel costs ~1.9 ms a row, de-quantizing every weight and the GEMMs 32-38 ms at 1-32 rows), and the rounding is that of the
de-quantized bfloat16 model; elsewhere it is float32 and rounds no activation. Packed weights
(below) stay on the int8 kernel up to `GEMM_MIN_ROWS_PACKED` rows, by the build's group: 16 rows
(AVX-512 VNNI) cost ~0.6 ms a row over the model (measured, same CPU, model step: batch-32 decode
27 against 63 ms through the GEMM, a 128-token prefill 66 against 76 ms, 192 tokens 98 against
90 ms); 8 rows (AVX2) beat the float32 GEMM at every size measured, 1 to 1024 rows (one core of the
same CPU as `CADENZA_CPU=avx2`, MKL held to AVX2, the model's linears: 1.47-1.71 ms a row against
1.93 at 1024 rows, 2.19 at 128), so a prefill chunk (512 by default) never takes the GEMM there.

A fused projection (q/k/v, gate/up) is its parts' rows one after another; parts of one type are
concatenated into one tensor (rows are independent), parts of different types each write their
columns of the output.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 (gpt-oss's
experts, models/mxfp4.py) weights whose rows are a multiple of the build's group are re-laid on
`use_cpu_kernels` a group of rows at a time (kernels/cpu/quant_packed.h; same bytes, the old tensor
freed): 16 rows for AVX-512 VNNI (batch-1
products about 2x faster, a step of 4 rows 1.5x one row instead of 2.5x), 8 for AVX2 and AVX-VNNI
(1.6-3x the file layout's products, `kernels.pack_rows()`, `kernels.quant_packs(type)`). A packed
part's type id is its GGML id plus `PACKED_FLAG`; a tied LM head packs once, with its embedding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# GGML type ids (gguf.GGMLQuantizationType) with a kernel: name, values and bytes per block.
NATIVE_TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                20: ("IQ4_NL", 32, 18), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
                13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17)}


# Type ids of packed weights (kernels/cpu/quant_packed.h): the GGML id plus this flag, in the layout of
# the build that packed them (a process runs one build).
PACKED_FLAG = 256
PACKABLE_TYPES = frozenset(NATIVE_TYPES)  # every type with a kernel has a packed layout (kernels/cpu/quant_packed.h)


def ggml_type(qtype: int) -> int:
    """The GGML type id of a weight's blocks, packed or not."""
    return qtype & ~PACKED_FLAG


# Bytes of blocks packed at a time in place: each group of rows packs into the same rows, so a weight
# packs a slice at a time, and no more than this is ever a second copy (the default model's Q8_0
# embedding whole would be 30 MB).
PACK_IN_PLACE_BYTES = 1 << 20


def pack_for_kernels(kernels, blocks: torch.Tensor, qtype: int, in_place: bool = False) -> tuple[torch.Tensor, int]:
    """(blocks, type id) re-laid for the packed kernels where this build, the type and the rows
    allow it; as given otherwise. `in_place`: the packed bytes overwrite `blocks` (a weight
    arena's), a slice of rows at a time."""
    if kernels is None or qtype not in PACKABLE_TYPES or not kernels.quant_packs(qtype):
        return blocks, qtype
    group = kernels.pack_rows()
    if blocks.shape[0] % group:
        return blocks, qtype
    if not in_place:
        return kernels.quant_pack(blocks, qtype), qtype | PACKED_FLAG
    step = max(1, PACK_IN_PLACE_BYTES // (group * blocks.shape[1])) * group
    for row in range(0, blocks.shape[0], step):
        rows = blocks[row : row + step]
        rows.copy_(kernels.quant_pack(rows, qtype))
    return blocks, qtype | PACKED_FLAG


def _joined(pieces: list[torch.Tensor], arena) -> torch.Tensor:
    """Row blocks one after another: in `arena` (a `WeightArena`) when given, else a new tensor
    (or the one piece itself)."""
    if arena is None:
        return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)
    out = arena.take(sum(p.shape[0] for p in pieces), pieces[0].shape[1])
    row = 0
    for piece in pieces:
        out[row : row + piece.shape[0]].copy_(piece)
        row += piece.shape[0]
    return out


# Rows from which a product de-quantizes its weight for a GEMM (see above); a weight of more than
# GEMM_SLICE_VALUES values (128 MiB of float32 scratch) is de-quantized and multiplied a slice of
# output rows at a time, each slice into its columns of the output, so that an 8B's gate/up
# (117M values) takes the GEMM too rather than staying on the int8 kernel.
GEMM_MIN_ROWS = 64
GEMM_MIN_ROWS_BF16 = 20
GEMM_MIN_ROWS_PACKED = {16: 160, 8: 2048}  # by kernels.pack_rows(), where AMX multiplies the GEMM
GEMM_MIN_ROWS_PACKED_NO_AMX = 2048  # AVX-512's own bf16 GEMM never beats the 16-row int8 kernel
GEMM_SLICE_VALUES = 32 << 20
GEMM_SLICE_ROWS = 64  # a slice's rows are a multiple of this: whole packed groups (16 or 8 rows)
_scratch = threading.local()


def _scratch_matrix(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    name = f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < rows * cols:
        buf = torch.empty(rows * cols, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[: rows * cols].view(rows, cols)


def _packed_gemm_min_rows(pack_rows: int) -> int:
    """Rows from which packed weights take the de-quantized GEMM: 16-row groups only where AMX
    runs that GEMM (without it, `CADENZA_CPU=avx512-bf16` on Sapphire Rapids: a 512-token prefill
    754 tok/s through the bf16 GEMM against 1,864 on the int8 kernel)."""
    from cadenza.kernels.cpu.features import AMX_FLAGS, cpu_flags

    if pack_rows == 16 and not AMX_FLAGS <= cpu_flags():
        return GEMM_MIN_ROWS_PACKED_NO_AMX
    return GEMM_MIN_ROWS_PACKED[pack_rows]


def _gemm_dtype() -> torch.dtype:
    from cadenza.kernels.cpu.features import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A 2-D weight as raw GGUF blocks: `blocks` uint8 [rows, bytes per row] of GGML type `qtype`."""

    blocks: torch.Tensor
    qtype: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.in_features)


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) for float32 x, W raw blocks in one or more row ranges (`parts`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.parts: list[tuple[int, int]] = []  # (first row, GGML type), blocks in buffers blocks0, blocks1, ...
        self._pending: list[tuple[int, QuantizedTensor]] = []
        self.kernels = None
        self.bias_f32: torch.Tensor | None = None
        # Rows from which a step leaves the fused decoder-layer kernel (DecoderLayer.fuse) for the GEMM.
        self.min_rows = GEMM_MIN_ROWS
        self.gemm_dtype = torch.float32
        # A tied head's embedding, in a tuple so that it is not registered as a submodule.
        self.tied: tuple[QuantizedEmbedding, ...] = ()
        # Whether the blocks are this model's own, in a weight arena (packed there in place).
        self.in_arena = False

    @classmethod
    def tied_to(cls, embedding: "QuantizedEmbedding") -> "QuantizedLinear":
        """The LM head that multiplies `embedding`'s own blocks."""
        head = cls(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        head._set_parts([(0, embedding.qtype, embedding.blocks)])
        head.tied = (embedding,)
        head.in_arena = embedding.in_arena
        return head

    def load_rows(self, first_row: int, tensor: QuantizedTensor) -> None:
        """Rows [first_row, first_row + tensor rows) of the weight; `finish_loading` assembles them."""
        self._pending.append((first_row, tensor))

    def finish_loading(self, arena=None) -> None:
        """Join the loaded row ranges: they must cover every output row exactly once. With
        `arena` (a `WeightArena`), the joined blocks are copied into it, and the loaded tensors
        (views of the file, say) are no longer referenced."""
        pending = sorted(self._pending, key=lambda p: p[0])
        self._pending = []
        merged: list[tuple[int, int, list[torch.Tensor]]] = []
        row = 0
        for first, tensor in pending:
            if first != row or tensor.in_features != self.in_features:
                raise ValueError(f"quantized rows from {first} ({tensor.in_features} features) do not follow row {row}")
            if merged and merged[-1][1] == tensor.qtype:
                merged[-1][2].append(tensor.blocks)
            else:
                merged.append((first, tensor.qtype, [tensor.blocks]))
            row += tensor.blocks.shape[0]
        if row != self.out_features:
            raise ValueError(f"quantized rows cover {row} of {self.out_features} outputs")
        self._set_parts([(first, qtype, _joined(b, arena)) for first, qtype, b in merged])
        self.in_arena = arena is not None

    def _set_parts(self, parts: list[tuple[int, int, torch.Tensor]]) -> None:
        self.parts = []
        for i, (first, qtype, blocks) in enumerate(parts):
            self.register_buffer(f"blocks{i}", blocks.contiguous(), persistent=False)
            self.parts.append((first, qtype))

    def _blocks(self, i: int) -> torch.Tensor:
        return getattr(self, f"blocks{i}")

    def block_tensors(self) -> list[torch.Tensor]:
        return [self._blocks(i) for i in range(len(self.parts))]

    def rebind_blocks(self, moved: dict[int, torch.Tensor]) -> None:
        """Use the copies in `moved` (by the data_ptr of the blocks they copy) from now on."""
        self._set_parts([(first, qtype, moved[self._blocks(i).data_ptr()]) for i, (first, qtype) in enumerate(self.parts)])
        self.in_arena = True

    def use_cpu_kernels(self, kernels) -> None:
        self.kernels = kernels
        self.bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()
        self.gemm_dtype = _gemm_dtype()
        if self.tied:  # the embedding's blocks, packed once for both
            self.tied[0].use_cpu_kernels(kernels)
            self._set_parts([(0, self.tied[0].qtype, self.tied[0].blocks)])
            self.in_arena = self.tied[0].in_arena
        else:
            parts = []
            for i, (first, qtype) in enumerate(self.parts):
                blocks, qtype = pack_for_kernels(kernels, self._blocks(i), qtype, in_place=self.in_arena)
                parts.append((first, qtype, blocks))
            self._set_parts(parts)
        if all(qtype & PACKED_FLAG for _, qtype in self.parts):
            self.min_rows = _packed_gemm_min_rows(kernels.pack_rows())
        else:
            self.min_rows = GEMM_MIN_ROWS_BF16 if self.gemm_dtype == torch.bfloat16 else GEMM_MIN_ROWS

    def _checked(self, x: torch.Tensor, keep: torch.dtype = torch.float32) -> torch.Tensor:
        """`x` as float32 (or left as `keep`, the GEMM's own dtype), rows of unit stride."""
        if self.kernels is None:
            raise RuntimeError("a QuantizedLinear runs only on cadenza's CPU kernels, and they are switched off")
        x = x if x.dtype in (torch.float32, keep) else x.float()
        return x if x.stride(-1) == 1 else x.contiguous()

    def _uses_gemm(self, x: torch.Tensor) -> bool:
        return x.shape[0] >= self.min_rows

    def takes_bf16(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs this product as a bfloat16 GEMM (bfloat16 input then
        costs it nothing)."""
        return self.gemm_dtype == torch.bfloat16 and rows >= self.min_rows

    def _dequantized_slices(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first row, end row, those rows as `gemm_dtype` [rows, in]) covering the weight, in this
        thread's scratch buffer (each valid until the next is made): the whole weight at once when
        it has at most GEMM_SLICE_VALUES values, else each part GEMM_SLICE_ROWS-aligned slices of it."""
        if self.out_features * self.in_features <= GEMM_SLICE_VALUES:
            weight = _scratch_matrix(self.out_features, self.in_features, self.gemm_dtype)
            for i, (first, qtype) in enumerate(self.parts):
                blocks = self._blocks(i)
                self.kernels.quant_dequantize_(weight.narrow(0, first, blocks.shape[0]), blocks, qtype)
            yield 0, self.out_features, weight
            return
        step = max(GEMM_SLICE_ROWS, GEMM_SLICE_VALUES // self.in_features // GEMM_SLICE_ROWS * GEMM_SLICE_ROWS)
        for i, (first, qtype) in enumerate(self.parts):
            blocks = self._blocks(i)
            for row in range(0, blocks.shape[0], step):
                rows = blocks[row : row + step]  # whole packed groups: `step` and the part's rows are multiples of them
                weight = _scratch_matrix(rows.shape[0], self.in_features, self.gemm_dtype)
                self.kernels.quant_dequantize_(weight, rows, qtype)
                yield first + row, first + row + rows.shape[0], weight

    def _product(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x @ W^T in `dtype` through the de-quantized weight, without the bias."""
        x = x.to(self.gemm_dtype)  # itself when it is already
        out = None
        for first, end, weight in self._dequantized_slices():
            part = F.linear(x, weight)
            if end - first == self.out_features:
                return part if part.dtype == dtype else part.to(dtype)
            if out is None:
                out = torch.empty(x.shape[0], self.out_features, dtype=dtype)
            out[:, first:end] = part
        return out

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through the de-quantized weight, float32 out, without the bias."""
        return self._product(x, torch.float32)

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T as the bfloat16 GEMM gives it (no bias, no float32 copy) when `x`'s rows take
        that GEMM; None otherwise. A prefill's MLP feeds it to `silu_mul_bf16` and the down
        projection: the same bits as through float32, two large copies fewer."""
        if self.bias_f32 is not None or not self.takes_bf16(x.shape[0]):
            return None
        return self._product(self._checked(x, keep=torch.bfloat16), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._checked(x)
        if self._uses_gemm(x):
            out = self._gemm(x)
            return out if self.bias_f32 is None else out.add_(self.bias_f32)
        if len(self.parts) == 1:
            return self.kernels.quant_linear(x, self.blocks0, self.parts[0][1], self.bias_f32)
        out = torch.empty(x.shape[0], self.out_features)
        for i, (first, qtype) in enumerate(self.parts):
            blocks = self._blocks(i)
            bias = None if self.bias_f32 is None else self.bias_f32[first : first + blocks.shape[0]]
            self.kernels.quant_matmul_(out.narrow(1, first, blocks.shape[0]), x, blocks, qtype, bias, False)
        return out

    def linear_add_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual += self(x)`, in place, fused into the product."""
        if self._uses_gemm(x) and residual.dtype == torch.float32:
            x = self._checked(x, keep=self.gemm_dtype).to(self.gemm_dtype)
            for first, end, weight in self._dequantized_slices():
                cols = residual if end - first == self.out_features else residual[:, first:end]
                if weight.dtype == torch.float32:
                    cols.addmm_(x, weight.t())
                else:  # the bfloat16 product added as float32 in one pass, with no float32 copy of it
                    cols.add_(F.linear(x, weight))
            return residual if self.bias_f32 is None else residual.add_(self.bias_f32)
        x = self._checked(x)
        if len(self.parts) == 1 and residual.dtype == torch.float32 and residual.stride(-1) == 1:
            return self.kernels.quant_linear_add_(residual, x, self.blocks0, self.parts[0][1], self.bias_f32)
        return residual.add_(self(x))

    def extra_repr(self) -> str:
        types = "+".join(NATIVE_TYPES[ggml_type(q)][0] + _packed_suffix(q, self.kernels) for _, q in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={types or 'pending'}"


def _packed_suffix(qtype: int, kernels) -> str:
    """"x8" or "x16" after a packed type's name (the rows of its groups), "" for the file's layout."""
    return f"x{kernels.pack_rows()}" if qtype & PACKED_FLAG and kernels is not None else ""


class QuantizedEmbedding(nn.Module):
    """Rows of raw blocks, de-quantized to float32 as they are looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.qtype = -1
        self.register_buffer("blocks", None, persistent=False)
        self.kernels = None
        self.in_arena = False  # as QuantizedLinear's

    def load_rows(self, first_row: int, tensor: QuantizedTensor) -> None:
        if first_row != 0 or tensor.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embedding of shape {tensor.shape}, expected {(self.num_embeddings, self.embedding_dim)}")
        self.blocks, self.qtype = tensor.blocks.contiguous(), tensor.qtype

    def finish_loading(self, arena=None) -> None:
        if self.blocks is None:
            raise ValueError("quantized embedding never loaded")
        if arena is not None and not self.in_arena:
            self.blocks, self.in_arena = _joined([self.blocks], arena), True

    def use_cpu_kernels(self, kernels) -> None:
        self.kernels = kernels
        if not self.qtype & PACKED_FLAG:
            self.blocks, self.qtype = pack_for_kernels(kernels, self.blocks, self.qtype, in_place=self.in_arena)

    def block_tensors(self) -> list[torch.Tensor]:
        return [self.blocks]

    def rebind_blocks(self, moved: dict[int, torch.Tensor]) -> None:
        self.blocks, self.in_arena = moved[self.blocks.data_ptr()], True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            raise RuntimeError("a QuantizedEmbedding runs only on cadenza's CPU kernels, and they are switched off")
        rows = self.kernels.quant_rows(self.blocks, self.qtype, ids.reshape(-1).long())
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        name = NATIVE_TYPES.get(ggml_type(self.qtype), ("pending",))[0] + _packed_suffix(self.qtype, self.kernels)
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={name}"


def move_into_huge_pages(model: nn.Module) -> int:
    """The blocks of every quantized module not yet in a weight arena (loaded straight into one,
    see `models/weight_arena.py`) into one huge-page buffer, after packing; returns the bytes
    moved. Run before anything keeps references to the old tensors (the fused layer kernels)."""
    from cadenza.models.weight_arena import move_into_arena

    modules = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and not m.in_arena]
    tensors = [t for m in modules for t in m.block_tensors()]
    if not tensors:
        return 0
    moved = move_into_arena(tensors)
    for module in modules:
        module.rebind_blocks(moved)
    return sum(t.numel() for t in moved.values())


def block_layouts(model: nn.Module, kernels) -> list[dict]:
    """Per GGML type of the model's quantized weights: how many tensors, whether they are packed
    (and the products that run them, `kernels.packed_path()`), and if not, why (what the load logs)."""
    counts: dict[tuple[int, bool], int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            types = [q for _, q in module.parts]
        elif isinstance(module, QuantizedEmbedding):
            types = [module.qtype]
        else:
            continue
        for qtype in types:
            key = (ggml_type(qtype), bool(qtype & PACKED_FLAG))
            counts[key] = counts.get(key, 0) + 1
    layouts = []
    for (qtype, packed), n in sorted(counts.items()):
        entry = {"type": NATIVE_TYPES[qtype][0], "tensors": n, "packed": packed}
        if packed:
            entry["path"] = kernels.packed_path()
        elif kernels is None:
            entry["reason"] = "the CPU kernels are off"
        elif qtype not in PACKABLE_TYPES:
            entry["reason"] = "no packed layout for this type"
        elif not kernels.quant_packs(qtype):
            entry["reason"] = f"this build ({kernels.packed_path()}) has no packed products for it"
        else:
            entry["reason"] = f"rows not a multiple of {kernels.pack_rows()}"
        layouts.append(entry)
    return layouts
