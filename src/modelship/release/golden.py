"""Golden prompts: fixed chat prompts answered greedily, the reference a release's quality
is checked against.

`select` asks every candidate these prompts (to gate degenerate output) and stores the
winner's answers, with each generated token and its logprob, in the release as
`golden.json`. The gateway's drift probe (`gateway/drift.py`) asks the same prompts of every
replica of that release and compares: a replica serving other weights than the ones select
measured (altered on disk, a wrong file, a broken kernel) answers differently. One module for
both sides, so the request and the comparison cannot drift apart themselves.

One golden prompt offers a tool (`GOLDEN_TOOLS`, `tool_choice` auto, as clients send it):
its answer's parsed calls are recorded and compared too, so a replica that reads the same
tokens into other calls (another `--tool-call-parser`, a changed chat template) is drift.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

GOLDEN_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "List three colors.",
    "Explain what a computer is in one sentence.",
    "What is the weather in Paris right now?",
)
# The tools offered with a golden prompt, by prompt (the drift probe asks by prompt text).
GOLDEN_TOOLS: dict[str, list[dict]] = {
    "What is the weather in Paris right now?": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
}
MAX_TOKENS = 48
GOLDEN_FILE = "golden.json"


@dataclass(frozen=True)
class GoldenAnswer:
    prompt: str
    text: str
    tokens: list[str]  # each generated token's text, as the API's logprobs name it
    logprobs: list[float]  # the chosen token's logprob at each step
    # the calls parsed from the answer, {"name", "arguments"} each (a prompt with tools)
    tool_calls: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Agreement:
    """How far a replica's answers follow the reference: `tokens` is the mean share of each
    reference answer the replica reproduced before its first different token (1.0: all
    identical); `max_logprob_delta` the largest |logprob difference| on those shared tokens."""

    tokens: float
    max_logprob_delta: float


async def ask(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> GoldenAnswer:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
    }
    if prompt in GOLDEN_TOOLS:
        body["tools"] = GOLDEN_TOOLS[prompt]
    response = await client.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout_s
    )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    calls = choice["message"].get("tool_calls") or []
    return GoldenAnswer(
        prompt=prompt,
        text=choice["message"]["content"] or "",
        tokens=[entry["token"] for entry in content],
        logprobs=[float(entry["logprob"]) for entry in content],
        tool_calls=[
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ],
    )


async def ask_all(
    client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str] | None = None
) -> list[GoldenAnswer]:
    """Every golden prompt, one after another: a prompt computed alone is computed the same
    way each time, whatever batch the replica would have put concurrent ones in.

    A replica whose context cannot hold the prompt with tools (the tools' definitions are
    rendered into it: a few hundred tokens) refuses it with a 400; that prompt is left out,
    so the reference select records lacks it and the drift probe, which asks the
    reference's prompts, never asks it either."""
    answers = []
    for prompt in GOLDEN_PROMPTS:
        try:
            answers.append(await ask(client, url, model, prompt, headers))
        except httpx.HTTPStatusError as exc:
            if prompt not in GOLDEN_TOOLS or exc.response.status_code != 400:
                raise
            logger.warning("golden prompt with tools left out: %s", exc.response.text[:300])
    return answers


def compare(reference: list[GoldenAnswer], observed: list[GoldenAnswer]) -> Agreement:
    """Agreement of `observed` with `reference`, prompt by prompt (matched by prompt text).
    An answer whose parsed tool calls differ from the reference's agrees 0 on its prompt,
    whatever its tokens."""
    answers = {answer.prompt: answer for answer in observed}
    shares, deltas = [], [0.0]
    for ref in reference:
        got = answers.get(ref.prompt)
        if got is None or got.tool_calls != ref.tool_calls:
            shares.append(0.0)
            continue
        same = 0
        for want, have in zip(ref.tokens, got.tokens, strict=False):
            if want != have:
                break
            same += 1
        if len(ref.tokens) == len(got.tokens) == same:
            shares.append(1.0)
        else:
            shares.append(same / max(len(ref.tokens), len(got.tokens), 1))
        shared = zip(ref.logprobs[:same], got.logprobs[:same], strict=True)
        deltas.extend(abs(a - b) for a, b in shared)
    return Agreement(statistics.fmean(shares) if shares else 0.0, max(deltas))


def write_reference(path: Path, answers: list[GoldenAnswer]) -> None:
    path.write_text(json.dumps({"answers": [asdict(a) for a in answers]}, indent=2) + "\n")


def read_reference(path: Path) -> list[GoldenAnswer] | None:
    """The answers recorded in `path`; None when there is no such file (a release published
    before golden references existed: nothing to compare with)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return [GoldenAnswer(**answer) for answer in data["answers"]]
