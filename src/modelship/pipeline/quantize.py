"""Weight-only 4-bit quantization with llm-compressor, written as compressed-tensors."""

from __future__ import annotations

from pathlib import Path

from modelship.pipeline.calibration import calibration_texts


def quantize_gptq(
    base_dir: Path,
    out_dir: Path,
    group_size: int = 64,
    num_samples: int = 64,
    max_seq_length: int = 512,
) -> None:
    """GPTQ W4A16 (symmetric, `group_size` columns per scale) of `base_dir` into `out_dir`.

    The group size must divide every linear layer's input width (128 does not divide the
    demo model's 576; 64 does). The output is a `pack-quantized` compressed-tensors
    checkpoint that our engine, transformers and vLLM load.
    """
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    texts = calibration_texts(num_samples)
    encoded = tokenizer(texts, truncation=True, max_length=max_seq_length)
    dataset = Dataset.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    )
    recipe = GPTQModifier(
        targets="Linear",
        ignore=["lm_head"],
        config_groups={
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                },
            }
        },
    )
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=max_seq_length,
        num_calibration_samples=num_samples,
    )
    model.save_pretrained(out_dir, save_compressed=True)
    tokenizer.save_pretrained(out_dir)
