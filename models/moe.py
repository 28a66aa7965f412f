"""A mixture-of-experts MLP: a float32 router picks each token's top-k experts, and each expert
that any token picked runs once, over all of its tokens.

Routing is transformers' (Qwen3-MoE, Mixtral, OLMoE): softmax over the router's logits in float32,
`torch.topk` (so ties break as there), optionally renormalised over the k picked. Each expert is the
decoder's own `MLP` (models/llama.py) of the experts' width, so a GGUF's quantized experts stay raw
blocks on the packed kernels, and a float checkpoint's run as bf16 or float32 linears, with nothing
MoE-specific in either. The router stays float32 at any model dtype: it is small (experts x hidden),
and llama.cpp keeps it float32 too, so rounding it would move tokens to other experts.

A token's weight scales the expert's hidden activations before the down projection (linear, so the
same sum to rounding), which lets a single token's product add straight into the residual stream;
where the down projection has a bias (gpt-oss), the weight scales its output, bias included, as
transformers does. gpt-oss's router has a bias and softmaxes only its top k logits.

Where the experts run: on the CPU, decode-sized steps through one kernel call for all the step's
experts (`fuse`), others expert by expert; on a GPU, two grouped GEMMs over every (token, expert)
pair (`use_grouped_gemm`); in host memory beside a GPU model (`keep_experts_on_host`); under tensor
parallelism, a share of every expert's width on each rank, summed once a layer (`reduce`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.models.config import SWIGLU_CLAMPED, ModelArchConfig
from cadenza.models.dual_linear import linear_add_
from cadenza.models.quantized_linear import QuantizedLinear

ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.bias")


def is_router_weight(name: str) -> bool:
    """Whether checkpoint tensor `name` (canonical) is a router's: loaders hand it over in float32
    and never quantize it."""
    return name.endswith(ROUTER_SUFFIXES)


class Router(nn.Linear):
    """The expert router's logits; its weight (and bias: gpt-oss) stays float32 whatever dtype the
    model is cast to."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias=bias)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
        if self.bias is not None and self.bias.dtype != torch.float32:
            self.bias = nn.Parameter(self.bias.float(), requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelArchConfig, mlp_factory) -> None:
        """`mlp_factory(intermediate_size)` builds one expert (the decoder's `MLP`)."""
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k, self.normalize = moe.num_experts, moe.top_k, moe.normalize_top_k
        self.softmax_after_top_k = moe.softmax_after_top_k
        self.gate = Router(cfg.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(mlp_factory(moe.intermediate_size) for _ in range(moe.num_experts))
        # The kernels' `MoEKernel` (kernels/cpu/moe.h) for steps of few tokens, or None.
        self.fused = None
        self.fused_max_rows = 0
        # The GPU's grouped GEMMs (kernels/triton/moe.py) and the experts' stacked weights, or None.
        self.grouped = None
        # Whether the experts live in host memory while the model runs on a GPU (`keep_experts_on_host`).
        self.on_host = False
        # Under tensor parallelism (parallel/tensor_parallel.py), each rank holds a share of every
        # expert's width: `reduce` sums the ranks' partial outputs (None: the whole mixture is here).
        self.reduce = None

    def fuse(self, kernels) -> None:
        """Run steps under the experts' GEMM threshold through the kernels' `MoEKernel`: one call
        for all of a step's experts. Needs every expert's projections quantized (`QuantizedLinear`,
        one block type each; biases, gpt-oss's, as float32); otherwise (or with `kernels` None)
        experts run one by one. Called once the blocks are where they stay (packed, in huge pages)."""
        self.fused, self.fused_max_rows = None, 0
        linears = [m for e in self.experts for m in (e.gate_up_proj, e.down_proj)]
        if kernels is None or not all(isinstance(m, QuantizedLinear) and m.kernels is not None and len(m.parts) == 1
                                      for m in linears):
            return
        ups, downs = linears[0::2], linears[1::2]
        biased = ups[0].bias is not None
        if any((m.bias is not None) != biased for m in linears):
            return
        mlp = self.experts[0]
        clamped = mlp.act == SWIGLU_CLAMPED
        if mlp.act not in ("silu", SWIGLU_CLAMPED):
            return
        self.fused = kernels.MoEKernel(
            [m.blocks0 for m in ups], [m.parts[0][1] for m in ups], [m.blocks0 for m in downs],
            [m.parts[0][1] for m in downs], self.gate.in_features,
            gate_up_bias=[m.bias_f32 for m in ups] if biased else None,
            down_bias=[m.bias_f32 for m in downs] if biased else None,
            swiglu_alpha=mlp.alpha if clamped else 0.0, swiglu_limit=mlp.limit if clamped else 0.0,
        )
        self.fused_max_rows = min(m.min_rows for m in linears) - 1

    def use_grouped_gemm(self, kernels=None) -> None:
        """Run every step as two grouped GEMMs over all of its (token, expert) pairs (one launch a
        projection, sync-free: CUDA-graph safe): `kernels` is kernels/triton/moe.py (by default
        imported here; the tests give it compiled for Triton's interpreter). The experts' float
        weights are stacked [experts, out, in] and each expert's linears become views of the
        stacks, so nothing is held twice."""
        if kernels is None:
            from cadenza.kernels.triton import moe as kernels
        ups = [e.gate_up_proj for e in self.experts]
        downs = [e.down_proj for e in self.experts]
        if not all(type(m) is nn.Linear for m in (*ups, *downs)):
            raise ValueError("grouped expert GEMMs need float expert weights (not quantized blocks)")

        def stack(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
            if getattr(linears[0], attr) is None:
                return None
            stacked = torch.stack([getattr(m, attr).detach() for m in linears])
            for i, m in enumerate(linears):
                setattr(m, attr, nn.Parameter(stacked[i], requires_grad=False))
            return stacked

        self.grouped = (kernels, stack(ups, "weight"), stack(ups, "bias"), stack(downs, "weight"), stack(downs, "bias"))

    def _grouped_forward(self, x: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor,
                         experts: torch.Tensor) -> torch.Tensor:
        kernels, up_w, up_b, down_w, down_b = self.grouped
        tokens, pairs = x.shape[0], x.shape[0] * self.top_k
        # Small tiles for decode-sized steps (few pairs an expert), larger ones for prefill.
        alignment = kernels.align_by_expert(experts, self.num_experts, 16 if pairs < 1024 else 64)
        gate_up = kernels.grouped_expert_matmul(x.contiguous(), up_w, alignment, pairs, self.top_k, bias=up_b)
        hidden = self.experts[0].activate(gate_up).contiguous()
        out = kernels.grouped_expert_matmul(hidden, down_w, alignment, pairs, 1, bias=down_b,
                                            pair_weights=weights.reshape(-1).float().contiguous())
        return residual.add_(out.view(tokens, self.top_k, -1).sum(dim=1).to(residual.dtype))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for tokens `x` [T, hidden]."""
        logits = self.gate(x)
        if self.softmax_after_top_k:  # gpt-oss: the same ranking, a softmax over the k picked only
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def keep_experts_on_host(self, kernels) -> None:
        """The experts stay in host memory and run on the CPU (with `kernels`, the CPU kernels,
        or None: PyTorch's ops) while the rest of the model runs on its device: llama.cpp's
        `--cpu-moe` (`model.moe_experts_on: cpu`). Each step sends its activations and the router's
        picks to the host (the router runs on the device) and the mixture's output back."""
        for module in self.experts.modules():
            if hasattr(module, "use_cpu_kernels"):
                module.use_cpu_kernels(kernels)
        if kernels is not None:
            from cadenza.models.quantized_linear import move_into_huge_pages

            move_into_huge_pages(self.experts)
        self.fuse(kernels)
        self.on_host = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + the mixture's output for `x`, the sum written into `residual`."""
        if self.reduce is not None:  # this rank's share of every expert, summed over the ranks
            return residual.add_(self.reduce(self._mixture(x, torch.zeros_like(residual))))
        return self._mixture(x, residual)

    def _mixture(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.on_host and (x.device.type != "cpu" or x.dtype != self._host_dtype()):
            host = x.detach().to("cpu", self._host_dtype())
            out = self._local(host, torch.zeros_like(host), weights.cpu(), experts.cpu())
            return residual.add_(out.to(residual.device, residual.dtype))
        return self._local(x, residual, weights, experts)

    def _host_dtype(self) -> torch.dtype:
        """What the host's experts take: float32 for quantized blocks, else their weights' dtype."""
        up = self.experts[0].gate_up_proj
        return torch.float32 if isinstance(up, QuantizedLinear) else up.weight.dtype

    def _local(self, x: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if self.grouped is not None:
            return self._grouped_forward(x, residual, weights, experts)
        if self.fused is not None and x.shape[0] <= self.fused_max_rows and x.dtype == torch.float32 and x.is_contiguous():
            return self.fused.add_(residual, x, experts, weights)
        if x.shape[0] == 1:
            for weight, expert in zip(weights[0].tolist(), experts[0].tolist()):
                mlp = self.experts[expert]
                if mlp.down_proj.bias is not None:  # the weight scales the bias too (gpt-oss)
                    residual.add_(mlp.down_proj(mlp.hidden(x)).to(residual.dtype), alpha=weight)
                else:
                    linear_add_(mlp.down_proj, residual, mlp.hidden(x).mul_(weight))
            return residual
        flat = experts.flatten()
        # The (token, slot) pairs grouped by expert, each group in token order.
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        scales = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            mlp = self.experts[expert]
            hidden = mlp.hidden(x.index_select(0, rows))
            scale = scales[start : start + count, None]
            if mlp.down_proj.bias is not None:  # the weight scales the bias too (gpt-oss)
                out = mlp.down_proj(hidden).float().mul_(scale)
            else:
                out = mlp.down_proj(hidden.mul_(scale.to(hidden.dtype)))
            residual.index_add_(0, rows, out.to(residual.dtype))
            start += count
        return residual
