"""The decoder every family runs on (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, the mixtures of
experts Qwen3-MoE, Mixtral, OLMoE and gpt-oss, Gemma 3, Phi-3/4, SmolLM3, Granite), over a paged KV cache. A
family is options of it (models/families.py, `ModelArchConfig`), never a copy.

The math mirrors transformers' reference modelling (fp32 RMSNorm, cos/sin cast to the activation
dtype), so logits agree to rounding; where cadenza's CPU kernels run (`use_cpu_kernels`), norms,
rotary, SiLU, bf16 products and residual adds are fused, with the same math in float32.
Tokens arrive flattened: a step is one [T] tensor of token ids with their positions, whatever mix
of prefills and decodes it holds.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.attention_backends.base import AttentionBackend, AttentionMetadata
from cadenza.models.config import SWIGLU_CLAMPED, ModelArchConfig
from cadenza.models.dual_linear import DualPrecisionLinear, linear_add_
from cadenza.models.errors import ModelLoadError
from cadenza.models.moe import SparseMoE
from cadenza.models.quantized_linear import QuantizedEmbedding, QuantizedLinear, QuantizedTensor, move_into_huge_pages
from cadenza.models.rotary import RotaryEmbedding, StepRotary

# Checkpoint tensors that carry nothing we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        """`offset`: Gemma stores its norm weights as w and multiplies by (offset + w) = (1 + w),
        in float32, before casting back."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.kernels = None
        self.weight_f32: torch.Tensor | None = None

    def use_cpu_kernels(self, kernels) -> None:
        self.kernels = kernels
        self.weight_f32 = None if kernels is None else (self.weight.detach().float() + self.offset).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.float32 and x.is_contiguous():
            return self.kernels.rms_norm(x, self.weight_f32, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def _add_scaled_(linear: nn.Module, residual: torch.Tensor, x: torch.Tensor, multiplier: float,
                 out_norm: nn.Module | None = None) -> torch.Tensor:
    """`residual += multiplier * out_norm(linear(x))` in place (Granite's residual multiplier,
    Gemma's norm after each block; fused into the product where there is neither)."""
    if out_norm is not None:
        return residual.add_(out_norm(linear(x)).to(residual.dtype), alpha=multiplier)
    if multiplier == 1.0:
        return linear_add_(linear, residual, x)
    return residual.add_(linear(x).to(residual.dtype), alpha=multiplier)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotates: bool = True) -> None:
        """`rotates`: whether this layer applies rotary embeddings (SmolLM3's NoPE layers do not)."""
        super().__init__()
        self.cfg = cfg
        self.rotates = rotates
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm == "full":  # over all heads at once (OLMoE)
            self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps, cfg.norm_offset)
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        # gpt-oss: each query head's sink logit, given to the backend in float32 (`_attend`).
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None

    def _attend(self, backend: AttentionBackend, q, k, v, kv_cache, meta) -> torch.Tensor:
        if self.sinks is None:
            return backend.forward(q, k, v, kv_cache, meta)
        return backend.forward(q, k, v, kv_cache, meta, sinks=self.sinks.float())

    def forward(self, x, residual, rotary: StepRotary, kv_cache, meta, backend: AttentionBackend,
                out_norm: nn.Module | None = None) -> torch.Tensor:
        """`residual` + out_norm(attention(x)), the sum written into `residual`."""
        out = self.attend(x, rotary, kv_cache, meta, backend)
        return _add_scaled_(self.o_proj, residual, out, self.cfg.residual_multiplier, out_norm)

    def attend(self, x, rotary: StepRotary, kv_cache, meta, backend: AttentionBackend) -> torch.Tensor:
        """The heads' outputs [T, q_size], before the output projection."""
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        if cfg.qk_norm == "full":
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
            if cfg.clip_qkv is not None:
                q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
            q = self._rotate(rotary, q.reshape(-1, cfg.num_heads, cfg.head_dim))
            k = self._rotate(rotary, k.reshape(-1, cfg.num_kv_heads, cfg.head_dim))
            out = self._attend(backend, q, k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim), kv_cache, meta)
            return out.reshape(-1, cfg.q_size)
        if cfg.clip_qkv is not None:
            qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        if cfg.qk_norm:
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, cfg.num_heads, cfg.head_dim))
            k = self.k_norm(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim))
            q, k = self._rotate(rotary, q), self._rotate(rotary, k)
        else:
            # q and k side by side in the fused projection: one rotation for both.
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = self._rotate(rotary, qk)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        out = self._attend(backend, q, k, v, kv_cache, meta)
        return out.reshape(-1, cfg.q_size)

    def _rotate(self, rotary: StepRotary, x: torch.Tensor) -> torch.Tensor:
        return rotary.rotate(x) if self.rotates else x


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, intermediate_size: int | None = None) -> None:
        """A gated MLP (SiLU, Gemma's tanh GELU, or gpt-oss's clamped SwiGLU) of `intermediate_size`
        (the config's by default; a mixture's experts are MLPs of their own width)."""
        super().__init__()
        self.intermediate = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
        self.residual_multiplier = cfg.residual_multiplier
        self.act = cfg.hidden_act
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.kernels = None
        self.layer_ops = None  # kernels/triton/layer_ops.py where the model runs them (use_layer_ops)

    def use_cpu_kernels(self, kernels) -> None:
        self.kernels = kernels

    def _bf16_gate_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """gate_up(x) in bfloat16 where both quantized projections run this step as bfloat16
        GEMMs (what the down projection would round the hidden state to anyway), else None."""
        up, down = self.gate_up_proj, self.down_proj
        if self.kernels is None or self.act != "silu":
            return None
        if not isinstance(up, QuantizedLinear) or not isinstance(down, QuantizedLinear):
            return None
        return up.bf16_product(x) if down.takes_bf16(x.shape[0]) else None

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): what the down projection multiplies (a new tensor)."""
        gate_up = self._bf16_gate_up(x)
        if gate_up is not None:  # a prefill through bfloat16 GEMMs: the hidden state stays bfloat16
            return self.kernels.silu_mul_bf16(gate_up)
        gate_up = self.gate_up_proj(x)
        if self.act == "silu" and self.kernels is not None and gate_up.dtype == torch.float32:
            return self.kernels.silu_mul(gate_up)
        if self.act == "silu" and self.layer_ops is not None and gate_up.stride(-1) == 1:
            return self.layer_ops.silu_mul(gate_up)
        return self.activate(gate_up)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of a fused gate_up [rows, 2I] product, gate first: [rows, I]."""
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if self.act == SWIGLU_CLAMPED:  # gpt-oss
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.act != "silu":  # Gemma's tanh-approximated GELU
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, residual: torch.Tensor, out_norm: nn.Module | None = None) -> torch.Tensor:
        """`residual` + out_norm(mlp(x)), the sum written into `residual`."""
        return _add_scaled_(self.down_proj, residual, self.hidden(x), self.residual_multiplier, out_norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index
        self.windowed = cfg.window(index) is not None and cfg.layer_windows is not None  # on the model's windowed backend
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg, cfg.rotates(index))
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, with two more
        # around the MLP.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if cfg.moe is not None and index in cfg.moe.layers:
            self.mlp = SparseMoE(cfg, lambda width: MLP(cfg, width))
        else:
            self.mlp = MLP(cfg)
        # The kernels' whole-layer path (kernels/cpu/decode_layer.h) for steps of few tokens, or None.
        self.fused = None
        self.fused_max_rows = 0

    def fuse(self, kernels, rotary: RotaryEmbedding) -> None:
        """Run steps under the kernels' row threshold through `DecoderLayerKernel`: two calls a
        layer around the attention backend. Needs bf16 projections (`DualPrecisionLinear`) or
        quantized ones of one block type each (`QuantizedLinear`), a dense MLP of SiLU or GELU (or
        a mixture, run apart), q/k norms per head or none, and no clipping; the family options
        inside a layer (NoPE, partial rotary, a residual multiplier, Gemma's norms around each
        block) are the kernel's own. `rotary`: this layer's (Gemma's local layers have their own).
        Otherwise (or with `kernels` None) the modules run one by one."""
        attn, mlp = self.self_attn, self.mlp
        if isinstance(mlp, SparseMoE):
            mlp.fuse(kernels)
        cfg = self.cfg
        # A mixture's layer fuses its attention half; its experts run apart (models/moe.py).
        dense = isinstance(mlp, MLP)
        activation = {"silu": 0, "gelu_pytorch_tanh": 1}.get(cfg.hidden_act) if dense else 0
        if kernels is None or cfg.qk_norm not in (None, False, "head") or cfg.clip_qkv is not None or activation is None:
            self.fused, self.fused_max_rows = None, 0
            return
        linears = (attn.qkv_proj, attn.o_proj, *((mlp.gate_up_proj, mlp.down_proj) if dense else ()))
        if not _fusable(attn.qkv_proj, parts=True) or not all(_fusable(m) for m in linears[1:]):
            self.fused, self.fused_max_rows = None, 0
            return
        weights = [_fused_weight(m) for m in linears] + [(None, -1)] * (0 if dense else 2)
        # llama-quantize's mixes store q/k and v in different types (Q4_K_M's Q6_K attn_v): parts.
        qkv = attn.qkv_proj
        more = qkv.block_tensors()[1:] if isinstance(qkv, QuantizedLinear) else []
        more_types = [qtype for _, qtype in qkv.parts[1:]] if more else []
        sandwich = cfg.sandwich_norms
        mlp_norm = self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm
        self.fused = kernels.DecoderLayerKernel(
            self.input_layernorm.weight_f32, weights[0][0], attn.qkv_proj.bias_f32,
            weights[1][0], attn.o_proj.bias_f32, mlp_norm.weight_f32,
            weights[2][0], mlp.gate_up_proj.bias_f32 if dense else None,
            weights[3][0], mlp.down_proj.bias_f32 if dense else None,
            rotary.cos_table, rotary.sin_table,
            self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.rms_norm_eps,
            *(qtype for _, qtype in weights),
            q_norm=attn.q_norm.weight_f32 if cfg.qk_norm else None,
            k_norm=attn.k_norm.weight_f32 if cfg.qk_norm else None,
            rotary_dims=cfg.rotated_dims if attn.rotates else 0,
            residual_scale=cfg.residual_multiplier,
            attn_out_norm=self.post_attention_layernorm.weight_f32 if sandwich else None,
            mlp_out_norm=self.post_feedforward_layernorm.weight_f32 if sandwich else None,
            activation=activation,
            qkv_more=more,
            qkv_more_types=more_types,
        )  # fmt: skip
        moe_rows = mlp.fused_max_rows if isinstance(mlp, SparseMoE) else 1 << 30
        self.fused_max_rows = min(min(m.min_rows for m in linears) - 1, moe_rows)

    def uses_fused(self, h: torch.Tensor, rotary: StepRotary) -> bool:
        """Whether a step of `h` runs through the fused kernel: few rows, and (rotary.on_kernels)
        float32 activations on the CPU, as the kernel needs."""
        return self.fused is not None and h.shape[0] <= self.fused_max_rows and rotary.on_kernels and h.is_contiguous()

    def forward_glued(self, h, pending, rotary: StepRotary, kv_cache, meta, backend, ops):
        """`forward` with the elementwise work on `ops` (kernels/triton/layer_ops.py): each residual
        add fused with the norm after it. `pending`: the previous layer's MLP output, not yet added
        to `h` (None: nothing pending). Returns (h, this layer's pending output). A layer the fused
        ops do not cover (Gemma's norms around each block, a residual multiplier) adds what is
        pending and runs its modules."""
        if self.cfg.sandwich_norms or self.cfg.residual_multiplier != 1.0:
            if pending is not None:
                h.add_(pending)
            return self.forward(h, rotary, kv_cache, meta, backend), None
        norm, post = self.input_layernorm, self.post_attention_layernorm
        x = ops.add_rms_norm_(pending, h, norm.weight, norm.eps, norm.offset)
        attn = self.self_attn
        out = attn.o_proj(attn.attend(x, rotary, kv_cache, meta, backend)).to(h.dtype)
        x = ops.add_rms_norm_(out, h, post.weight, post.eps, post.offset)
        if isinstance(self.mlp, MLP):
            return h, self.mlp.down_proj(self.mlp.hidden(x)).to(h.dtype)
        return self.mlp(x, h), None  # a mixture adds its experts' outputs in place

    def forward(self, h, rotary: StepRotary, kv_cache, meta, backend) -> torch.Tensor:
        """The next hidden states; `h` itself is updated in place (the residual stream)."""
        if self.uses_fused(h, rotary):
            q, k, v = self.fused.attention_input(h, rotary.positions)
            self.fused.finish_(h, self.self_attn._attend(backend, q, k, v, kv_cache, meta))
            return h if self.fused.has_mlp else self.mlp(self.post_attention_layernorm(h), h)
        if self.cfg.sandwich_norms:
            h = self.self_attn(self.input_layernorm(h), h, rotary, kv_cache, meta, backend, self.post_attention_layernorm)
            return self.mlp(self.pre_feedforward_layernorm(h), h, self.post_feedforward_layernorm)
        h = self.self_attn(self.input_layernorm(h), h, rotary, kv_cache, meta, backend)
        return self.mlp(self.post_attention_layernorm(h), h)


def _fusable(linear: nn.Module, parts: bool = False) -> bool:
    """Whether the layer kernel takes `linear`: bf16, or quantized blocks of one type (of one or
    more, in row ranges, where `parts`: the fused q/k/v of a mixed file)."""
    if isinstance(linear, QuantizedLinear):
        return linear.kernels is not None and (len(linear.parts) == 1 or parts)
    return isinstance(linear, DualPrecisionLinear) and linear.kernels is not None


def _fused_weight(linear: nn.Module) -> tuple[torch.Tensor, int]:
    """(weight, GGML type or -1 for bf16) as `DecoderLayerKernel` takes a projection."""
    if isinstance(linear, QuantizedLinear):
        return linear.blocks0, linear.parts[0][1]
    return linear.weight, -1


class LlamaForCausalLM(nn.Module):
    """Weights use Hugging Face names; `load_weights` fuses q/k/v and gate/up as they stream in."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # Uninitialised (the checkpoint fills it): a meta-device normal_ would import torch._dynamo,
        # 1.3 s of a 1.9 s load (and triton with it, where installed).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotated_dims, max_positions)
        # Gemma 3's local layers rotate with a base of their own; None: every layer uses `rotary`.
        self.local_rotary: RotaryEmbedding | None = None
        # The attention backend of the layers with a sliding window, where layers differ in theirs
        # (Gemma 3); given by whoever builds the backend (`use_windowed_backend`).
        self.windowed_backend: AttentionBackend | None = None
        # The dtype activations (and the KV cache) use; float32 where weights are bf16 but the CPU
        # has no native bf16 (see models/dual_linear.py). None: the weights' dtype.
        self.compute_dtype: torch.dtype | None = None
        self.kernels = None
        self.fused_stack: list | None = None  # every layer's DecoderLayerKernel, when all have one
        self.layer_ops = None  # kernels/triton/layer_ops.py, or None: torch's ops (use_layer_ops)

    def use_cpu_kernels(self, kernels) -> None:
        """Route norms, rotary, SiLU and bf16 matrix-vector products through cadenza's CPU kernels
        (`cadenza.kernels.cpu.loader`; None: PyTorch ops). Each falls back to PyTorch per call where its
        inputs do not fit (not float32, not contiguous)."""
        self.kernels = kernels
        for module in self.modules():
            if module is not self and hasattr(module, "use_cpu_kernels"):
                module.use_cpu_kernels(kernels)
        if kernels is not None:  # the blocks as the kernels read them, before the layer kernels hold them
            move_into_huge_pages(self)
        for layer in self.layers:
            local = layer.windowed and self.local_rotary is not None
            layer.fuse(kernels, self.local_rotary if local else self.rotary)
        fused = [layer.fused for layer in self.layers]
        # Every layer whole on the fused kernel: a decode step can run them all in one call (its
        # attention has one window and no sinks: layers that differ in theirs, or gpt-oss, cannot).
        stackable = self.cfg.layer_windows is None and not self.cfg.attention_sinks
        self.fused_stack = fused if stackable and fused and all(f is not None and f.has_mlp for f in fused) else None

    def use_layer_ops(self, ops) -> None:
        """Run the elementwise work between the products through `ops` (kernels/triton/layer_ops.py,
        on CUDA or under Triton's interpreter; None: torch's ops): each residual add fused with the
        norm after it, carried across layers (`DecoderLayer.forward_glued`), rotary in place from
        the tables, SiLU x up. About ten launches a Llama layer a decode step instead of 32."""
        self.layer_ops = ops
        for module in self.modules():
            if isinstance(module, MLP):
                module.layer_ops = ops

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        h = self.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier != 1.0:  # Granite's, in the embedding's dtype as transformers scales it
            h = h * self.cfg.embedding_multiplier
        if self.compute_dtype is not None:
            h = h.to(self.compute_dtype)
        rotary = StepRotary(self.rotary, positions, h.dtype, self.kernels, self.layer_ops)
        backend.begin_step(meta)
        if self._whole_stack(h, rotary) and backend.run_decode_stack(self.fused_stack, h, rotary.positions, kv_caches, meta):
            return self.norm(h)
        local, windowed = rotary, backend
        if self.cfg.layer_windows is not None:
            if self.windowed_backend is None:
                raise RuntimeError(f"{self.cfg.model_type} has layers with a sliding window of their own: "
                                   "give the model its windowed backend (use_windowed_backend)")
            windowed = self.windowed_backend
            windowed.begin_step(meta)
            if self.local_rotary is not None:
                local = StepRotary(self.local_rotary, positions, h.dtype, self.kernels, self.layer_ops)
        ops = self.layer_ops
        if ops is not None:
            pending = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                step_rotary, step_backend = (local, windowed) if layer.windowed else (rotary, backend)
                h, pending = layer.forward_glued(h, pending, step_rotary, kv_cache, meta, step_backend, ops)
            return ops.add_rms_norm_(pending, h, self.norm.weight, self.norm.eps, self.norm.offset)
        for layer, kv_cache in zip(self.layers, kv_caches):
            if layer.windowed:
                h = layer(h, local, kv_cache, meta, windowed)
            else:
                h = layer(h, rotary, kv_cache, meta, backend)
        return self.norm(h)

    def use_windowed_backend(self, backend: AttentionBackend) -> None:
        """The attention backend (built like the model's own, with `sliding_window` set) that the
        layers with a sliding window of their own attend through."""
        self.windowed_backend = backend

    def _whole_stack(self, h: torch.Tensor, rotary: StepRotary) -> bool:
        """Whether every layer would take its fused kernel for `h`."""
        return self.fused_stack is not None and all(layer.uses_fused(h, rotary) for layer in self.layers)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits in the head's dtype (bfloat16 on a bfloat16 model, float32 from the
        CPU's quantized heads): the one-pass sampler reads them so, and the sampling pipeline's torch
        path and log-probabilities up-cast them; a float32 copy here would be a write and a read of
        batch x vocabulary floats every step for nothing."""
        logits = self.lm_head(hidden)
        if self.cfg.logits_scaling != 1.0:  # Granite's, in the head's dtype as transformers divides
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    # --- loading -------------------------------------------------------------------------------

    def _fused_parts(self, expert: bool = False) -> dict[str, tuple[str, int, int]]:
        """(our fused module, row offset, rows) for each unfused checkpoint projection (of a
        mixture's expert: gate/up are the experts' width)."""
        cfg = self.cfg
        inter = cfg.moe.intermediate_size if expert else cfg.intermediate_size
        return {
            "q_proj": ("qkv_proj", 0, cfg.q_size),
            "k_proj": ("qkv_proj", cfg.q_size, cfg.kv_size),
            "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }

    def _our_name(self, hf_name: str) -> tuple[str, slice]:
        """Our parameter name for a checkpoint tensor, and the rows of it that tensor fills."""
        name = hf_name.removeprefix("model.")
        for part, (fused_part, offset, size) in self._fused_parts(".experts." in name).items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused_part}."), slice(offset, offset + size)
        return name, slice(None)

    def use_quantized_weights(self, hf_names: Iterable[str]) -> None:
        """Before `load_weights`: the linears (and embedding) whose checkpoint weights `hf_names`
        arrive as raw GGUF blocks (`QuantizedTensor`) become `QuantizedLinear` (`QuantizedEmbedding`);
        a tied LM head then multiplies the embedding's blocks. Parts of a fused projection must all
        be quantized or all not."""
        for hf_name in hf_names:
            module_name = self._our_name(hf_name)[0].removesuffix(".weight")
            parent_name, _, child = module_name.rpartition(".")
            parent = self.get_submodule(parent_name)
            module = getattr(parent, child)
            if isinstance(module, nn.Embedding):
                setattr(parent, child, QuantizedEmbedding(module.num_embeddings, module.embedding_dim))
            elif isinstance(module, nn.Linear):
                setattr(parent, child, QuantizedLinear(module.in_features, module.out_features, module.bias is not None))
        if self.cfg.tie_word_embeddings and isinstance(self.embed_tokens, QuantizedEmbedding):
            self.lm_head = QuantizedLinear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], source: str, arena=None) -> None:
        """Copy named HF-layout tensors in; every parameter must be filled exactly once. Raw GGUF
        blocks go to the modules `use_quantized_weights` made for them; with `arena` (a
        `WeightArena` sized for them), each module copies its blocks into it as soon as all its
        rows are in, so the tensors it was given (views of a file) are let go as the load goes."""
        cfg = self.cfg
        params = dict(self.named_parameters())
        quantized = {
            f"{name}.weight": module for name, module in self.named_modules()
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding))
            and not (name == "lm_head" and cfg.tie_word_embeddings)
        }  # fmt: skip
        fused = self._fused_parts()
        expected: dict[str, int] = {}
        for name, shape0 in [*((n, p.shape[0]) for n, p in params.items()), *((n, 0) for n in quantized)]:
            is_fused = any(f[0] in name for f in fused.values())
            expected[name] = (shape0 or quantized[name].out_features) if is_fused else 1
        filled: dict[str, int] = {}

        def finish(name: str) -> None:
            try:
                quantized[name].finish_loading(arena)
            except ValueError as exc:
                raise ModelLoadError(f"{source}: {name}: {exc}") from exc

        with torch.no_grad():
            for hf_name, tensor in weights:
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                name, rows = self._our_name(hf_name)
                if isinstance(tensor, QuantizedTensor):
                    module = quantized.get(name)
                    if module is None:
                        raise ModelLoadError(f"{source}: tensor {hf_name!r} arrived quantized, but {name} is not")
                    module.load_rows(rows.start or 0, tensor)
                    size = tensor.shape[0]
                else:
                    param = params.get(name)
                    if param is None:
                        raise ModelLoadError(f"{source}: unexpected tensor {hf_name!r} for {cfg.model_type}")
                    target = param[rows]
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    size = target.shape[0]
                # A fused module counts rows (its parts arrive apart, or whole: Phi-3's qkv_proj); others count tensors.
                filled[name] = filled.get(name, 0) + (size if expected.get(name, 1) != 1 or rows != slice(None) else 1)
                if name in quantized and filled[name] == expected[name]:
                    finish(name)  # all its rows are in (every module gets here, or `missing` says why)
        missing = [n for n, count in expected.items() if filled.get(n, 0) != count]
        if missing:
            raise ModelLoadError(f"{source}: missing tensors for {', '.join(sorted(missing)[:8])}")
        if cfg.tie_word_embeddings and isinstance(self.embed_tokens, QuantizedEmbedding):
            self.lm_head = QuantizedLinear.tied_to(self.embed_tokens)
