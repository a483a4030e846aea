"""Translation between the OpenAI API and the engine, for whole responses and SSE streams."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship.engine import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequest,
    InvalidParamsError,
    RequestFailedError,
    RequestTooLongError,
    SamplingParams,
    SequenceDelta,
)
from modelship.engine.outputs import TokenLogprob
from modelship.engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from modelship.server import protocol as p
from modelship.server import tool_calls
from modelship.server.embedding_shape import EmbeddingShape, model_dir_of
from modelship.server.errors import (
    APIError,
    BadRequestError,
    ConflictError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
)
from modelship.server.fim import FimTokens
from modelship.server.limits import RequestLimitsConfig
from modelship.server.metrics import ServerMetrics
from modelship.server.reasoning import ReasoningParser, ReasoningSplitter
from modelship.server.request_fields import refuse_unsupported
from modelship.server.tool_calls import ToolUse
from modelship.server.tracing import EngineSpans
from modelship.tracing import Tracing


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled hidden states


class OpenAIServing:
    """Serves chat and text completions for one model on one engine (either front)."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        max_model_len: int,
        metrics: ServerMetrics,
        limits: RequestLimitsConfig | None = None,
        tracing: Tracing | None = None,
        adapters: Mapping[str, str] | None = None,
        tool_call_parser: str = "auto",  # a `tool_calls.FORMATS` name, or read from the template
        reasoning_parser: ReasoningParser = ReasoningParser.auto,
    ) -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        # LoRA adapters served over the model: name -> the folder its weights came from
        # (runtime loads change it)
        self.adapters: dict[str, str] = {
            name: _folder(path) for name, path in (adapters or {}).items()
        }
        self.tracing = tracing or Tracing()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.limits = limits or RequestLimitsConfig()
        self.tokenizer = engine.tokenizer
        self.fim = FimTokens.find(self.tokenizer)  # None: `suffix` is refused
        self.embedding_shape = EmbeddingShape.of(model_dir_of(self.tokenizer))
        self.reasoning_parser = reasoning_parser.resolve(
            getattr(self.tokenizer, "chat_template", None)
        )
        # One thread: a second would keep its own malloc arena, and each arena keeps the
        # peak of the largest prompt it tokenized (six threads held 1.2 GB after megabyte
        # prompts, one holds 0.3). A megabyte prompt delays the next one's tokenizing by a
        # second or two, never the event loop.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="modelship-tokenize")

    def check_request(self, request: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        """The model name and the request caps, before any tokenizing."""
        self.check_model(request.model)
        refuse_unsupported(request)
        self.limits.check(request)

    def check_model(self, model: str) -> None:
        if model != self.model_name and model not in self.adapters:
            served = ", ".join(f"`{name}`" for name in (self.model_name, *self.adapters))
            raise ModelNotFoundError(
                f"The model `{model}` does not exist; this server serves {served}.",
                param="model",
            )

    async def load_adapter(self, body: p.LoadLoRAAdapterRequest) -> bool:
        """Load a LoRA adapter at runtime (`POST /v1/load_lora_adapter`). False: it is
        already served under that name from that folder (a repeated call changes nothing);
        the name served from another folder, or the model's own, is a conflict: one name
        never stands for two sets of weights."""
        name, path = body.lora_name, Path(body.lora_path)
        if name in self.adapters and self.adapters[name] == _folder(body.lora_path):
            return False
        if name == self.model_name or name in self.adapters:
            raise ConflictError(
                f"the name `{name}` is already served"
                + ("" if name == self.model_name else " from another folder; unload it first"),
                "lora_name",
            )
        if not (path / "adapter_config.json").is_file():
            raise BadRequestError(
                f"{body.lora_path} has no adapter_config.json (not a PEFT adapter folder "
                "this server can read)",
                "lora_path",
            )
        try:
            await self.engine.load_lora(name, str(path))
        except ValueError as exc:  # LoRAError: the message names the field or file
            raise BadRequestError(str(exc), "lora_path") from exc
        except EngineDeadError as exc:
            raise _engine_dead(exc) from exc
        self.adapters[name] = _folder(body.lora_path)
        return True

    async def unload_adapter(self, body: p.UnloadLoRAAdapterRequest) -> None:
        """Stop serving an adapter (`POST /v1/unload_lora_adapter`): new requests for it get
        404; running ones finish with the weights they started with."""
        if body.lora_name not in self.adapters:
            raise ModelNotFoundError(f"no LoRA adapter `{body.lora_name}` is loaded", "lora_name")
        del self.adapters[body.lora_name]  # first: no new request starts on it
        try:
            await self.engine.unload_lora(body.lora_name)
        except EngineDeadError as exc:
            raise _engine_dead(exc) from exc

    def adapter_of(self, request: p.ChatCompletionRequest | p.CompletionRequest) -> str | None:
        """The LoRA adapter a (checked) request names; None: the model itself."""
        return None if request.model == self.model_name else request.model

    # Requests -> engine ----------------------------------------------------------------------
    def tool_use(self, request: p.ChatCompletionRequest) -> ToolUse | None:
        """The request's tools and the form the model calls them in (None without tools)."""
        if not request.tools or not getattr(self.tokenizer, "chat_template", None):
            return None
        template = self.tokenizer.get_chat_template(None, tools=[])
        form = tool_calls.detect_format(template) if self.tool_call_parser == "auto" else None
        return tool_calls.tool_use(request, form or self.tool_call_parser)

    async def chat_prompt(
        self, request: p.ChatCompletionRequest, use: ToolUse | None = None
    ) -> list[int]:
        from jinja2 import TemplateError  # as the tokenizer imports it: on the first chat

        if not request.messages:
            raise BadRequestError("messages must contain at least one message", "messages")
        messages = tool_calls.template_messages(request.messages, use)
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError("this model has no chat template; use /v1/completions")
        tools = use.tools if use is not None and use.in_template else None
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
            )
        except TemplateError as exc:
            # The template's `raise_exception` (Llama-2's and Mistral's on roles that do not
            # alternate) refuses the messages: the client's input, not a replica fault (a 500
            # would count against the replica at the gateway, and be retried).
            raise BadRequestError(f"messages: the model's chat template refused them: {exc}",
                                  "messages") from exc  # fmt: skip
        return (await self.encode([text], add_special_tokens=False))[0]

    def reasoning_splitter(
        self, prompt: list[int], resumed: list[int] | None = None
    ) -> ReasoningSplitter | None:
        """A splitter for one chat choice's output; None when the model does not reason.
        `resumed`: the output a failed replica already streamed, split there: fed first,
        so the splitter goes on in the state it left (a `</think>` already sent makes the
        rest content, and a tail it held back is sent now)."""
        if self.reasoning_parser is ReasoningParser.none:
            return None
        # the generation prompt's last tokens hold a `<think>` the template opened
        tail = self.tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:])
        splitter = ReasoningSplitter(self.reasoning_parser, tail)
        if resumed:
            # as the engine detokenized it (special tokens skipped); sent already: dropped
            splitter.feed(self.tokenizer.decode(resumed, skip_special_tokens=True))
        return splitter

    async def completion_prompts(self, request: p.CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise BadRequestError("prompt must not be empty", "prompt")
        if request.suffix is not None:
            prompts = self._fim_prompts(prompts, request.suffix)
        encoded = []
        vocab_size = len(self.tokenizer)
        texts = iter(await self.encode([item for item in prompts if isinstance(item, str)]))
        for item in prompts:
            if isinstance(item, str):
                ids = next(texts)
            else:
                ids = list(item)
                if any(not 0 <= t < vocab_size for t in ids):
                    raise BadRequestError(f"token ids must be in [0, {vocab_size})", "prompt")
            if not ids:
                raise BadRequestError("prompt must not be empty", "prompt")
            encoded.append(ids)
        return encoded

    def _fim_prompts(self, prompts: list[Any], suffix: str) -> list[str]:
        if self.fim is None:
            raise BadRequestError(
                "suffix is not supported by this server's model (it has no fill-in-the-middle "
                "tokens)",
                "suffix",
            )
        if not all(isinstance(item, str) for item in prompts):
            raise BadRequestError("suffix takes text prompts, not token ids", "suffix")
        return [self.fim.prompt(item, suffix) for item in prompts]

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, tokenized on the tokenizing thread. The batch call releases
        the GIL, so a megabyte of prompt (seconds of tokenizing) no longer stalls every
        stream and the replica's /ready, which the gateway took for a dead replica."""
        if not texts:
            return []
        encode = functools.partial(self.tokenizer, texts, add_special_tokens=add_special_tokens)
        loop = asyncio.get_running_loop()
        encoding = await loop.run_in_executor(self._tokenize_pool, encode)
        return [list(ids) for ids in encoding.input_ids]

    def resumed_token_ids(
        self, request: p.ChatCompletionRequest | p.CompletionRequest
    ) -> list[int]:
        """`resume_token_ids`, checked: the output a failed replica already streamed."""
        ids = request.resume_token_ids
        if not ids:
            return []
        if not request.stream or request.n != 1:
            raise BadRequestError("resume_token_ids: only for streams with n=1", "resume_token_ids")
        if isinstance(request, p.CompletionRequest) and (request.echo or request.num_prompts != 1):
            raise BadRequestError(
                "resume_token_ids: only for one prompt without echo", "resume_token_ids"
            )
        vocab_size = len(self.tokenizer)
        if any(not 0 <= t < vocab_size for t in ids):
            raise BadRequestError(f"token ids must be in [0, {vocab_size})", "resume_token_ids")
        return list(ids)

    def sampling_params(
        self,
        request: p.ChatCompletionRequest | p.CompletionRequest,
        prompt_len: int,
        num_resumed: int = 0,
    ) -> SamplingParams:
        """`prompt_len` without the `num_resumed` tokens a resumed stream already has:
        `max_tokens` and `min_tokens` count those, the engine only the rest."""
        max_tokens = request.max_tokens
        if isinstance(request, p.ChatCompletionRequest) and request.max_completion_tokens:
            max_tokens = request.max_completion_tokens
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        if max_tokens is not None and max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1", "max_tokens")
        if room < 1 or max_tokens > room:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        prompt_logprobs = None
        if isinstance(request, p.ChatCompletionRequest):
            logprobs = (request.top_logprobs or 0) if request.logprobs else None
        else:
            logprobs = request.logprobs
            if request.echo and logprobs is not None:  # lm-eval's loglikelihood requests
                prompt_logprobs = logprobs
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        n = request.n
        if isinstance(request, p.CompletionRequest) and request.best_of is not None:
            n = self._best_of(request)
            if n > request.n and logprobs is None:
                logprobs = 0  # the candidates are ranked by their logprobs
        try:
            params = SamplingParams(
                n=n,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=request.top_k or 0,
                min_p=request.min_p or 0.0,
                seed=request.seed,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if request.repetition_penalty is None else request.repetition_penalty
                ),
                stop=stop,
                stop_token_ids=list(request.stop_token_ids or []),
                logit_bias=self._logit_bias(request.logit_bias),
                ignore_eos=request.ignore_eos,
                speculative=request.speculative,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            if num_resumed:
                if max_tokens <= num_resumed:
                    raise BadRequestError(
                        "resume_token_ids: must be shorter than max_tokens", "resume_token_ids"
                    )
                params.max_tokens = max_tokens - num_resumed
                params.min_tokens = max(0, params.min_tokens - num_resumed)
                params.num_resumed_tokens = num_resumed
            return params
        except InvalidParamsError as exc:
            param = exc.param
            if isinstance(request, p.ChatCompletionRequest) and param == "logprobs":
                param = "top_logprobs"  # the chat API's name for the same number
            raise BadRequestError(str(exc), param) from exc

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's `logit_bias` (token ids as JSON's string keys) with int keys, each in
        the vocabulary; the engine checks the count and the values."""
        if not bias:
            return None
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # before any parsing
            raise BadRequestError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
            )
        vocab_size = len(self.tokenizer)
        result = {}
        for key, value in bias.items():
            text = key.strip()
            # (a key of 5000 digits would overflow int()'s digit limit: no vocabulary is
            # that large)
            digits = text.isascii() and text.isdigit() and len(text) <= 18
            if not (digits and int(text) < vocab_size):
                raise BadRequestError(
                    f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias"
                )
            result[int(text)] = value
        return result

    def _best_of(self, request: p.CompletionRequest) -> int:
        """The candidates to generate per prompt (`best_of`), checked: at least `n`,
        bounded like `n`, and never streamed (only the best are returned, at the end)."""
        best_of = request.best_of
        assert best_of is not None
        if best_of < request.n:
            raise BadRequestError("best_of must be at least n", "best_of")
        if best_of > self.limits.max_n:
            raise BadRequestError(f"best_of must be at most {self.limits.max_n}", "best_of")
        if request.stream and best_of > request.n:
            raise BadRequestError("best_of cannot be used with stream", "best_of")
        return best_of

    async def generate(self, request: EngineRequest) -> AsyncIterator[SequenceDelta]:
        """Admit into the engine (mapping its errors) and record metrics while streaming."""
        arrival = time.perf_counter()
        lora = request.lora
        try:
            stream = await self.engine.add_request(request)
        except EngineOverloadedError as exc:
            retry_after = str(max(1, round(getattr(exc, "retry_after_s", 1) or 1)))
            raise OverloadedError(str(exc), headers={"Retry-After": retry_after}) from exc
        except RequestTooLongError as exc:
            raise BadRequestError(str(exc), "max_tokens") from exc
        except InvalidParamsError as exc:  # the checks that need the model (top_k <= vocab)
            raise BadRequestError(str(exc), exc.param) from exc
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        except KeyError as exc:  # the engine's word for an adapter it does not hold
            if lora is None:
                raise
            # Unloaded between `check_request` and here: as if it had never been served.
            raise ModelNotFoundError(f"The model `{lora}` does not exist (its LoRA adapter was "
                                     "unloaded).", "model") from exc  # fmt: skip
        except EngineDeadError as exc:
            raise _engine_dead(exc) from exc
        self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        if lora is not None:  # a served adapter's name (checked), never a client string
            self.metrics.lora_requests.labels(**self.metrics.labels, lora_name=lora).inc()
        last: dict[int, float] = {}
        # aclosing: a client that goes away closes this generator, which closes the engine
        # stream, which aborts the request and frees its KV blocks at once.
        num_unfinished = request.params.n
        spans = EngineSpans.start(self.tracing)  # None unless this request is traced
        try:
            async with aclosing(stream):
                async for delta in stream:
                    num_unfinished -= delta.finish_reason is not None
                    if spans is not None:
                        spans.observe(delta)
                    yield self._observe(delta, arrival, last)
        except EngineDeadError as exc:
            raise _engine_dead(exc) from exc
        except RequestFailedError as exc:  # it alone failed; the server goes on
            raise APIError(f"the request failed inside the engine: {exc}") from exc
        finally:
            for _ in range(num_unfinished):  # closed early: the engine aborts these
                self.metrics.request_finished("abort")
            if spans is not None:
                spans.end()

    def _observe(
        self, delta: SequenceDelta, arrival: float, last: dict[int, float]
    ) -> SequenceDelta:
        """Record TTFT, ITL, tokens and finish metrics for one delta; return it unchanged."""
        now = time.perf_counter()
        if delta.token_ids:
            if delta.index in last:
                self.metrics.itl.observe(now - last[delta.index])
            elif delta.index == 0:
                self.metrics.ttft.observe(now - arrival)
            last[delta.index] = now
            self.metrics.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            self.metrics.request_finished(delta.finish_reason)
            if delta.index == 0:
                self.metrics.e2e.observe(now - arrival)
                if delta.queue_time_s is not None:
                    self.metrics.queue_time.observe(delta.queue_time_s)
        return delta

    # Whole responses -------------------------------------------------------------------------
    async def collect(self, request: EngineRequest) -> list[_Choice]:
        choices = [_Choice() for _ in range(request.params.n)]
        async for delta in self.generate(request):
            choice = choices[delta.index]
            choice.text += delta.text
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs or []
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            if delta.embedding is not None:
                choice.embedding = delta.embedding
        return choices

    def chat_logprobs(self, entries: list[TokenLogprob], num_top: int) -> p.ChatLogprobs:
        content = []
        for entry in entries:
            token = self._token_text(entry.token_id)
            top = [
                p.TopLogprob(token=self._token_text(t), logprob=lp, bytes=list(token.encode()))
                for t, lp in list(entry.top.items())[:num_top]
            ]
            content.append(
                p.ChatTokenLogprob(
                    token=token,
                    logprob=entry.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return p.ChatLogprobs(content=content)

    def completion_logprobs(
        self,
        entries: list[TokenLogprob],
        offset: int,
        prompt: tuple[list[int], list[TokenLogprob | None]] | None = None,
    ) -> p.CompletionLogprobs:
        """Legacy logprobs of generated tokens; with `prompt` (echo), the prompt's tokens
        come first, the very first with null logprobs as nothing predicts it."""
        result = p.CompletionLogprobs()
        rows: list[tuple[int, TokenLogprob | None]] = [(e.token_id, e) for e in entries]
        if prompt is not None:
            rows = list(zip(*prompt, strict=True)) + rows
        for token_id, entry in rows:
            token = self._token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob if entry else None)
            result.top_logprobs.append(
                {self._token_text(t): lp for t, lp in entry.top.items()} if entry else None
            )
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


_PROMPT_TAIL_TOKENS = 16


def _folder(path: str) -> str:
    """An adapter folder as compared between loads: absolute, links resolved."""
    return str(Path(path).resolve())


def _engine_dead(exc: EngineDeadError) -> UnavailableError:
    return UnavailableError(f"{exc}; retry on another replica")


def sse(payload: p.BaseModel | dict, exclude: Any = None) -> str:
    data = (
        payload.model_dump_json(exclude_none=False, exclude=exclude)
        if isinstance(payload, p.BaseModel)
        else (json.dumps(payload))
    )
    return f"data: {data}\n\n"


# Leaves the `token_ids` extension out of a chunk whose request did not ask for it.
WITHOUT_TOKEN_IDS = {"choices": {"__all__": {"token_ids"}}}


SSE_DONE = "data: [DONE]\n\n"
