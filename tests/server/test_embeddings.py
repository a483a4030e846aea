"""`/v1/embeddings`: pooled final hidden states, equal to transformers' last hidden state,
L2-normalized, through the scheduler (chunked prefill included), float and base64, with
clear 400s; and through the gateway, charged to the tenant."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from modelship.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams

from server_process import ServerProcess

MODEL = "tiny"


def reference(model_dir: Path, ids: list[int], pooling: str) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return vector


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_states_equal_transformers_across_prefill_chunks(
    tiny_llama_dir: Path, pooling: str
) -> None:
    """Prompts of 150 tokens in chunks of 32: the pooled states are the ones one whole
    forward gives, next to a generating request in the same batches."""
    engine = LLMEngine(tiny_llama_dir, EngineConfig(max_model_len=512, max_num_batched_tokens=32))
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 12)[:150]
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    engine.add(EngineRequest("embed", ids, params, cache_salt="own"))
    engine.add(EngineRequest("chat", ids[:20], SamplingParams(max_tokens=8, ignore_eos=True)))
    embeddings = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.embedding is not None:
                embeddings[delta.request_id] = torch.tensor(delta.embedding)
    assert set(embeddings) == {"embed"}
    expected = reference(tiny_llama_dir, ids, pooling)
    assert cosine(embeddings["embed"], expected) > 0.999  # the engine's kernels, not torch's


def test_pooling_follows_the_folders_sentence_transformers_config(tmp_path: Path) -> None:
    from modelship.server.embedding_shape import pooling_of

    assert pooling_of(tmp_path) == "last" and pooling_of(None) == "last"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert pooling_of(tmp_path) == "mean"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16",
    )  # fmt: skip
    yield process
    process.stop()


def test_embeddings_with_the_openai_sdk(server: ServerProcess, tiny_llama_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    texts = ["hello world", "The quick brown fox", "hello world"]
    # the SDK asks for base64 and decodes it
    answer = client.embeddings.create(model=MODEL, input=texts)
    vectors = [torch.tensor(item.embedding) for item in answer.data]
    assert [item.index for item in answer.data] == [0, 1, 2]
    for vector in vectors:
        assert vector.shape == (64,) and abs(vector.norm().item() - 1.0) < 1e-4
    torch.testing.assert_close(vectors[0], vectors[2])
    assert not torch.allclose(vectors[0], vectors[1])
    ids = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    expected = reference(tiny_llama_dir, _ids(tiny_llama_dir, texts[1]), "last")
    assert cosine(torch.tensor(ids.data[0].embedding), expected) > 0.999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0
    raw = httpx.post(f"{server.url}/v1/embeddings", timeout=30, json={
        "model": MODEL, "input": [[5, 6, 7]], "encoding_format": "base64"}).json()  # fmt: skip
    decoded = struct.unpack("<64f", base64.b64decode(raw["data"][0]["embedding"]))
    assert len(decoded) == 64 and raw["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def _ids(model_dir: Path, text: str) -> list[int]:
    from modelship.engine.tokenizer import load_tokenizer

    return list(load_tokenizer(model_dir)(text).input_ids)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 32}, "dimensions"),
        ({"input": [[1] * 300]}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "model": "other"}, "model"),
        ({"input": {"text": "hi"}}, "input"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(server, body, param) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"].startswith(param), response.text
