"""Incremental detokenization: equal to a full decode, no partial UTF-8, exact stops."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from modelship.engine.detokenizer import IncrementalDetokenizer
from modelship.engine.sampling_params import SamplingParams

from tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def stream(tokenizer, ids: list[int], params: SamplingParams, prompt=(1, 2)):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas, stop = [], None
    for token in ids:
        out = detok.update([token])
        deltas.append(out.delta_text)
        if out.stop_reason is not None:
            stop = out.stop_reason
            break
    else:
        deltas.append(detok.flush())
    return deltas, stop


def test_deltas_concatenate_to_full_decode(tokenizer) -> None:
    text = "Héllo wörld, naïve café 東京 🚀 and the quick brown fox. " * 3
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas, _ = stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_sequences(tokenizer) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(30):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 25))]
        deltas, _ = stream(tokenizer, ids, SamplingParams())
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer) -> None:
    ids = tokenizer("🚀", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    emitted = [detok.update([t]).delta_text for t in ids]
    assert emitted[:-1] == [""] * (len(ids) - 1) and emitted[-1] == "🚀"


def test_stop_string_across_tokens_stops_exactly(tokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas, stop = stream(tokenizer, ids, SamplingParams(stop=["own fo"]))
    assert stop == "own fo"
    assert "".join(deltas) == "the quick br"
    deltas, _ = stream(
        tokenizer, ids, SamplingParams(stop=["own fo"], include_stop_str_in_output=True)
    )
    assert "".join(deltas) == "the quick brown fo"


def test_unmatched_stop_prefix_is_released_at_the_end(tokenizer) -> None:
    ids = tokenizer("the lazy do", add_special_tokens=False).input_ids
    deltas, stop = stream(tokenizer, ids, SamplingParams(stop=["dog!"]))
    assert stop is None and "".join(deltas) == "the lazy do"


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    ids = [*tokenizer("fox", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    deltas, _ = stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas) == "fox"
    deltas, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "fox<|im_end|>"


def test_second_vocabulary_round_trip(tmp_path: Path) -> None:
    # The same property on a second, differently trained vocabulary size.
    folder = tmp_path / "tok2"
    make_tokenizer(folder, vocab_size=400)
    other = AutoTokenizer.from_pretrained(folder)
    text = "Paged attention 🚀 reads keys — through a block table. 東京"
    ids = other(text, add_special_tokens=False).input_ids
    deltas, _ = stream(other, ids, SamplingParams())
    assert "".join(deltas) == other.decode(ids)


@pytest.mark.parametrize("cut", [1, 5, 9, 14])
def test_a_resumed_stream_goes_on_as_one(tokenizer, cut: int) -> None:
    """Resumed after `cut` tokens (a failover), the rest of the text, held-back
    characters and a stop string spanning the cut come out as in one uninterrupted run."""
    from modelship.engine.output_processor import _detokenizer

    ids = tokenizer("naïve café 東京 fox jumps over", add_special_tokens=False).input_ids
    params = SamplingParams(stop=["jumps"])
    whole, stop = stream(tokenizer, ids, params)
    first = "".join(stream(tokenizer, ids[:cut], SamplingParams(stop=["jumps"]))[0][:cut])
    prompt = [1, 2]
    resumed = SamplingParams(stop=["jumps"], num_resumed_tokens=cut)
    detok = _detokenizer(tokenizer, prompt + ids[:cut], resumed)
    rest = []
    for token in ids[cut:]:
        out = detok.update([token])
        rest.append(out.delta_text)
        if out.stop_reason is not None:
            assert out.stop_reason == stop == "jumps"
            break
    assert first + "".join(rest) == "".join(whole)
