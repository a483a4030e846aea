"""LoRA adapters through the API: `serve --lora NAME=PATH`, a request's `model` picks the
adapter, `/v1/models` lists them with their parent, unknown names are a 404, and a bad
`--lora` is a usage error naming it. Real PEFT adapter folders (tests/tiny_models.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from server_process import ServerProcess
from tiny_models import make_tiny_lora

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("adapters")
    attn = make_tiny_lora(tiny_llama_dir, folder / "attn", 8, ["q_proj", "v_proj"], seed=1)
    mlp = make_tiny_lora(tiny_llama_dir, folder / "mlp", 4, ["gate_proj", "down_proj"], seed=2)
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--engine-core", "process",
        "--lora", f"attn={attn}", "--lora", f"mlp={mlp}", "--max-loras", "2",
    )  # fmt: skip
    yield process
    process.kill()
    process.close_log()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def complete(server, model: str, stream: bool = False) -> str:
    args = dict(model=model, prompt="one two three", max_tokens=12, temperature=0)
    if not stream:
        answer = client(server).completions.create(**args)
        assert answer.model == model
        return answer.choices[0].text
    return "".join(
        c.choices[0].text for c in client(server).completions.create(**args, stream=True)
    )


def test_models_lists_the_adapters_with_their_parent(server) -> None:
    cards = {card.id: card for card in client(server).models.list().data}
    assert set(cards) == {MODEL, "attn", "mlp"}
    assert cards["attn"].parent == MODEL and cards["mlp"].parent == MODEL


def test_the_model_field_picks_the_adapter(server) -> None:
    base, attn, mlp = (complete(server, name) for name in (MODEL, "attn", "mlp"))
    assert len({base, attn, mlp}) == 3  # random A and B: each changes the output
    assert complete(server, "attn", stream=True) == attn  # streamed or whole, the same
    answer = client(server).chat.completions.create(
        model="mlp", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert answer.model == "mlp" and answer.choices[0].message.content is not None


def test_an_unknown_adapter_is_a_404(server) -> None:
    with pytest.raises(openai.NotFoundError, match="`attn`"):
        complete(server, "nope")


def test_a_bad_lora_flag_is_a_usage_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    for spec, said in (("attn", "--lora takes NAME=PATH"), (f"x={tmp_path}", "adapter_config")):
        result = subprocess.run(
            [sys.executable, "-m", "modelship", "serve", str(tiny_llama_dir), "--lora", spec],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2 and said in result.stderr, result.stderr
