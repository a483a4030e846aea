"""LoRA adapters through the API: `serve --lora NAME=PATH`, a request's `model` picks the
adapter, `/v1/models` lists them with their parent, unknown names are a 404, and a bad
`--lora` is a usage error naming it; with `--enable-lora-admin`, adapters are loaded and
unloaded at runtime (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`) on the process
and the thread engine core. Real PEFT adapter folders (tests/tiny_models.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
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
        "--enable-lora-admin",
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


def admin(server, action: str, key: str | None = None, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/{action}_lora_adapter", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def test_adapters_load_and_unload_at_runtime(server, tiny_llama_dir: Path, tmp_path: Path) -> None:
    late = make_tiny_lora(tiny_llama_dir, tmp_path / "late", 8, ["o_proj", "up_proj"], seed=3)
    assert admin(server, "load", lora_name="late", lora_path=str(late)).status_code == 200
    assert "late" in {card.id for card in client(server).models.list().data}
    answer = complete(server, "late")
    assert answer not in (complete(server, MODEL), complete(server, "attn"))
    # Refusals, as OpenAI error bodies naming the field.
    taken = admin(server, "load", lora_name="attn", lora_path=str(late))
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "lora_name"
    again = admin(server, "load", lora_name="late", lora_path=f"{late}/")  # the same folder
    assert again.status_code == 200 and again.json()["status"] == "already_loaded"
    odd = admin(server, "load", lora_name="a=b", lora_path=str(late))  # `--lora a=b=PATH`
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "lora_name"
    missing = admin(server, "load", lora_name="x", lora_path=str(tmp_path / "nowhere"))
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    corrupt = make_tiny_lora(tiny_llama_dir, tmp_path / "corrupt", 8, ["q_proj"], seed=4)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    broken = admin(server, "load", lora_name="broken", lora_path=str(corrupt))
    assert broken.status_code == 400
    assert "broken" not in {card.id for card in client(server).models.list().data}
    assert admin(server, "unload", lora_name="late").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(server, "late")
    assert admin(server, "unload", lora_name="late").status_code == 404
    # Per-adapter request counts, labelled only by served adapters' names.
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'lora_name="late"' in metrics and 'lora_name="attn"' in metrics
    assert 'lora_name="nope"' not in metrics  # a client's unknown name is no series


def test_runtime_loading_needs_the_flag_and_the_key(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapter = make_tiny_lora(tiny_llama_dir, tmp_path / "a", 4, ["q_proj"], seed=5)
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--engine-core", "thread",
        "--api-key", "secret", "--enable-lora-admin",
    )  # fmt: skip
    try:
        refused = admin(process, "load", lora_name="a", lora_path=str(adapter))
        assert refused.status_code == 401
        loaded = admin(process, "load", "secret", lora_name="a", lora_path=str(adapter))
        assert loaded.status_code == 200
        sdk = openai.OpenAI(base_url=f"{process.url}/v1", api_key="secret", max_retries=0)
        text = sdk.completions.create(model="a", prompt="one two", max_tokens=6, temperature=0)
        assert text.model == "a"
    finally:
        process.kill()
        process.close_log()
    plain = ServerProcess(tiny_llama_dir, "--served-model-name", MODEL, "--engine-core", "thread")
    try:
        off = admin(plain, "load", lora_name="a", lora_path=str(adapter))
        assert off.status_code == 404 and "--enable-lora-admin" in off.json()["error"]["message"]
    finally:
        plain.kill()
        plain.close_log()
