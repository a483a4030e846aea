"""A model folder's tokenizer without transformers: `tokenizers` for text, jinja2 for chats.

Importing transformers costs 1-1.3 s (more where torch is not loaded yet), and a replica pays
it twice before /ready: in the server process (prompts, chat templates) and in the engine
core process (incremental detokenizing). `Tokenizer` loads `tokenizer.json` with the
`tokenizers` library, the backend transformers' fast tokenizer wraps, and applies
`tokenizer_config.json` the way transformers 5 does on load, so ids, text and chat prompts
equal those of `PreTrainedTokenizerFast.from_pretrained(folder)` (the tests compare them).
Folders without a tokenizer.json (sentencepiece or tiktoken files only) load with
transformers' `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

# transformers' named special tokens, in its order (ids of tokens it adds follow this order).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_CHAT_TEMPLATE_FILE = "chat_template.jinja"
_CHAT_TEMPLATE_DIR = "additional_chat_templates"  # <name>.jinja: more named templates


class BatchEncoding(dict):
    """What `tokenizer(text)` returns: `input_ids` and `attention_mask`, as keys and as
    attributes (transformers' shape, so code written against it keeps working)."""

    @property
    def input_ids(self) -> list[int] | list[list[int]]:
        return self["input_ids"]

    @property
    def attention_mask(self) -> list[int] | list[list[int]]:
        return self["attention_mask"]


class Tokenizer:
    """Encode, decode and chat templates of one model, as transformers' fast tokenizer does them.

    `special_tokens` maps names (bos_token, eos_token, ..., then model-specific ones such as
    image_token) to token text; `extra_special_tokens` lists the unnamed special tokens. Both
    are already in the backend's vocabulary. Does not change after construction.
    """

    def __init__(
        self,
        backend: Backend,
        special_tokens: dict[str, str],
        extra_special_tokens: list[str],
        chat_template: str | dict[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str = "",
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.extra_special_tokens = list(extra_special_tokens)
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        # Whether decode cleans up spaces before punctuation, as applied: transformers 5 skips
        # the config's setting for BPE models (where it deletes real spaces), with a warning,
        # unless the config insists; from_folder folds that in.
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._compiled_templates: dict[str, Any] = {}

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` with `tokenizer_config.json`, special_tokens_map.json and the
        chat template files next to it."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        backend = Backend.from_file(str(model_dir / "tokenizer.json"))
        # transformers calls without truncation or padding unless asked: neither is ever on.
        padding = backend.padding
        backend.no_truncation()
        backend.no_padding()
        if "added_tokens_decoder" not in config:  # older folders: special tokens on their own
            _merge_special_tokens_map(config, _read_json(model_dir / "special_tokens_map.json"))
        if padding is not None:
            config.setdefault("pad_token", padding["pad_token"])
        named, extra = _special_tokens(config)
        _add_tokens(backend, config.get("added_tokens_decoder") or {}, named, extra)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        if type(backend.model).__name__ == "BPE" and not config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        ):
            clean_up = False
        return cls(
            backend,
            {name: str(token) for name, token in named.items()},
            [str(token) for token in extra],
            chat_template=_read_chat_template(model_dir, config),
            clean_up_tokenization_spaces=clean_up,
            name_or_path=str(model_dir),
        )

    # Text -> ids ----------------------------------------------------------------------------
    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> BatchEncoding:
        """Ids of a text (or of each text of a list), with the post-processor's special tokens
        (a BOS, for models whose tokenizer.json adds one) unless `add_special_tokens=False`."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        encodings = self.backend_tokenizer.encode_batch(text, add_special_tokens=add_special_tokens)
        return BatchEncoding(
            input_ids=[e.ids for e in encodings],
            attention_mask=[e.attention_mask for e in encodings],
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    # Ids -> text ----------------------------------------------------------------------------
    def decode(
        self,
        token_ids: int | list[int] | list[list[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str | list[str]:
        """Text of a list of ids (a list of texts for a list of lists). Ids past the
        vocabulary are dropped."""
        if hasattr(token_ids, "tolist"):  # a tensor or an array
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [
                self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces)
                for ids in token_ids
            ]
        text = self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def batch_decode(
        self, sequences: list[list[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # Vocabulary -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Size of the vocabulary with the added tokens: every valid id is below it."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        """Unknown tokens map to the unk token's id (None without one)."""
        if isinstance(tokens, str):
            token_id = self.backend_tokenizer.token_to_id(tokens)
            return token_id if token_id is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(
        self, ids: int | list[int], skip_special_tokens: bool = False
    ) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(i) for i in ids if i not in skip]

    # Special tokens -------------------------------------------------------------------------
    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(token) for token in self.all_special_tokens]

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_token_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        token = self.special_tokens_map.get("unk_token")
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def pad_token_id(self) -> int | None:
        return self._special_token_id("pad_token")

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    # Chat -----------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template source: `chat_template` itself or the name of one of the model's
        templates; by default the model's ("tool_use" when tools are given and it has one)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"this model has several chat templates and no default: {sorted(templates)}; "
                "pass chat_template=<name>"
            )
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        return templates

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> str | list[str] | list[int] | list[list[int]] | BatchEncoding:
        """A conversation (or a list of them) as prompt text, or its ids with `tokenize`
        (a `BatchEncoding` with `return_dict`), as transformers renders it. Keyword arguments
        beyond these reach the template as variables, over the special tokens."""
        # jinja2 is imported on the first chat only: the engine core never renders one.
        from modelship.engine.chat_template import compile_chat_template, render_chat_template

        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        source = self.get_chat_template(chat_template, tools)
        template = self._compiled_templates.get(source)
        if template is None:
            template = self._compiled_templates[source] = compile_chat_template(source)
        is_batched = isinstance(conversation[0], (list, tuple))
        texts = [
            render_chat_template(
                template,
                list(messages),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                variables={**self.special_tokens_map, **kwargs},
            )
            for messages in (conversation if is_batched else [conversation])
        ]
        if not tokenize:
            return texts if is_batched else texts[0]
        encoding = self(texts if is_batched else texts[0], add_special_tokens=False)
        return encoding if return_dict else encoding.input_ids

    def __repr__(self) -> str:
        return f"Tokenizer(name_or_path={self.name_or_path!r}, len={len(self)})"


def load_tokenizer(model_dir: str | Path) -> Tokenizer | Any:
    """The folder's tokenizer: a `Tokenizer` when it has a tokenizer.json, else transformers'."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return Tokenizer.from_folder(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_token(value: Any) -> str | AddedToken | None:
    """A token as tokenizer_config.json writes it: text, or a serialized AddedToken."""
    if isinstance(value, dict) and "content" in value:
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(**fields)
    return value if isinstance(value, str) else None


def _merge_special_tokens_map(config: dict[str, Any], tokens_map: dict[str, Any]) -> None:
    """special_tokens_map.json's tokens over the config's, as named special tokens."""
    for key, value in tokens_map.items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = {**value, "special": True}
        if key in ("additional_special_tokens", "extra_special_tokens"):
            config.setdefault(key, value)
        else:
            config[key] = value


def _special_tokens(
    config: dict[str, Any],
) -> tuple[dict[str, str | AddedToken], list[str | AddedToken]]:
    """Named special tokens (the standard names, then the config's other `*_token` keys,
    serialized AddedTokens before plain text, as transformers orders them) and extra ones."""
    named = {name: token for name in SPECIAL_TOKEN_NAMES if (token := _as_token(config.get(name)))}
    plain, serialized = {}, {}
    for key, value in config.items():
        if key.endswith("_token") and key not in SPECIAL_TOKEN_NAMES:
            if isinstance(value, str):
                plain[key] = value
            elif (token := _as_token(value)) is not None:
                serialized[key] = token
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extra, dict):  # named extra tokens are model-specific named tokens
        plain.update({k: t for k, v in extra.items() if (t := _as_token(v)) is not None})
        extra = []
    named.update(serialized)
    named.update(plain)
    return named, [t for value in extra if (t := _as_token(value)) is not None]


def _add_tokens(
    backend: Backend,
    added_tokens_decoder: dict[str, dict[str, Any]],
    named: dict[str, str | AddedToken],
    extra: list[str | AddedToken],
) -> None:
    """What transformers adds to the backend on load: the config's added tokens (again, in id
    order: their flags there win) and any special token the vocabulary lacks."""
    tokens = [_as_token(added_tokens_decoder[key]) for key in sorted(added_tokens_decoder, key=int)]
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    known |= {t.content for t in tokens}
    named_texts = {str(t) for t in named.values()}
    for token in [*named.values(), *extra]:
        if str(token) in known:
            continue
        known.add(str(token))
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif str(token) in named_texts:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja and additional_chat_templates/*.jinja, over the config's
    `chat_template` (a template, or a list of {"name", "template"})."""
    templates = {}
    if (model_dir / _CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (model_dir / _CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (model_dir / _CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((model_dir / _CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces a word-piece tokenizer leaves before punctuation."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
