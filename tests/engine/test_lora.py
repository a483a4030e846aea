"""LoRA adapters through the engine: equal to transformers + PEFT merged weights (fp32),
mixed-adapter batches equal each request alone, prefix cache namespaced by adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.tiny_models import make_tiny_lora

from modelship.engine import SamplingParams
from modelship.engine.config import EngineConfig
from modelship.engine.errors import EngineOverloadedError
from modelship.engine.llm_engine import LLMEngine
from modelship.model.lora import LoRAError

PROMPT = list(range(3, 23))  # 20 tokens: 4 full blocks of 4 can be hit
MAX_TOKENS = 6
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "all8": make_tiny_lora(tiny_llama_dir, root / "all8", 8, ALL, seed=1, use_rslora=True),
        "attn4": make_tiny_lora(tiny_llama_dir, root / "attn4", 4, ["q_proj", "v_proj"], seed=2),
        "mlp4": make_tiny_lora(tiny_llama_dir, root / "mlp4", 4, ["up_proj", "down_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, adapters: dict[str, Path]) -> LLMEngine:
    config = EngineConfig(
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        loras=tuple((name, str(path)) for name, path in adapters.items()),
    )
    return LLMEngine(tiny_llama_dir, config)


def run(engine: LLMEngine, requests: dict[str, str | None]) -> dict[str, list[int]]:
    """Run requests (id -> adapter) together to the end; greedy tokens per request."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for request_id, lora in requests.items():
        engine.add_request(request_id, PROMPT, params, lora=lora)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return tokens


def peft_merged_greedy(base: Path, adapter: Path) -> list[int]:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = merged.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("name", ["all8", "attn4", "mlp4"])
def test_adapter_output_equals_peft_merged_weights(
    engine: LLMEngine, tiny_llama_dir: Path, adapters: dict[str, Path], name: str
) -> None:
    engine.block_manager.reset_prefix_cache()
    expected = peft_merged_greedy(tiny_llama_dir, adapters[name])
    got = run(engine, {f"solo-{name}": name, f"base-{name}": None})
    assert got[f"solo-{name}"] == expected
    assert got[f"base-{name}"] != expected  # the adapter changes the output


def test_mixed_adapter_batch_equals_each_alone(engine: LLMEngine) -> None:
    engine.block_manager.reset_prefix_cache()
    loras = {"m-base": None, "m-all8": "all8", "m-attn4": "attn4", "m-mlp4": "mlp4"}
    alone = {}
    for request_id, lora in loras.items():
        engine.block_manager.reset_prefix_cache()
        alone.update(run(engine, {request_id: lora}))
    engine.block_manager.reset_prefix_cache()
    together = run(engine, {f"t{request_id}": lora for request_id, lora in loras.items()})
    assert {k[1:]: v for k, v in together.items()} == alone
    assert len({tuple(v) for v in alone.values()}) == 4  # four different outputs


def test_prefix_cache_is_namespaced_by_adapter(
    engine: LLMEngine, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    def hits(request_id: str, lora: str | None) -> int:
        before = engine.block_manager.prefix_hits
        run(engine, {request_id: lora})
        return engine.block_manager.prefix_hits - before

    engine.block_manager.reset_prefix_cache()
    assert hits("c1", "all8") == 0
    assert hits("c2", "attn4") == 0  # the same prompt under another adapter: no hit
    assert hits("c3", None) == 0  # nor for the base model
    assert hits("c4", "all8") == 16
    # A changed adapter reloaded under the same name never hits the old one's blocks.
    changed = make_tiny_lora(tiny_llama_dir, tmp_path / "v2", 8, ALL, seed=9)
    engine.load_lora("all8-v", str(changed))
    assert hits("c5", "all8-v") == 0
    engine.load_lora(
        "all8-v", str(make_tiny_lora(tiny_llama_dir, tmp_path / "v3", 8, ALL, seed=10))
    )
    assert hits("c6", "all8-v") == 0
    engine.unload_lora("all8-v")
    with pytest.raises(KeyError):
        engine.add_request("c7", PROMPT, SamplingParams(max_tokens=1), lora="all8-v")
    engine.block_manager.check_integrity()


def test_lru_keeps_max_loras_resident(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    config = EngineConfig(
        dtype="float32",
        block_size=4,
        num_kv_blocks=32,
        max_loras=2,
        loras=tuple((name, str(path)) for name, path in adapters.items()),
    )
    engine = LLMEngine(tiny_llama_dir, config)
    assert list(engine.loras.resident) == ["attn4", "mlp4"]  # all8 evicted at load
    first = run(engine, {"r1": "all8"})  # reloaded from its folder, attn4 evicted
    assert list(engine.loras.resident) == ["mlp4", "all8"]
    assert run(engine, {"r2": "all8"})["r2"] == first["r1"]
    # Both resident adapters held by running requests: a third waits for one to end
    # (refused, retryable) instead of growing past max_loras.
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("held1", [1, 2, 3], params, lora="mlp4")
    engine.add_request("held2", [1, 2, 3], params, lora="all8")
    with pytest.raises(EngineOverloadedError, match="max_loras"):
        engine.add_request("third", [1, 2, 3], params, lora="attn4")
    assert list(engine.loras.resident) == ["mlp4", "all8"]
    while engine.has_unfinished():
        engine.step()
    engine.add_request("third", [1, 2, 3], params, lora="attn4")  # room now
    assert len(engine.loras.resident) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("bias", "all"),
        ("target_modules", ["embed_tokens"]),
    ],
)
def test_unsupported_adapter_config_is_refused_naming_the_field(
    engine: LLMEngine, adapters: dict[str, Path], tmp_path: Path, field: str, value: object
) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((adapters["attn4"] / "adapter_config.json").read_text())
    config[field] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(
        (adapters["attn4"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(LoRAError, match=field):
        engine.load_lora("bad", folder)
