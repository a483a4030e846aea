"""`Tokenizer` (tokenizers + jinja2) against transformers' fast tokenizer on the same folders.

The reference is `PreTrainedTokenizerFast.from_pretrained(folder)`, what `load_tokenizer`
returned before it stopped importing transformers. The folders: the tiny test tokenizer,
variants of it with the tokenizer_config.json shapes found on the Hub (added tokens with their
own flags, extra and model-specific special tokens, named templates, the legacy
special_tokens_map.json, a BOS-adding post-processor with truncation and padding saved on),
a word-piece tokenizer (spaces cleaned up), and the demo model.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from modelship.engine.detokenizer import IncrementalDetokenizer
from modelship.engine.sampling_params import SamplingParams
from modelship.engine.tokenizer import Tokenizer, load_tokenizer

from tiny_models import _CORPUS, CHAT_TEMPLATE, make_tokenizer

TEXTS = [
    "",
    " ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, naïve café, 東京, Ωμέγα, привет, مرحبا, नमस्ते",
    "emoji 🚀🔥 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 skin 👍🏽",
    "a  b   c\t\td\n\n\n e \r\n f      ",
    "   leading spaces and trailing   ",
    "\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y<|im_end|><|im_end|> <|im_start|>",
    "<|im_sta <|im_end <|endoftext",
    "tool <|tool|> image <|image|> audio <|audio|> pad <pad> <|extra|>",
    "Don't stop , they 're here . Isn't it ? Yes ! I 'm sure",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "0123456789 3.14159 -42 1e10 0x1F",
    "\u0301\u200b\u00a0\ufeff zero-width and combining",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 🚀, what's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And <|im_end|> in text?\n  "},
]

# A template using what real ones use: loop controls, namespace, tojson, special tokens as
# variables, raise_exception, extra template options, tools, {% generation %}.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none) %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
  {%- if m.role not in ['user', 'assistant'] %}
    {{- raise_exception('bad role ' + m.role) }}{% endif %}
  {%- if loop.index0 > 6 %}{% break %}{% endif %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}
{%- else %}{{ m.content }}{% endif %}{{ eos_token }}
{% endfor %}
{%- if ns.system %}[system: {{ ns.system | tojson }}]{% endif %}
{%- if tools %}[tools: {{ tools | tojson(indent=2) }}]{% endif %}
{%- if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}
{% for m in messages %}
    {% if m.role == 'user' %}
  [{{ m.content | length }}]
    {% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": 'Weather <in> a city & its "area"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _copy_tiny(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    return folder


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def _added_token(content: str, **flags) -> dict:
    """A token as tokenizer_config.json and special_tokens_map.json write it."""
    fields = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"content": content, **fields, **flags}


def make_hub_style(source: Path, folder: Path) -> Path:
    """added_tokens_decoder (with <|im_end|>'s flags changed from tokenizer.json's), an extra
    special token and a model-specific one not in the vocabulary, named chat templates."""
    _copy_tiny(source, folder)
    (folder / "chat_template.jinja").unlink()

    def edit(config: dict) -> None:
        config["added_tokens_decoder"] = {
            "0": _added_token("<|endoftext|>", special=True),
            "1": _added_token("<|im_start|>", special=True),
            "2": _added_token("<|im_end|>", special=True, lstrip=True, rstrip=True),
        }
        config["additional_special_tokens"] = ["<|tool|>", "<|im_end|>"]
        config["image_token"] = "<|image|>"
        config["audio_token"] = _added_token("<|audio|>", __type="AddedToken")
        config["bos_token"] = None
        config["clean_up_tokenization_spaces"] = True
        config["chat_template"] = [
            {"name": "default", "template": CHAT_TEMPLATE},
            {"name": "tool_use", "template": RICH_TEMPLATE},
        ]

    _edit_json(folder / "tokenizer_config.json", edit)
    return folder


def make_legacy(source: Path, folder: Path) -> Path:
    """No added_tokens_decoder: special tokens from special_tokens_map.json, one of them
    (<pad>) not in the vocabulary; serialized AddedTokens; the template in the config;
    special tokens written in text are split like any text."""
    _copy_tiny(source, folder)
    (folder / "chat_template.jinja").unlink()

    def edit(config: dict) -> None:
        config.pop("pad_token")
        config["eos_token"] = _added_token("<|im_end|>", __type="AddedToken")
        config["chat_template"] = RICH_TEMPLATE
        config["split_special_tokens"] = True  # special-token text in prompts is plain text

    _edit_json(folder / "tokenizer_config.json", edit)
    tokens_map = {
        "bos_token": _added_token("<|im_start|>"),
        "pad_token": _added_token("<pad>"),
        "additional_special_tokens": ["<|extra|>"],
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(tokens_map))
    return folder


def make_bos_adding(source: Path, folder: Path) -> Path:
    """A post-processor that adds a BOS, truncation and padding saved in tokenizer.json, the pad
    token only there, and a second named template in additional_chat_templates/."""
    _copy_tiny(source, folder)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B:1", special_tokens=[("<|im_start|>", 1)]
    )
    backend.enable_truncation(max_length=8)
    backend.enable_padding(pad_id=0, pad_token="<|endoftext|>", length=64)
    backend.save(str(folder / "tokenizer.json"))
    _edit_json(folder / "tokenizer_config.json", lambda config: config.pop("pad_token"))
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rich.jinja").write_text(RICH_TEMPLATE)
    return folder


def make_wordpiece(folder: Path) -> Path:
    """A word-piece tokenizer (lowercasing, punctuation split), clean_up_tokenization_spaces on."""
    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"], show_progress=False
    )
    backend.train_from_iterator([*_CORPUS, *TEXTS], trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        clean_up_tokenization_spaces=True,
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok") / "tiny"
    make_tokenizer(folder)
    return folder


FOLDERS = ["tiny", "hub_style", "legacy", "bos_adding", "wordpiece"]


@pytest.fixture(scope="module", params=[*FOLDERS, pytest.param("demo", marks=pytest.mark.slow)])
def folder(request: pytest.FixtureRequest, tiny_dir: Path, tmp_path_factory) -> Path:
    name = request.param
    if name == "demo":
        return request.getfixturevalue("demo_model_dir")
    if name == "tiny":
        return tiny_dir
    target = tmp_path_factory.mktemp("variant") / name
    if name == "wordpiece":
        return make_wordpiece(target)
    return {"hub_style": make_hub_style, "legacy": make_legacy, "bos_adding": make_bos_adding}[
        name
    ](tiny_dir, target)


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    ours = load_tokenizer(folder)
    assert isinstance(ours, Tokenizer)
    return ours, PreTrainedTokenizerFast.from_pretrained(folder)


def _random_texts(seed: int, count: int) -> list[str]:
    """Strings mixing ASCII, accents, CJK, emoji, whitespace runs and special-token text."""
    rng = random.Random(seed)
    pieces = [
        "a", "Z", " ", "  ", "\n", "\t", "é", "ß", "東", "京", "🚀", "👩‍👧", "\u0301", ".", ",",
        "'s", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "|>", "fox", " the", "0",
    ]  # fmt: skip
    return ["".join(rng.choices(pieces, k=rng.randint(1, 30))) for _ in range(count)]


def test_backend_and_vocabulary_match(pair) -> None:
    ours, ref = pair
    # The backend transformers builds on load (added tokens, their flags, post-processor),
    # less truncation and padding: transformers turns them off on every call, we on load.
    expected = json.loads(ref.backend_tokenizer.to_str()) | {"truncation": None, "padding": None}
    assert json.loads(ours.backend_tokenizer.to_str()) == expected
    assert len(ours) == len(ref)
    assert ours.vocab_size == ref.vocab_size
    assert ours.get_vocab() == ref.get_vocab()


def test_special_tokens_match(pair) -> None:
    ours, ref = pair
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
        assert getattr(ours, f"{name}_id") == getattr(ref, f"{name}_id"), name


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches(pair, add_special_tokens: bool) -> None:
    ours, ref = pair
    texts = TEXTS + _random_texts(0, 200)
    for text in texts:
        expected = ref(text, add_special_tokens=add_special_tokens).input_ids
        got = ours(text, add_special_tokens=add_special_tokens)
        assert got.input_ids == expected, text
        assert got["attention_mask"] == [1] * len(expected)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected
        assert ours.tokenize(text) == ref.tokenize(text)
    batch = ours(texts[:20], add_special_tokens=add_special_tokens)
    assert batch.input_ids == ref(texts[:20], add_special_tokens=add_special_tokens).input_ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_random_ids_matches(pair, skip_special_tokens: bool) -> None:
    ours, ref = pair
    rng = random.Random(1)
    specials = ref.all_special_ids
    for _ in range(300):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randint(0, 40))]
        if specials and rng.random() < 0.5:  # dense in special tokens
            ids = [rng.choice(specials) if rng.random() < 0.3 else i for i in ids]
        expected = ref.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids
    assert ours.decode(7) == ref.decode(7)
    batch = [[1, 2, 3], [4, 5]]
    assert ours.decode(batch, skip_special_tokens) == ref.decode(batch, skip_special_tokens)
    ids = list(range(min(len(ref), 60)))
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens) == ref.convert_ids_to_tokens(
        ids, skip_special_tokens
    )


def test_decode_of_encoded_text_matches(pair) -> None:
    ours, ref = pair
    for text in TEXTS:
        ids = ref(text).input_ids
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        ), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_output_is_identical(pair, skip_special_tokens: bool) -> None:
    ours, ref = pair
    rng = random.Random(2)
    text = " ".join(TEXTS + _random_texts(3, 60))
    # A long "generation": real text's tokens with random ids and special tokens mixed in.
    ids = [
        rng.randrange(len(ref)) if rng.random() < 0.15 else token
        for token in ref(text, add_special_tokens=False).input_ids
    ]
    params = SamplingParams(skip_special_tokens=skip_special_tokens, stop=["zz!"])
    streams = []
    for tokenizer in (ours, ref):
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
        deltas = [detok.update([token]) for token in ids]
        streams.append(([d.delta_text for d in deltas], [d.stop_reason for d in deltas]))
        streams[-1][0].append(detok.flush())
    assert len(ids) > 500
    assert streams[0] == streams[1]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(pair, add_generation_prompt: bool) -> None:
    ours, ref = pair
    assert ours.chat_template == ref.chat_template
    if not ref.chat_template:
        return
    for messages in (MESSAGES, MESSAGES[1:2], MESSAGES[:3]):
        kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        expected = ref.apply_chat_template(messages, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == (
            ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        )
    batch = [MESSAGES[:2], MESSAGES[1:2]]
    assert ours.apply_chat_template(batch, tokenize=False) == ref.apply_chat_template(
        batch, tokenize=False
    )


@pytest.mark.parametrize("options", [{}, {"tools": TOOLS}, {"enable_thinking": False}])
def test_rich_template_matches(pair, options: dict) -> None:
    ours, ref = pair
    for add_generation_prompt in (True, False):
        kwargs = {
            "chat_template": RICH_TEMPLATE,
            "tokenize": False,
            "add_generation_prompt": add_generation_prompt,
            **options,
        }
        expected = ref.apply_chat_template(MESSAGES, **kwargs)
        assert ours.apply_chat_template(MESSAGES, **kwargs) == expected
    assert ("<no-think>" in expected) == ("enable_thinking" in options)
    assert ("[tools:" in expected) == ("tools" in options)
    assert ("🚀" in expected) and ('\\"area\\"' in expected or "tools" not in options)


def test_continue_final_message_matches(pair) -> None:
    ours, ref = pair
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "The answer is  "}]
    for template in (CHAT_TEMPLATE, RICH_TEMPLATE):  # one keeps the text, one trims it
        kwargs = {"chat_template": template, "tokenize": False, "continue_final_message": True}
        assert ours.apply_chat_template(messages, **kwargs) == ref.apply_chat_template(
            messages, **kwargs
        )


def test_template_errors_as_transformers(pair) -> None:
    ours, ref = pair
    bad = [{"role": "tool", "content": "x"}]
    for tokenizer in (ours, ref):
        with pytest.raises(jinja2.TemplateError, match="bad role tool"):
            tokenizer.apply_chat_template(bad, chat_template=RICH_TEMPLATE, tokenize=False)
        # Sandboxed and immutable: a template cannot change what it is given.
        with pytest.raises(jinja2.exceptions.SecurityError):
            tokenizer.apply_chat_template(
                MESSAGES, chat_template="{{ messages.append(1) }}", tokenize=False
            )


def test_named_templates() -> None:
    ours = Tokenizer(Backend(models.BPE()), {}, [], chat_template={"a": "A", "tool_use": "T"})
    assert ours.apply_chat_template(MESSAGES, chat_template="a", tokenize=False) == "A"
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False) == "T"
    with pytest.raises(ValueError, match=r"no default: \['a', 'tool_use'\]"):
        ours.apply_chat_template(MESSAGES, tokenize=False)


def test_folder_variants_exercise_what_they_claim(tiny_dir: Path, tmp_path: Path) -> None:
    # Guards the comparisons above against variants that quietly test nothing new.
    hub = load_tokenizer(make_hub_style(tiny_dir, tmp_path / "hub"))
    assert len(hub) == len(load_tokenizer(tiny_dir)) + 3  # <|tool|>, <|image|>, <|audio|>
    assert hub.special_tokens_map["image_token"] == "<|image|>" and hub.bos_token is None
    assert isinstance(hub.chat_template, dict)
    legacy = load_tokenizer(make_legacy(tiny_dir, tmp_path / "legacy"))
    assert legacy.pad_token == "<pad>" and legacy.extra_special_tokens == ["<|extra|>"]
    assert len(legacy("<|im_end|>").input_ids) > 1
    bos = load_tokenizer(make_bos_adding(tiny_dir, tmp_path / "bos"))
    long_text = "The quick brown fox jumps over the lazy dog."
    assert bos(long_text).input_ids[0] == 1 and len(bos(long_text).input_ids) > 8
    assert bos(long_text, add_special_tokens=False).input_ids[0] != 1
    assert set(bos.chat_template) == {"default", "rich"}
    rendered = hub.apply_chat_template(MESSAGES, chat_template=RICH_TEMPLATE, tokenize=False)
    assert "\n  [" in rendered  # lstrip_blocks: the block tags' indentation is gone
    wordpiece = load_tokenizer(make_wordpiece(tmp_path / "wp"))
    ids = wordpiece("Yes , it is . Isn't it ?").input_ids
    assert wordpiece.decode(ids) != wordpiece.backend_tokenizer.decode(ids)  # cleaned up


def test_clean_up_setting_follows_transformers(pair, folder: Path) -> None:
    ours, _ = pair
    config = json.loads((folder / "tokenizer_config.json").read_text())
    is_bpe = type(ours.backend_tokenizer.model).__name__ == "BPE"
    assert ours.clean_up_tokenization_spaces == (
        bool(config.get("clean_up_tokenization_spaces")) and not is_bpe
    )


def test_loading_needs_no_transformers(tiny_dir: Path) -> None:
    # Importing transformers is what this tokenizer exists to avoid (seconds of cold start);
    # jinja2 waits for the first chat (the engine core never renders one).
    code = f"""
import sys
from modelship.engine.tokenizer import load_tokenizer
tokenizer = load_tokenizer({str(tiny_dir)!r})
ids = tokenizer("Hello <|im_end|> world").input_ids
assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello  world", tokenizer.decode(ids)
assert "jinja2" not in sys.modules
text = tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False)
assert text.startswith("<|im_start|>user"), text
assert "transformers" not in sys.modules, "transformers was imported"
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_folder_without_tokenizer_json_falls_back_to_transformers(
    tiny_dir: Path, tmp_path: Path
) -> None:
    backend = Backend.from_file(str(tiny_dir / "tokenizer.json"))
    backend.model.save(str(tmp_path))  # vocab.json + merges.txt: a GPT-2 style folder
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert not isinstance(tokenizer, Tokenizer)
    assert tokenizer.decode(tokenizer("the lazy dog").input_ids) == "the lazy dog"
