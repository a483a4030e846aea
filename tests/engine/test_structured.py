"""Structured outputs in the engine: every sampled token is one llguidance's own matcher
allows, for greedy and sampled rows, n > 1, logprobs, preemption and resumed requests; a
complete grammar stops the sequence, max_tokens first ends it with "length"."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer

from modelship import LLM, SamplingParams
from modelship.engine import EngineRequest, GrammarSpec, InvalidParamsError
from modelship.engine.sampler import MIN_LOGPROB, apply_token_bitmask
from modelship.engine.speculative import SpeculativeConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
PROMPT = "Models are"


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


def run(llm: LLM, requests: list[EngineRequest]) -> dict[str, list[Choice]]:
    """Run `requests` together to the end; the choices of each, by request id."""
    results = {r.request_id: [Choice() for _ in range(r.params.n)] for r in requests}
    for request in requests:
        llm.engine.add(request)
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            choice = results[delta.request_id][delta.index]
            choice.token_ids += delta.token_ids
            choice.text += delta.text
            choice.logprobs += delta.logprobs or []
            choice.finish_reason = delta.finish_reason or choice.finish_reason
    return results


def request(llm: LLM, request_id: str, spec: GrammarSpec, resumed=(), **params) -> EngineRequest:
    prompt = llm.engine.tokenize(PROMPT) + list(resumed)
    params.setdefault("max_tokens", 200)
    sampling = SamplingParams(num_resumed_tokens=len(resumed), **params)
    return EngineRequest(request_id, prompt, sampling, constraint=spec)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def reference_tokenizer(llm: LLM) -> LLTokenizer:
    """llguidance's tokenizer built by its own transformers helper, not by the engine."""
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llm.engine.model_path)
    return from_tokenizer(hf, n_vocab=llm.engine.model.config.vocab_size)


def assert_allowed(reference: LLTokenizer, spec: GrammarSpec, choice: Choice) -> LLMatcher:
    """Replay the output on a fresh llguidance matcher: it must take every token."""
    matcher = LLMatcher(reference, spec.grammar(), log_level=0)
    for position, token_id in enumerate(choice.token_ids):
        assert matcher.consume_token(token_id), (position, choice.token_ids, matcher.get_error())
    return matcher


def test_sampled_tokens_follow_the_schema_for_every_sequence(llm, reference_tokenizer) -> None:
    spec = GrammarSpec.json_schema(PERSON)
    results = run(llm, [request(llm, "s", spec, n=4, temperature=1.0, seed=7, top_p=0.9),
                        request(llm, "g", spec, temperature=0.0)])  # fmt: skip
    choices = results["s"] + results["g"]
    assert len({tuple(c.token_ids) for c in results["s"]}) > 1  # the siblings differ
    for choice in choices:
        matcher = assert_allowed(reference_tokenizer, spec, choice)
        assert choice.finish_reason == "stop", choice
        assert matcher.is_stopped() or matcher.is_accepting()
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_logprobs_report_the_constrained_distribution(llm, reference_tokenizer) -> None:
    spec = GrammarSpec.choice(["yes", "no", "maybe"])
    [choice] = run(llm, [request(llm, "c", spec, temperature=0.0, logprobs=20)])["c"]
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    matcher = LLMatcher(reference_tokenizer, spec.grammar(), log_level=0)
    for entry in choice.logprobs:
        allowed = {t for t, lp in entry.top.items() if lp > MIN_LOGPROB}
        # the first 20 hold every allowed token: their probabilities sum to one
        assert math.isclose(sum(math.exp(entry.top[t]) for t in allowed), 1.0, rel_tol=1e-4)
        assert all(matcher.validate_tokens([t]) == 1 for t in allowed)
        assert entry.token_id in allowed
        assert matcher.consume_token(entry.token_id)


def test_max_tokens_before_the_grammar_ends_is_length(llm) -> None:
    spec = GrammarSpec.json_schema(PERSON)
    [choice] = run(llm, [request(llm, "short", spec, temperature=0.0, max_tokens=3)])["short"]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.text)


def test_regex_and_grammar_specs(llm) -> None:
    regex = GrammarSpec("regex", r"[a-c]{2,4}-\d\d", "guided_regex")
    lark = GrammarSpec("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/', "guided_grammar")
    both = [
        request(llm, "re", regex, temperature=1.0, seed=3),
        request(llm, "lark", lark, temperature=1.0, seed=3, max_tokens=64),
    ]
    results = run(llm, both)
    [re_choice], [lark_choice] = results["re"], results["lark"]
    assert re.fullmatch(r"[a-c]{2,4}-\d\d", re_choice.text), re_choice.text
    if lark_choice.finish_reason == "stop":
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", lark_choice.text), lark_choice.text


def test_resumed_tokens_advance_the_matcher(llm) -> None:
    """A failover resume: the continuation of a greedy constrained run after its first k
    tokens equals the rest of that run (a matcher at the start would force "{" again)."""
    spec = GrammarSpec.json_schema(PERSON)
    [whole] = run(llm, [request(llm, "whole", spec, temperature=0.0)])["whole"]
    k = len(whole.token_ids) // 2
    resumed = whole.token_ids[:k]
    [rest] = run(llm, [request(llm, "rest", spec, resumed, temperature=0.0)])["rest"]
    assert rest.token_ids == whole.token_ids[k:]
    with pytest.raises(InvalidParamsError) as info:  # not output of this grammar
        llm.engine.add(
            request(
                llm,
                "bad",
                spec,
                llm.engine.tokenize(
                    "]]",
                ),
                temperature=0.0,
            )
        )
    assert info.value.param == "resume_token_ids" and not llm.engine.has_unfinished()


def test_preempted_sequences_keep_their_grammar_state(tiny_llama_dir, reference_tokenizer) -> None:
    """4 x ~43 tokens on a 96-token KV cache: sequences are preempted and recomputed; each
    output is still the grammar's and the same as its seeded run alone."""
    small = LLM(
        tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64
    )
    pattern = r'\{"n": [0-9]{1,3}, "s": "[a-z]{1,8}"\}'
    spec = GrammarSpec("regex", pattern, "guided_regex")
    requests = [request(small, f"p{i}", spec, temperature=1.0, seed=i, max_tokens=40)
                for i in range(4)]  # fmt: skip
    together = run(small, requests)
    assert small.engine.scheduler.num_preemptions > 0
    for i in range(4):
        [choice] = together[f"p{i}"]
        assert_allowed(reference_tokenizer, spec, choice)
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text), choice
        alone = request(small, f"a{i}", spec, temperature=1.0, seed=i, max_tokens=40)
        assert run(small, [alone])[f"a{i}"][0].token_ids == choice.token_ids  # same draws


def test_speculation_skips_constrained_sequences(tiny_llama_dir) -> None:
    spec_llm = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=256,
                   speculative=SpeculativeConfig(num_tokens=3, by_default=True))  # fmt: skip
    spec = GrammarSpec.json_schema(PERSON)
    [choice] = run(spec_llm, [request(spec_llm, "sp", spec, temperature=0.0)])["sp"]
    jsonschema.validate(json.loads(choice.text), PERSON)
    assert spec_llm.engine.stats().spec_num_drafts == 0


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "strin"}, "strin"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ],
)
def test_unsupported_schemas_are_refused_naming_the_field(llm, schema, fragment) -> None:
    spec = GrammarSpec.json_schema(schema, "response_format")
    with pytest.raises(InvalidParamsError, match=fragment) as checked:
        spec.check()
    assert checked.value.param == "response_format"
    with pytest.raises(InvalidParamsError) as admitted:
        llm.engine.add(request(llm, "bad", spec))
    assert admitted.value.param == "response_format" and not llm.engine.has_unfinished()


def test_equal_specs_compile_once_and_keep_property_order(llm) -> None:
    grammars = llm.engine.grammars
    before = grammars.num_cached
    schema = {"type": "object", "properties": {"z": {"type": "null"}, "a": {"type": "null"}},
              "required": ["z", "a"], "additionalProperties": False}  # fmt: skip
    grammars.matcher(GrammarSpec.json_schema(schema))
    matcher = grammars.matcher(GrammarSpec.json_schema(json.loads(json.dumps(schema))))
    assert grammars.num_cached == before + 1
    tokens = llm.tokenizer.encode('{"z":null,"a":null}', add_special_tokens=False)
    assert all(matcher.accept(t) for t in tokens)  # z before a, as the schema lists them


def test_a_wrapped_byte_level_decoder_still_reads_as_bytes(tiny_llama_dir, tmp_path) -> None:
    """A GGUF-converted tokenizer.json wraps ByteLevel in a decoder Sequence (the demo
    model's): a "Ġ" token must still be a space to the grammar."""
    from modelship.engine.structured import GrammarCompiler
    from modelship.engine.tokenizer import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"},
                       {"type": "Fuse"}, data["decoder"]]}  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = load_tokenizer(tmp_path)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    matcher = compiler.matcher(GrammarSpec.json_schema(PERSON))
    answer = '{"name": "ab", "age": 7, "admin": true}'
    assert all(matcher.accept(t) for t in tokenizer.encode(answer, add_special_tokens=False))


def ref_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


def test_apply_token_bitmask_equals_the_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=generator)  # 100: not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    bitmask[1] = -1  # every token allowed
    assert torch.equal(
        apply_token_bitmask(logits, bitmask), ref_apply_token_bitmask(logits, bitmask)
    )


# Property: schemas from a supported subset; every finished output validates -------------
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(-50, 50).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 30}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(
        st.sampled_from(["red", "green", "blue", "x"]), min_size=1, max_size=3, unique=True
    ).map(lambda values: {"enum": values}),
    st.just({"type": "null"}),
)
_VALUES = st.one_of(
    _LEAVES,
    _LEAVES.map(lambda item: {"type": "array", "items": item, "maxItems": 3}),
)
_SCHEMAS = st.dictionaries(
    st.sampled_from(["a", "b", "id", "tags", "ok"]), _VALUES, min_size=1, max_size=3
).map(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                     "additionalProperties": False})  # fmt: skip


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=_SCHEMAS, seed=st.integers(0, 1000))
def test_outputs_validate_against_generated_schemas(llm, schema, seed) -> None:
    spec = GrammarSpec.json_schema(schema)
    [choice] = run(llm, [request(llm, "h", spec, temperature=1.0, seed=seed, max_tokens=300)])["h"]
    assert choice.finish_reason == "stop", (schema, choice)
    jsonschema.validate(json.loads(choice.text), schema)


def test_a_replica_imports_no_torch_compile_machinery() -> None:
    """llguidance.torch compiles a kernel at import, loading torch._dynamo (sympy, networkx,
    inductor): imported with the engine, it doubled the CPU a tiny-model `modelship serve`
    spends before it is ready (6.9 s, 3.5 s without). Only a constrained step imports it."""
    code = (
        "import sys; import modelship.server.launcher, modelship.engine.structured; "
        "print(sorted(m for m in ('torch._dynamo', 'sympy', 'llguidance.torch') "
        "if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
