"""What this machine can do at best, measured in the same run, and the model's step times under it.

Decode at batch 1 reads every weight once per token: its floor is weight bytes / memory bandwidth.
Prefill and large-batch decode are matmuls: their floor is model FLOPs / matmul rate.
On the CPU the bandwidth is the rate of reading a large tensor (a sum); on a GPU it is a large
device-to-device copy's bytes read and written over its time, as GPU bandwidth is quoted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadenza.bench.common.device import best_seconds

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_MATMUL_SHAPE = (256, 2048, 2048)
CUDA_MATMUL_SHAPE = (8192, 8192, 8192)  # about 1 TFLOP: long enough to time, large enough for every SM


def memory_read_bandwidth(num_bytes: int = 512 << 20, *, kernels: object | None = None) -> float:
    """Bytes per second reading a tensor far larger than the caches, best of several reads: every
    thread streaming its part with the CPU kernels' `stream_read` (no arithmetic to speak of: the
    rate the decode kernels can reach), or a torch sum where the kernels are unavailable."""
    if kernels is None:
        from cadenza.kernels.cpu import loader

        kernels = loader.configure("auto")
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    read = (lambda: kernels.stream_read(x)) if kernels is not None else (lambda: x.sum())
    seconds = best_seconds(read, min_reps=5)
    return num_bytes / seconds


def device_copy_bandwidth(num_bytes: int, device: torch.device) -> float:
    """Bytes per second through memory copying a `num_bytes` tensor into another on `device`:
    `num_bytes` read plus `num_bytes` written per copy (best of several)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), min_reps=5, device=device)
    return 2 * src.numel() * 4 / seconds


def matmul_rate(dtype: torch.dtype, m: int = 256, k: int = 2048, n: int = 2048,
                device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of `F.linear` ([m, k] x [n, k]^T), the op every projection in the model runs."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = torch.randn(n, k, generator=gen, device=device).to(dtype)
    with torch.inference_mode():
        seconds = best_seconds(lambda: F.linear(x, w), device=device)
    return 2 * m * k * n / seconds


@dataclass(frozen=True, slots=True)
class Ceilings:
    memory_bandwidth: float  # bytes/s
    matmul_bf16: float  # FLOP/s
    matmul_fp32: float  # FLOP/s
    matmul_shape: tuple[int, int, int]
    memory_measure: str = "memory read"  # or "device copy": bytes read and written

    def matmul(self, dtype: torch.dtype) -> float:
        """The best rate at which weights of `dtype` can be multiplied here.

        bf16 (or fp16) weights may also be multiplied through their exact float32 upcast, which is
        several times faster on CPUs without native bf16 (AVX2), so the faster of the two counts.
        """
        if dtype == torch.float32:
            return self.matmul_fp32
        return max(self.matmul_bf16, self.matmul_fp32)

    def as_dict(self) -> dict:
        return {
            "memory_GBps": round(self.memory_bandwidth / 1e9, 2),
            "memory_measure": self.memory_measure,
            "matmul_bf16_GFLOPps": round(self.matmul_bf16 / 1e9, 1),
            "matmul_fp32_GFLOPps": round(self.matmul_fp32 / 1e9, 1),
            "matmul_shape_mkn": list(self.matmul_shape),
        }


def measure_ceilings(read_bytes: int = 512 << 20, device: torch.device = torch.device("cpu"),
                     matmul_shape: tuple[int, int, int] | None = None) -> Ceilings:
    """The memory bandwidth (on the CPU the read rate of a `read_bytes` tensor; on a GPU a copy of
    one) and the bf16 and fp32 matmul rates at `matmul_shape` (by default the device's)."""
    m, k, n = matmul_shape or (CUDA_MATMUL_SHAPE if device.type == "cuda" else CPU_MATMUL_SHAPE)
    if device.type == "cuda":
        bandwidth, measure = device_copy_bandwidth(read_bytes, device), "device copy"
    else:
        bandwidth, measure = memory_read_bandwidth(read_bytes), "memory read"
    ceilings = Ceilings(
        memory_bandwidth=bandwidth,
        matmul_bf16=matmul_rate(torch.bfloat16, m, k, n, device),
        matmul_fp32=matmul_rate(torch.float32, m, k, n, device),
        matmul_shape=(m, k, n),
        memory_measure=measure,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the gigabytes the measurements took go back to the engines
    return ceilings


def quantized_block_bytes(model: torch.nn.Module, experts: bool = False) -> int:
    """Bytes of the GGUF blocks of every quantized linear outside a mixture's experts (the LM
    head included; a tied head's blocks once), or with `experts` of the experts' only; 0 where
    the model keeps none."""
    from cadenza.models.moe import SparseMoE
    from cadenza.models.quantized_linear import QuantizedLinear

    expert_modules = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.experts.modules()}
    seen = {b.data_ptr(): b.numel() for m in model.modules()
            if isinstance(m, QuantizedLinear) and (id(m) in expert_modules) == experts for b in m.block_tensors()}
    return sum(seen.values())


def expected_expert_share(num_experts: int, top_k: int, tokens: int) -> float:
    """The share of a mixture's experts a step of `tokens` tokens reads, routing uniform and
    independent per token: 1 - (1 - k/E)^tokens (top_k/E for one token)."""
    return 1 - (1 - top_k / num_experts) ** tokens


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Bytes and FLOPs of one model; counts the projections and the attention. A mixture of
    experts' layers count the experts a token uses (FLOPs) and the experts a step reads (bytes:
    `step_weight_bytes`, expected under uniform routing)."""

    num_layers: int
    body_params: int  # every layer's projections a token multiplies (a mixture's: its top k experts)
    head_params: int  # lm_head (read even when tied to the embedding)
    attn_width: int  # num_heads * head_dim
    kv_bytes_per_token: int  # keys and values of all layers
    weight_bytes: int  # what a decode step of one token reads of the projections and the LM head
    expert_bytes: int = 0  # every expert of every mixture
    num_experts: int = 0
    top_k: int = 0

    @classmethod
    def from_arch(cls, arch, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                  model: torch.nn.Module | None = None) -> "ModelCost":
        """`dtype`: the weights' (the smallest copy a decode step reads); `kv_dtype`: the KV cache's.
        With `model`, its projections' stored bytes (GGUF blocks as kept) replace `dtype`'s count."""
        h, inter, moe = arch.hidden_size, arch.intermediate_size, arch.moe
        attention = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
        sparse = 0 if moe is None else len(moe.layers)
        dense_params = attention * arch.num_layers + 3 * h * inter * (arch.num_layers - sparse)
        expert_params = 0 if moe is None else sparse * moe.num_experts * 3 * h * moe.intermediate_size
        router_params = 0 if moe is None else sparse * moe.num_experts * h
        size = torch.empty((), dtype=dtype).element_size()
        kv_size = torch.empty((), dtype=kv_dtype or dtype).element_size()
        share = 0.0 if moe is None else moe.top_k / moe.num_experts
        if model is not None and quantized_block_bytes(model):
            dense_bytes = quantized_block_bytes(model) + 4 * router_params  # routers stay float32
            expert_bytes = quantized_block_bytes(model, experts=True) if moe is not None else 0
        else:
            dense_bytes = (dense_params + h * arch.vocab_size) * size + 4 * router_params
            expert_bytes = expert_params * size
        return cls(
            num_layers=arch.num_layers,
            body_params=dense_params + router_params + round(expert_params * share),
            head_params=h * arch.vocab_size,
            attn_width=arch.num_heads * arch.head_dim,
            kv_bytes_per_token=arch.num_layers * 2 * arch.kv_size * kv_size,
            weight_bytes=dense_bytes + round(expert_bytes * share),
            expert_bytes=expert_bytes,
            num_experts=0 if moe is None else moe.num_experts,
            top_k=0 if moe is None else moe.top_k,
        )

    def step_weight_bytes(self, batch: int) -> int:
        """Weight bytes a decode step of `batch` tokens reads: every dense weight once, and the
        experts the step's tokens are expected to pick."""
        if not self.expert_bytes:
            return self.weight_bytes
        one = self.expert_bytes * self.top_k / self.num_experts
        return round(self.weight_bytes - one + self.expert_bytes * expected_expert_share(self.num_experts, self.top_k, batch))

    def decode_flops(self, context: int) -> float:
        """One decode token attending to `context` keys, logits included."""
        return 2 * (self.body_params + self.head_params) + 4 * self.num_layers * self.attn_width * context

    def prefill_flops(self, length: int) -> float:
        """A prompt of `length` tokens (causal attention) and the logits of its last token."""
        attention = 4 * self.num_layers * self.attn_width * length * (length + 1) / 2
        return 2 * self.body_params * length + 2 * self.head_params + attention

    def decode_step_seconds(self, ceilings: Ceilings, dtype: torch.dtype, batch: int, context: int) -> float:
        """The roofline: reading weights and each sequence's keys, or the matmuls, whichever is slower."""
        read = (self.step_weight_bytes(batch) + batch * context * self.kv_bytes_per_token) / ceilings.memory_bandwidth
        compute = batch * self.decode_flops(context) / ceilings.matmul(dtype)
        return max(read, compute)

    def prefill_seconds(self, ceilings: Ceilings, dtype: torch.dtype, length: int) -> float:
        compute = self.prefill_flops(length) / ceilings.matmul(dtype)
        return max(compute, self.step_weight_bytes(length) / ceilings.memory_bandwidth)

    def as_dict(self) -> dict:
        return {
            "params_body": self.body_params,
            "params_lm_head": self.head_params,
            "weight_MB": round(self.weight_bytes / 1e6, 1),
            "expert_MB": round(self.expert_bytes / 1e6, 1),
            "decode_MFLOP_per_token": round(self.decode_flops(0) / 1e6, 1),
        }
