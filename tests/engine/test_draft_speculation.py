"""Draft-model speculative decoding (`engine.draft`): a tiny draft of the target's vocabulary
proposes, the target verifies with speculative sampling. Greedy output equals plain
decoding's (stop strings, logprobs, preemption); sampled output has plain sampling's
distribution with a draft equal to the target (every draft accepted) and with a noisy one
(most rejected); rejected drafts give their blocks back; a mismatched draft is refused."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculative import PROMPT, _chi_square, _critical

from modelship.engine import LLM, SamplingParams
from modelship.engine.draft import DraftModelError
from modelship.engine.speculative import SpeculativeConfig


def _noisy_copy(source: Path, target: Path, noise: float) -> Path:
    """The model at `source` with Gaussian noise (`noise` x each matrix's std) on every
    matrix: the same tokenizer, a different distribution (measured: ~30% of drafts accepted
    at noise 0.3 under the chi-square test's sampling settings)."""
    shutil.copytree(source, target)
    weights_file = next(target.glob("*.safetensors"))
    weights = load_file(weights_file)
    gen = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = (w + noise * w.float().std() * torch.randn(w.shape, generator=gen)).to(
                w.dtype
            )
    save_file(weights, weights_file, metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _noisy_copy(tiny_llama_dir, tmp_path_factory.mktemp("draft") / "noisy", 0.3)


def _draft_config(draft: Path, **overrides) -> SpeculativeConfig:
    # rows free: every sequence drafts whatever the batch, so drafts are always at stake
    settings = dict(num_tokens=4, by_default=True, max_batch_size=512, draft_token_cost=0.0)
    return SpeculativeConfig(method="draft", draft_model=str(draft), **{**settings, **overrides})


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, noisy_draft: Path):
    plain = LLM(tiny_llama_dir, num_kv_blocks=256)
    same = LLM(tiny_llama_dir, num_kv_blocks=256, speculative=_draft_config(tiny_llama_dir))
    noisy = LLM(tiny_llama_dir, num_kv_blocks=256, speculative=_draft_config(noisy_draft))
    return plain, same, noisy


def _spec(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def test_greedy_output_logprobs_and_stop_strings_are_those_of_plain_decoding(engines) -> None:
    plain, same, noisy = engines
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    prompts = [PROMPT, "seven six five"]
    expected = plain.generate(prompts, params)
    for llm in (same, noisy):
        before = _spec(llm)
        got = llm.generate(prompts, params)
        drafted, accepted = (a - b for a, b in zip(_spec(llm), before, strict=True))
        assert drafted > 0
        for want, have in zip(expected, got, strict=True):
            want, have = want.outputs[0], have.outputs[0]
            assert (have.token_ids, have.text) == (want.token_ids, want.text)
            for a, b in zip(have.logprobs, want.logprobs, strict=True):
                assert a.token_id == b.token_id
                assert math.isclose(a.logprob, b.logprob, abs_tol=1e-3)
                assert set(a.top) == set(b.top)
        if llm is same:
            assert accepted == drafted  # the target drafting for itself: all accepted
        llm.engine.block_manager.check_integrity()
    text = expected[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    want = plain.generate([PROMPT], params)[0].outputs[0]
    have = same.generate([PROMPT], params)[0].outputs[0]
    assert have.finish_reason == want.finish_reason == "stop"
    assert (have.text, have.token_ids) == (want.text, want.token_ids)


def test_preemption_and_rejected_drafts_give_their_blocks_back(
    tiny_llama_dir: Path, noisy_draft: Path
) -> None:
    """A KV cache too small for every sequence at once: sequences are preempted (the draft
    recomputes them from the start) while others verify drafts; every output equals plain
    decoding's, and after every step no running sequence holds a block past its tokens."""
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    small = {"num_kv_blocks": 11, "block_size": 8, "max_model_len": 128}
    plain = LLM(tiny_llama_dir, **small).generate(prompts, params)
    llm = LLM(tiny_llama_dir, **small, speculative=_draft_config(noisy_draft))
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= engine.block_manager.blocks_needed(seq.num_tokens)
    drafted, accepted = _spec(llm)
    assert engine.stats().num_preemptions > 0
    assert 0 < accepted < drafted  # drafts were both kept and rejected
    assert [tokens[f"r{i}"] for i in range(4)] == [o.outputs[0].token_ids for o in plain]
    assert engine.block_manager.num_free_blocks == 11  # every slot given back
    engine.block_manager.check_integrity()


def test_sampled_output_has_the_distribution_of_plain_sampling(engines) -> None:
    """Seeded draws, many of them, with every draft accepted (the target as its own draft)
    and with most rejected (a noisy draft: the residual max(0, p - q) is drawn from often):
    the tokens at each position follow plain sampling's distribution (chi-square two-sample
    test, p < 1e-4). The repeated prompt also takes prefix-cache hits the draft must
    recompute. A verifier that keeps every draft, or samples rejections from p, fails."""
    plain, same, noisy = engines
    num_draws, length = 240, 5

    def draws(llm: LLM) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.04, top_k=3, max_tokens=length, ignore_eos=True, seed=seed)
            for seed in range(num_draws)
        ]
        return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * num_draws, params)]

    expected = draws(plain)
    for llm in (same, noisy):
        before = _spec(llm)
        got = draws(llm)
        drafted, accepted = (a - b for a, b in zip(_spec(llm), before, strict=True))
        assert drafted > num_draws  # drafts were at stake
        if llm is same:
            assert accepted == drafted
        else:
            assert 0.1 * drafted < accepted < 0.6 * drafted  # many rejections, some accepts
        for position in range(1, length):
            a = Counter(tokens[position] for tokens in expected)
            b = Counter(tokens[position] for tokens in got)
            statistic, dof = _chi_square(a, b)
            assert statistic < _critical(dof), (position, a.most_common(5), b.most_common(5))


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 999}))
    with pytest.raises(DraftModelError, match="vocab_size 999 differs"):
        LLM(tiny_llama_dir, num_kv_blocks=16, speculative=_draft_config(other))
    (other / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftModelError, match="tokenizer differs"):
        LLM(tiny_llama_dir, num_kv_blocks=16, speculative=_draft_config(other))
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig(num_tokens=4, method="draft")


def test_the_draft_model_option_needs_draft_tokens() -> None:
    from pydantic import ValidationError

    from modelship.engine.options import EngineOptions

    with pytest.raises(ValidationError, match="speculative_model needs num_speculative_tokens"):
        EngineOptions(speculative_model="/models/draft")
    config = EngineOptions(num_speculative_tokens=3, speculative_model="/d").speculative_config()
    assert (config.method, config.draft_model, config.num_tokens) == ("draft", "/d", 3)
    assert "--speculative-model" in EngineOptions(num_speculative_tokens=3,
                                                  speculative_model="/d").cli_args()  # fmt: skip
