"""Greedy decoding is repeatable on the demo model in the default serving configuration,
for every kind of weights a release can serve.

The same temperature-0 request must give the same tokens alone, inside a batch of 8, after
its prompt's blocks are in the prefix cache, and streamed or not through the server. That
holds because every kernel on the CPU serving path computes a row the same way whatever
else is in the step (W4A8 and dense linears, the int8 head, the paged-attention kernel, one
RMSNorm path, the fused decoder op); see docs/performance.md. Each test runs on the demo
model quantized with llm-compressor's round-to-nearest W4A16 at group size 64
(`demo_int4_dir` in conftest), on its fp16 variant as the optimize stage writes it, and on
the base checkpoint served directly (both dense, bf16 compute on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modelship.engine import LLM, SamplingParams
from modelship.model import cpu_kernels
from modelship.pipeline.optimize.cast import FP16, run_cast

from server_process import ServerProcess

# three demo-model variants, over a minute in CI: handed to a worker first (tests/conftest.py)
pytestmark = [
    pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler"),
    pytest.mark.long,
]

PROMPT = (
    "<|im_start|>user\nExplain in a few sentences why the sky is blue, and what changes "
    "at sunset.<|im_end|>\n<|im_start|>assistant\n"
)
OTHERS = [
    "The history of the city of Rome begins",
    "def fibonacci(n):",
    "A recipe for bread needs flour, water,",
    "In physics, energy is",
    "The three largest oceans are",
    "Dear team, this week we",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
VARIANTS = {"int4": "demo_int4_dir", "fp16": "demo_fp16_dir", "base": "demo_model_dir"}


@pytest.fixture(scope="module")
def demo_fp16_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's fp16 variant (`pipeline.optimize.cast`, the optimize stage's own)."""
    out = tmp_path_factory.mktemp("demo-fp16")
    run_cast(FP16.default_recipe, demo_model_dir, out)
    return out


@pytest.fixture(params=list(VARIANTS))
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(VARIANTS[request.param])


def tokens_and_logprobs(output) -> list[tuple[int, float]]:
    """Bitwise: a logprob that moved in its last bit fails, not only a flipped token."""
    completion = output.outputs[0]
    return [
        (t, lp.logprob) for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def test_greedy_is_the_same_alone_in_a_batch_and_cached(model_dir: Path) -> None:
    llm = LLM(model_dir, max_num_batched_tokens=2048)  # default kernels: auto
    alone = llm.generate(PROMPT, GREEDY)[0]
    assert alone.num_cached_tokens == 0
    # the same prompt again: its full blocks now come from the prefix cache
    cached = llm.generate(PROMPT, GREEDY)[0]
    assert cached.num_cached_tokens > 0
    # inside a batch of 8 (prefills and decodes of other requests share its steps)
    batch = llm.generate([*OTHERS[:3], PROMPT, *OTHERS[3:]], GREEDY)
    in_batch = batch[3]
    expected = tokens_and_logprobs(alone)
    assert len(expected) == 48
    assert tokens_and_logprobs(cached) == expected
    assert tokens_and_logprobs(in_batch) == expected


def test_greedy_with_chunked_prefill_equals_one_chunk(model_dir: Path) -> None:
    whole = LLM(model_dir).generate(PROMPT, GREEDY)[0]
    chunked = LLM(model_dir, max_num_batched_tokens=7).generate(PROMPT, GREEDY)[0]
    assert tokens_and_logprobs(chunked) == tokens_and_logprobs(whole)


def test_greedy_is_the_same_with_one_thread_for_batch_1_steps(model_dir: Path) -> None:
    """`step_threads` runs the decode steps on 1 thread and the prefill on 2: the same bits
    as 2 threads throughout (every kernel splits work by outputs, never inside a sum)."""
    two = LLM(model_dir, num_threads=2).generate(PROMPT, GREEDY)[0]
    mixed = LLM(model_dir, num_threads=2, step_threads=((1, 1),)).generate(PROMPT, GREEDY)[0]
    assert tokens_and_logprobs(mixed) == tokens_and_logprobs(two)


@pytest.fixture(scope="module", params=list(VARIANTS))
def client(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    model_dir = request.getfixturevalue(VARIANTS[request.param])
    process = ServerProcess(model_dir, "--served-model-name", "demo")
    try:
        yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0)
    finally:
        process.stop()


def test_streamed_equals_non_streamed_and_repeats(client: openai.OpenAI) -> None:
    body = dict(
        model="demo",
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        temperature=0,
        max_tokens=40,
    )
    first = client.chat.completions.create(**body).choices[0].message.content
    again = client.chat.completions.create(**body).choices[0].message.content  # prefix cached
    stream = client.chat.completions.create(**body, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert first and again == first and streamed == first
