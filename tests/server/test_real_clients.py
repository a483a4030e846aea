"""Agent and structured-output frameworks, unmodified, against a real `modelship serve`
and through a gateway in front of it: LangChain (`with_structured_output`, `bind_tools`),
pydantic-ai (typed output), and the OpenAI Agents SDK (a function tool and a typed output,
over the Responses API and over chat completions). The tiny random model writes neither
JSON nor calls by itself: each answer here is held to its shape by the grammar the request
asks for (a schema, a forced tool), which is what these frameworks rely on servers for.
(instructor is left out: it pins an older openai SDK than this project's.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from gateway_process import GatewayProcess

from server_process import ServerProcess

MODEL = "tiny"
pytestmark = pytest.mark.timeout(300)


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "2048",
        "--kv-cache-memory-mb", "32",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["serve", "gateway"])
def base_url(
    request: pytest.FixtureRequest, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The replica itself, and the gateway in front of it (as `modelship up` and Kubernetes
    put it): the gateway forwards schemas, tools and Responses requests, and translates
    Responses at its edge for failover, so the clients must work through it too."""
    if request.param == "serve":
        yield f"{server.url}/v1"
        return
    gateway = GatewayProcess(tmp_path_factory.mktemp("gateway"), {}, "--endpoint", server.url)
    try:
        gateway.wait_ready(60)
        yield f"{gateway.url}/v1"
    finally:
        gateway.stop()


def test_langchain_structured_output_and_tools(base_url: str) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="none", model=MODEL, max_tokens=300,
                     temperature=0, max_retries=0)  # fmt: skip
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(Weather, method=method).invoke("Weather?")
        assert isinstance(answer, Weather), method

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")


def test_pydantic_ai_typed_output(base_url: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="none"))
    agent = Agent(model, output_type=Weather, model_settings={"max_tokens": 300, "temperature": 0})
    assert isinstance(agent.run_sync("Weather?").output, Weather)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_function_tool_and_typed_output(base_url: str, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no spans sent to OpenAI's servers
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    model_type = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    model = model_type(MODEL, client)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    settings = ModelSettings(tool_choice="required", max_tokens=300, temperature=0)
    agent = Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "Weather in Paris?", max_turns=2)
    assert len(asked) == 1 and result.final_output == f"sunny in {asked[0]}"

    typed = Agent(name="typed", instructions="Answer.", model=model, output_type=Weather,
                  model_settings=ModelSettings(max_tokens=300, temperature=0))  # fmt: skip
    assert isinstance(Runner.run_sync(typed, "Weather?", max_turns=1).final_output, Weather)
