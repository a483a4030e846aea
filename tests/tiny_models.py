"""Tiny random-weight models made on the fly (no hub, a second to build)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Models are served from files on shared storage; every artifact has a manifest.",
    "Paged attention reads keys and values through a block table.",
    "Continuous batching schedules requests at iteration granularity.",
    "Héllo wörld, naïve café, 東京, emoji 🚀 and numbers 0123456789.",
] * 20


def make_tokenizer(folder: Path, vocab_size: int = 320):
    """Train a byte-level BPE tokenizer on a small corpus and save it as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(folder)
    return wrapped


def tiny_settings(tokenizer, **overrides) -> dict:
    """The config every tiny model shares: 2 layers of width 64 (MLP 96), 4 attention heads
    over 2 KV heads, 256 positions, untied embeddings, `tokenizer`'s vocabulary and special
    ids; `overrides` (a family's own fields, a test's shape) replace or add to them."""
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return settings | overrides


def make_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Llama with GQA and a trained tokenizer, saved as safetensors in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    settings = tiny_settings(tokenizer, intermediate_size=128, max_position_embeddings=512)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_tiny_lora(
    base: Path, folder: Path, rank: int, targets: list[str], seed: int = 0, **overrides
) -> Path:
    """A PEFT LoRA adapter of the tiny Llama at `base` with random A *and* B (PEFT's default
    B is zero: the adapter would change nothing), saved as PEFT writes it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **overrides
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # large enough to move greedy tokens of a random model
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(folder)
    return folder


def save_tiny_moe(kind: str, folder: Path, **overrides) -> Path:
    """A 2-layer random MoE model of `kind` with a trained tokenizer, saved as safetensors.

    Norms and biases are randomized so they are really exercised, and the router weights
    scaled up: with transformers' 0.02-std init every expert is almost equally likely and
    the top-k would hang on rounding.
    """
    import torch
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 6}),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM, {"num_experts": 6}),
        "qwen2_moe": (
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            {"num_experts": 6, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80},
        ),
        "qwen3_moe": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            {"num_experts": 6, "moe_intermediate_size": 48, "head_dim": 32},
        ),
    }
    config_cls, model_cls, specific = classes[kind]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    settings = tiny_settings(tokenizer, num_experts_per_tok=2, **specific) | overrides
    torch.manual_seed(0)
    model = model_cls(config_cls(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):  # the router
                param.copy_(torch.randn_like(param) * 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_gemma2(folder: Path, kind: str = "gemma2", **overrides) -> Path:
    """A 2-layer random Gemma 2 (layer 0 sees the last 8 positions, layer 1 all of them)
    with a trained tokenizer.

    Weights are scaled up so attention scores and logits reach the soft caps (transformers'
    0.02-std init leaves them far below any cap), and norms randomized around their zero
    offset.
    """
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    config_cls, model_cls = (Gemma2Config, Gemma2ForCausalLM)
    if kind == "gemma3":
        config_cls, model_cls = (Gemma3TextConfig, Gemma3ForCausalLM)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    settings = tiny_settings(
        tokenizer,
        tie_word_embeddings=True,  # Gemma's own default
        head_dim=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=0.5,
        sliding_window=8,
    )
    if kind == "gemma3":
        settings.update(GEMMA3)
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.1)
            elif "q_proj" in name or "k_proj" in name:
                param.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# Gemma 3 text: two sliding layers (local RoPE base 10^4) then a global one (base 10^6,
# linear scaling 2); q/k norms; no soft-caps.
GEMMA3 = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
)
