"""The whole engine through `LLM.generate`, against transformers' greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship import LLM, SamplingParams
from modelship.engine import EngineOverloadedError, InvalidParamsError

PROMPTS = ["The quick brown fox", "Paged attention reads", "Héllo wörld 東京", "Models are"]


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=128)


def test_greedy_equals_transformers(llm: LLM, tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        expected = hf_greedy(tiny_llama_dir, output.prompt_token_ids, 12)
        assert output.outputs[0].token_ids == expected
        assert output.outputs[0].finish_reason == "length"


def test_batched_equals_one_at_a_time(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_prefix_cache_hit_is_identical_and_computes_less(llm: LLM) -> None:
    llm.engine.block_manager.reset_prefix_cache()
    prompt = "Continuous batching schedules requests at iteration granularity. " * 3
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    computed_before = llm.engine.scheduler.num_prompt_tokens
    second = llm.generate(prompt, params)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - 4
    recomputed = llm.engine.scheduler.num_prompt_tokens - computed_before
    assert recomputed < len(second.prompt_token_ids) // 4


def test_n_completions_share_the_prompt_blocks(llm: LLM) -> None:
    llm.engine.block_manager.reset_prefix_cache()
    prompt = "The quick brown fox jumps over the lazy dog, " * 2
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    output = llm.generate(prompt, params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in output.outputs)
    full_prompt_blocks = (len(output.prompt_token_ids) - 1) // 4 * 4
    assert output.num_cached_tokens == full_prompt_blocks  # siblings hit the first's blocks
    again = llm.generate(prompt, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]


def test_stop_strings_logprobs_and_abort(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = llm.generate(PROMPTS[0], greedy)[0].outputs[0].text
    stop = text[3:6]
    stopped = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]

    with_logprobs = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    )[0].outputs[0]
    assert len(with_logprobs.logprobs) == 4
    for token_id, entry in zip(with_logprobs.token_ids, with_logprobs.logprobs, strict=True):
        assert entry.token_id == token_id and len(entry.top) == 2
        assert max(entry.top.values()) == pytest.approx(entry.logprob, abs=1e-5)

    engine = llm.engine
    engine.add_request("to-abort", "abort me please", SamplingParams(max_tokens=50))
    engine.step()
    deltas = engine.abort("to-abort")
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_overload_and_preemption(tiny_llama_dir: Path) -> None:
    small = LLM(
        tiny_llama_dir,
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_waiting_requests=3,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        small.engine.add_request(f"r{i}", PROMPTS[i], params)
    with pytest.raises(EngineOverloadedError):
        small.engine.add_request("r3", PROMPTS[3], params)
    finished = {}
    while small.engine.has_unfinished():
        for delta in small.engine.step():
            if delta.finished:
                finished[delta.request_id] = delta.num_output_tokens
    assert finished == {"r0": 30, "r1": 30, "r2": 30}
    assert small.engine.scheduler.num_preemptions > 0  # 3 x ~36 tokens > 24 blocks x 4
    alone = small.generate(PROMPTS[2], params)[0].outputs[0].token_ids
    assert len(alone) == 30


@pytest.mark.slow
def test_demo_model_greedy_equals_transformers(demo_model_dir: Path) -> None:
    llm = LLM(demo_model_dir, dtype="float32", max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for output in outputs:
        expected = hf_greedy(demo_model_dir, output.prompt_token_ids, 8)
        assert output.outputs[0].token_ids == expected


def test_prompt_logprobs_equal_transformers_across_chunks(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    # A token budget of 8 splits the prompt into chunks; a warm prefix cache must not
    # skip positions whose logprobs were asked for.
    llm = LLM(
        tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8
    )
    prompt = "Prompt logprobs score every token of the prompt, chunk by chunk."
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))  # fills the prefix cache
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    output = llm.generate(prompt, params)[0]
    ids = output.prompt_token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    assert output.prompt_logprobs is not None
    assert len(output.prompt_logprobs) == len(ids) > 8
    assert output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(
            expected[position - 1, ids[position]].item(), abs=1e-4
        )
        top_ids = expected[position - 1].topk(3).indices.tolist()
        assert list(entry.top) == top_ids


def test_siblings_count_against_admission_and_are_released(tiny_llama_dir: Path) -> None:
    """n = 16 cannot slip past a waiting limit of 4 (the siblings used to be invisible to
    admission); a request whose n could never fit is a parameter error, not an overload."""
    llm = LLM(
        tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=128, max_waiting_requests=4
    )
    engine = llm.engine
    with pytest.raises(InvalidParamsError) as info:
        engine.add_request("n16", PROMPTS[0], SamplingParams(n=16, max_tokens=2))
    assert info.value.param == "n"
    engine.add_request("n3", PROMPTS[0], SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    assert engine.stats().num_waiting == 3
    engine.add_request("n1", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(EngineOverloadedError):
        engine.add_request("n2", PROMPTS[2], SamplingParams(n=2, max_tokens=2))
    engine.abort("n3")
    assert engine.stats().num_waiting == 1
    engine.add_request("n2", PROMPTS[2], SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    finished: dict[str, int] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                finished[delta.request_id] = finished.get(delta.request_id, 0) + 1
    assert finished == {"n1": 1, "n2": 2}
    assert engine.stats().num_waiting == 0 and engine.stats().num_running == 0


def test_add_request_is_all_or_nothing(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that fails to be added leaves no sequence behind (an out-of-range seed used
    to raise after the scheduler took the first sequence, with n >= 2 siblings unowned)."""
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    engine = llm.engine

    def assert_no_trace() -> None:
        assert not engine.has_unfinished() and not engine.scheduler.has_unfinished()
        assert engine.stats().num_waiting == 0
        assert engine.step() == []

    params = SamplingParams(n=2, seed=1, max_tokens=4)
    params.seed = 2**64  # changed after construction: torch's manual_seed would overflow
    with pytest.raises(InvalidParamsError, match="seed"):
        engine.add_request("bad-seed", PROMPTS[0], params)
    assert_no_trace()

    def failing_generator(params: SamplingParams, index: int) -> None:
        raise RuntimeError("no generator")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "_make_generator", failing_generator)
        with pytest.raises(RuntimeError, match="no generator"):
            engine.add_request("bad-generator", PROMPTS[0], SamplingParams(n=2, max_tokens=4))
    assert_no_trace()

    class FailingDict(dict):
        def __setitem__(self, key, value) -> None:
            raise RuntimeError("registration failed")

    with monkeypatch.context() as patch:  # a failure after admission is undone
        patch.setattr(engine.output_processor, "requests", FailingDict())
        with pytest.raises(RuntimeError, match="registration failed"):
            engine.add_request("bad-registration", PROMPTS[0], SamplingParams(n=3, max_tokens=4))
    assert_no_trace()

    out = llm.generate(PROMPTS[0], SamplingParams(n=2, seed=3, max_tokens=4, ignore_eos=True))
    assert [len(c.token_ids) for c in out[0].outputs] == [4, 4]


@pytest.mark.parametrize(
    ("field", "value"),
    [("int4_kernel", "fast"), ("lm_head", "int2"), ("attention_backend", "flash")],
)
def test_kernel_switches_refuse_unknown_values(field: str, value: str) -> None:
    from modelship.engine import EngineConfig

    with pytest.raises(ValueError, match=rf"{field} must be one of .*got '{value}'"):
        EngineConfig(**{field: value})


def test_score_equals_transformers_and_needs_an_idle_engine(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=16)
    engine = llm.engine
    sequences = [engine.tokenize(p) for p in PROMPTS[:3]] + [list(range(3, 40))]
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=1))  # a prefix cached: score erases it
    scores = list(engine.score(sequences))  # 4 + 3 + 3 + 10 blocks: more than one batch
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for ids, score in zip(sequences, scores, strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
        assert score.shape == expected.shape
        torch.testing.assert_close(score, expected, atol=1e-4, rtol=0)
    # the engine serves as before afterwards, cached prefix gone or not
    assert llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0].outputs

    engine.add_request("busy", PROMPTS[1], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle"):
        engine.score(sequences)


def test_failed_generate_leaves_the_engine_clean(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises (here: the model runner) aborts that call's requests, so the next
    `generate` neither trips over stale request ids nor finds blocks still held."""
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    real_execute = engine.runner.execute
    calls = 0

    def fail_on_second_step(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("No available kernel")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", fail_on_second_step)
    with pytest.raises(RuntimeError, match="No available kernel"):
        llm.generate(PROMPTS, params)
    assert not engine.has_unfinished()
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_integrity()
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert again == expected

    # a prompt refused at admission takes the already-queued ones of the same call with it
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], [10**9]], params)
    assert not engine.has_unfinished()


def test_a_request_failing_inside_the_step_fails_alone(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose processing raises inside the step (injected) ends with
    finish_reason "error" and its blocks freed; the requests beside it finish normally
    (found by the engine-faults drill: any such error used to stop the whole engine)."""
    from modelship.engine.faults import FAULTS_ENV

    monkeypatch.setenv(FAULTS_ENV, "raise=300")
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2)
    normal, poison = [5, 6, 7, 8, 9], [5, 6, 300, 8, 9]
    outputs = llm.generate([normal, poison, normal], params)
    assert [c.finish_reason for c in outputs[0].outputs] == ["length", "length"]
    assert [c.finish_reason for c in outputs[1].outputs] == ["error", "error"]
    assert outputs[2].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_integrity()
