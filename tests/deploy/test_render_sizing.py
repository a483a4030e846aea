"""`deploy render` sizes the engine pods from the model's config.json: memory from the
weights and the KV cache, GPUs from what fits one GPU. Real-shaped configs (Llama-3-8B,
Qwen3-30B-A3B, Gemma-2-9B) are written without weights: nothing is loaded to size them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from k8s_tools import config_for, one

from modelship.deploy.render import RenderError, render
from modelship.deploy.sizing import count_parameters, kv_bytes_per_sequence
from modelship.model.config import ModelConfig

GiB = 1024**3
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, max_position_embeddings=8192)  # fmt: skip
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, max_position_embeddings=8192)  # fmt: skip
GEMMA2_9B = dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336,
                 num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, vocab_size=256000, sliding_window=4096,
                 max_position_embeddings=8192)  # fmt: skip
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM"}  # fmt: skip


def write_config(folder: Path, shape: dict[str, Any]) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.for_model(**shape, tie_word_embeddings=shape["model_type"] == "gemma2")
    config.architectures = [ARCHITECTURES[shape["model_type"]]]
    config.save_pretrained(folder)
    return folder


def engine_pod(folder: Path, variants: list[str], gpu_memory: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"source": str(folder), "optimize": {"variants": variants}}
    config = config_for("deployment", "hpa", "gpu" if gpu_memory else "cpu", **extra)
    if gpu_memory:
        data = config.model_dump(mode="json")
        data["deploy"]["serving"]["gpu"]["memory"] = gpu_memory
        config = type(config).from_dict(data)
    objects = render(config).objects
    name = next(o["metadata"]["name"] for o in objects if o["kind"] == "Deployment" and
                o["metadata"]["name"].endswith("-engine"))  # fmt: skip
    return one(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def memory_bytes(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity[:-2]) * 1024**2


@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN3_30B_A3B, GEMMA2_9B],
                         ids=["llama", "qwen3_moe", "gemma2"])  # fmt: skip
def test_parameters_counted_from_the_config_equal_transformers(shape, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = write_config(tmp_path, shape)
    with torch.device("meta"):  # shapes only: no memory, a second
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    expected = sum(p.numel() for p in model.parameters())
    counted = count_parameters(ModelConfig.from_dir(folder)).total
    assert abs(counted - expected) / expected < 1e-3  # all but some norm vectors


def test_dense_fp16_takes_two_16gib_gpus_where_int4_takes_one(tmp_path: Path) -> None:
    folder = write_config(tmp_path, LLAMA_8B)  # 8.0B parameters: ~15 GiB in fp16
    fp16 = engine_pod(folder, ["fp16", "gptq"], gpu_memory="16Gi")
    assert fp16["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert fp16["args"][fp16["args"].index("--tensor-parallel-size") + 1] == "2"
    assert "--expert-parallel" not in fp16["args"]  # dense: its layers split by heads
    # host memory holds the weights while they load, plus the runtime
    assert memory_bytes(fp16["resources"]["requests"]["memory"]) > 15 * GiB
    int4 = engine_pod(folder, ["gptq"], gpu_memory="16Gi")  # ~4.4 GiB
    assert int4["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert (
        "--tensor-parallel-size" not in int4["args"]
        or int4["args"][int4["args"].index("--tensor-parallel-size") + 1] == "1"
    )
    assert 5 * GiB < memory_bytes(int4["resources"]["requests"]["memory"]) < 7 * GiB


def test_moe_is_sized_by_all_its_experts_not_the_active_ones(tmp_path: Path) -> None:
    """Qwen3-30B-A3B activates 3B parameters a token but holds 30.5B: 57 GiB in fp16 fits
    one 80 GiB GPU and needs two of 40 GiB."""
    folder = write_config(tmp_path, QWEN3_30B_A3B)
    big = engine_pod(folder, ["fp16"], gpu_memory="80Gi")
    assert big["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--expert-parallel" not in big["args"]
    small = engine_pod(folder, ["fp16"], gpu_memory="40Gi")
    assert small["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # the engine refuses to split a mixture of experts over ranks unless it shards them
    assert "--expert-parallel" in small["args"]
    assert memory_bytes(small["resources"]["requests"]["memory"]) > 56 * GiB
    limit = memory_bytes(small["resources"]["limits"]["memory"])
    assert limit >= 1.25 * memory_bytes(small["resources"]["requests"]["memory"]) - 2**20


def test_cpu_pod_memory_holds_weights_and_kv_cache(tmp_path: Path) -> None:
    folder = write_config(tmp_path, QWEN3_30B_A3B)
    container = engine_pod(folder, ["gptq"], gpu_memory=None)
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    # int4 weights ~16 GiB + one 8192-token sequence of fp32 KV cache (1.5 GiB, above the
    # 512 MiB budget) + 1 GiB runtime
    request = memory_bytes(container["resources"]["requests"]["memory"])
    assert 16 * GiB < request < 19 * GiB


def test_sliding_window_layers_hold_only_their_window(tmp_path: Path) -> None:
    model = ModelConfig.from_dir(write_config(tmp_path, GEMMA2_9B))  # every other layer local
    per_token = 2 * 8 * 256 * 2  # keys and values, 8 kv heads of 256, 16-bit
    assert kv_bytes_per_sequence(model, 8192, "bfloat16") == 21 * (8192 + 4096) * per_token
    assert kv_bytes_per_sequence(model, 1000, "bfloat16") == 42 * 1000 * per_token


def test_a_small_model_keeps_the_configured_resources(tiny_llama_dir: Path) -> None:
    container = engine_pod(tiny_llama_dir, ["fp16"], gpu_memory=None)
    assert container["resources"]["requests"]["memory"] == "4Gi"
    assert container["resources"]["limits"]["memory"] == "8Gi"


def test_a_model_no_8_gpus_hold_is_refused_naming_the_field(tmp_path: Path) -> None:
    folder = write_config(tmp_path, QWEN3_30B_A3B)
    with pytest.raises(RenderError, match=r"deploy.serving.gpu.memory: 4Gi per GPU"):
        engine_pod(folder, ["fp16"], gpu_memory="4Gi")
