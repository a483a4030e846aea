"""`gptq` and `awq` variants: W4A16 with llm-compressor, saved as compressed-tensors.

Both calibrate on the local corpus (`pipeline.calibration`), keep `lm_head` unquantized,
and write `pack-quantized` checkpoints (int4 values packed eight to an int32, a scale per
group of `group_size` input columns, and for AWQ a zero point) that our engine,
transformers and vLLM load. The group size must divide every layer's input width.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from modelship.pipeline.calibration import calibration_texts
from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize.recipe import Recipe, Scheme
from modelship.pipeline.optimize.weights import cast_floating_in_place, copy_tokenizer_files

# Kept in full precision besides the head: a mixture-of-experts model's router (`<block>.gate`
# in Mixtral, OLMoE, Qwen2/3-MoE) and Qwen2-MoE's shared-expert gate. A router's top-k flips
# on small errors, and the engine reads both as plain weights (`model.moe`). Dense models
# have no module of these names. Experts themselves are quantized one by one: `oneshot`
# splits transformers' stacked experts into a Linear per expert projection (its
# post-load linearization; `load_quantizable_moe` would do it while loading, but its
# transformers patching imports every model module, torchvision-only ones included).
_IGNORE = ["lm_head", r"re:.*\.gate$", r"re:.*\.shared_expert_gate$"]
# AWQ folds a scale into a norm and its inverse into the layers the norm feeds: all of them,
# or those left out see a rescaled input. llm-compressor 0.14 maps Qwen2/3-MoE's
# post-attention norm to the router and the experts together, but has no mappings for OLMoE
# or Mixtral: its default ones would scale the experts and not the router, which would then
# route on the rescaled hidden state. Once their experts are linearized both have
# Qwen3-MoE's layout (`mlp.gate`, `mlp.experts.<e>.{gate,up,down}_proj`).
_AWQ_MAPPINGS_OF = {"OlmoeForCausalLM": "Qwen3MoeForCausalLM",
                    "MixtralForCausalLM": "Qwen3MoeForCausalLM"}  # fmt: skip


def _weights_scheme(recipe: Recipe) -> dict[str, Any]:
    return {
        "num_bits": recipe.bits,
        "type": "int",
        "symmetric": recipe.symmetric,
        "strategy": "group",
        "group_size": recipe.group_size,
    }


def _check_group_size(model, group_size: int) -> None:
    import torch

    for name, module in model.named_modules():
        is_target = isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
        if is_target and module.in_features % group_size:
            raise PipelineError(
                f"group size {group_size} does not divide {name}'s input width "
                f"{module.in_features}; choose a divisor (e.g. 64 or 32)"
            )


def _awq_mappings(model) -> list | None:
    """This family's AWQ mappings where llm-compressor's would be wrong; None: its own."""
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY

    like = _AWQ_MAPPINGS_OF.get(type(model).__name__)
    return None if like is None else AWQ_MAPPING_REGISTRY[like]


@contextmanager
def _cpu_safe_pinning():
    """Make llm-compressor's AWQ run on a machine without an accelerator.

    llm-compressor 0.14's AWQ pins its cached activations before the grid search
    (`IntermediatesCache.pin_memory`) to speed up host-to-device copies; pinning needs an
    accelerator and fails on CPU with "Cannot access accelerator device". On CPU there is
    no copy to speed up, so pinning is skipped there and nothing else changes.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    with mock.patch.object(IntermediatesCache, "pin_memory", lambda self, *a, **k: None):
        yield


@contextmanager
def _deterministic():
    """Same inputs, same bytes. Two runs of GPTQ or AWQ on the tiny model with two torch
    threads gave different weights about one time in two (the statistics' multi-threaded
    reductions add in an order that varies with the threads' timing); with one thread,
    every run gave the same bytes. So the calibration runs on one thread (the optimize
    stage makes variants in parallel processes, which is where the cores go), every
    generator is seeded, and calibration samples are batched in a fixed order."""
    import random

    import numpy as np
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(recipe: Recipe, base_dir: Path, out_dir: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    _check_group_size(model, recipe.group_size)
    texts = calibration_texts(recipe.num_calibration_samples)
    encoded = tokenizer(texts, truncation=True, max_length=recipe.max_seq_length)
    dataset = Dataset.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    )
    groups = {"group_0": {"targets": ["Linear"], "weights": _weights_scheme(recipe)}}
    if recipe.scheme == "gptq":
        modifiers = [GPTQModifier(targets="Linear", ignore=_IGNORE, config_groups=groups)]
        pinning = nullcontext()
    else:
        modifiers = [
            AWQModifier(n_grid=recipe.options.get("n_grid", 20), mappings=_awq_mappings(model)),
            QuantizationModifier(targets="Linear", ignore=_IGNORE, config_groups=groups),
        ]
        pinning = _cpu_safe_pinning()
    with pinning, _deterministic():
        oneshot(
            model=model,
            tokenizer=tokenizer,
            dataset=dataset,
            recipe=modifiers,
            max_seq_length=recipe.max_seq_length,
            num_calibration_samples=recipe.num_calibration_samples,
            batch_size=recipe.options.get("batch_size", 8),
            # llm-compressor shuffles with an unseeded sampler by default: batches (and
            # what truncation cuts from them) would change from run to run
            shuffle_calibration_samples=False,
        )
    model.save_pretrained(out_dir, save_compressed=True)
    tokenizer.save_pretrained(out_dir)
    copy_tokenizer_files(base_dir, out_dir)
    (out_dir / "recipe.yaml").unlink(missing_ok=True)  # ours is in the manifest
    cast_floating_in_place(out_dir, recipe.dtype)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized"}


GPTQ = Scheme(
    name="gptq",
    description="GPTQ W4A16, symmetric, group-wise scales",
    default_recipe=Recipe(
        scheme="gptq",
        bits=4,
        group_size=64,
        symmetric=True,
        # 32 x 512 tokens: ~16k calibration tokens, enough for GPTQ's Hessians at
        # this size and about half the time of 64 samples on 2 CPU cores.
        num_calibration_samples=32,
        max_seq_length=512,
        options={"batch_size": 8},
    ),
    run=_run,
)
AWQ = Scheme(
    name="awq",
    description="AWQ W4A16, asymmetric (zero points), group-wise scales",
    default_recipe=Recipe(
        scheme="awq",
        bits=4,
        group_size=64,
        symmetric=False,
        # AWQ's grid search runs the calibration set through every layer n_grid times;
        # 16 x 256 tokens and 10 grid points keep it to a few CPU minutes.
        num_calibration_samples=16,
        max_seq_length=256,
        options={"batch_size": 8, "n_grid": 10},
    ),
    run=_run,
)
