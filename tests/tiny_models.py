"""Tiny random Hugging Face checkpoints (config.json, safetensors, tokenizer) built with transformers."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching keeps the accelerator busy. 0123456789",
    "héllo wörld, ça va? 你好世界 🙂",
]

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=2,
)

# name -> (transformers config class name, extra config)
ARCHITECTURES = {
    "llama3": ("LlamaConfig", dict(
        rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "llama2_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4)),
    "smollm_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1, rope_theta=100000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=24, rope_theta=1000000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    # Mixtures of experts: 8 experts, 2 a token (Qwen3-MoE: renormalised, as Qwen3-30B-A3B; its
    # second layer dense through mlp_only_layers), the experts' width apart from the dense one.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        mlp_only_layers=[1],
    )),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=8.0)),
    # Phi-4-mini's partial rotary (3/4 of each head) and LongRoPE factors (one per rotated pair,
    # with an attention factor), its q/k/v and gate/up fused in the checkpoint; tied embeddings.
    # Served within its original context: the short factors (test_families.py serves it longer).
    "phi3": ("Phi3Config", dict(
        partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=None, max_position_embeddings=512,
        original_max_position_embeddings=512,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0], "attention_factor": 1.2},
    )),
    # Gemma 3: local layers (a window of 8 tokens, their own rotary base) and a global one, norms
    # around each block, GELU, scaled embeddings; 3 layers, the second global.
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16,
        tie_word_embeddings=True, pad_token_id=None,
    )),
    # Its second layer NoPE (no rotary), as every fourth of SmolLM3-3B's is.
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2, rope_theta=5000000.0, pad_token_id=None)),
    # Granite 3's multipliers, of Granite-3.3-2B's sizes.
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                                      logits_scaling=8.0)),
    # gpt-oss: sinks, sliding (8 tokens) and full layers in turn, YaRN, a biased router softmaxing its
    # top 2 of 8 biased experts, whose SwiGLU clamps at 2 (7 in gpt-oss-20b: a tiny model's
    # activations would never reach it). Its zero-initialised biases are made random (`_randomize`).
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_limit=2.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )),
}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def _randomize_zero_biases(model) -> None:
    """Biases transformers initialises to zero (gpt-oss's router and experts) made random, so a
    test sees whether they are applied."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and not param.any():
                param.normal_(0.0, 0.2)


def build_tiny_model(
    directory: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **config_overrides
) -> Path:
    """Save a random `arch` model with the tiny tokenizer into `directory` and return it."""
    import torch
    import transformers

    config_cls_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls_name)(**{**_COMMON, **extra, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_zero_biases(model)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    build_tokenizer().save_pretrained(directory)
    return directory
