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


def make_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Llama with GQA and a trained tokenizer, saved as safetensors in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
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
