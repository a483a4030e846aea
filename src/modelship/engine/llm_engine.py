"""The synchronous engine: requests in, one scheduler step at a time, deltas out.

One step = schedule (a plan of how many tokens each sequence runs) -> execute (the model
runner) -> update_from_output (the scheduler advances sequences, frees finished ones) ->
detokenize (stop strings may finish a sequence) -> deltas. A request with `n > 1` becomes
n sequences; the siblings are held back until the first one has computed the prompt, so
they take its full blocks from the prefix cache instead of computing them again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from modelship.engine.block_manager import BlockManager
from modelship.engine.config import EngineConfig
from modelship.engine.cuda_graphs import (
    DecodeGraphRunner,
    create_graph_capturer,
    graph_capture_error,
)
from modelship.engine.detokenizer import IncrementalDetokenizer
from modelship.engine.draft import DraftModel
from modelship.engine.faults import FaultInjection
from modelship.engine.loras import LoRARegistry
from modelship.engine.model_runner import ModelRunner
from modelship.engine.outputs import EngineStats, SequenceDelta, TokenLogprob
from modelship.engine.request import EngineRequest
from modelship.engine.sampler import NonFiniteLogitsError
from modelship.engine.sampling_params import InvalidParamsError, SamplingParams
from modelship.engine.scheduler import Scheduler
from modelship.engine.sequence import Sequence
from modelship.engine.speculative import SpeculationTracker, accepted_prefix
from modelship.engine.structured import GrammarCompiler
from modelship.engine.tensor_parallel import (
    ParallelModel,
    TensorParallelGroup,
    rank_device,
    threads_per_rank,
)
from modelship.engine.tokenizer import load_tokenizer
from modelship.model.attention import resolve_attention_backend
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from modelship.model.loader import load_model, read_generation_eos
from modelship.model.lora import LoRAAdapter
from modelship.model.tensor_parallel import ShardSpec

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    held_back: list[Sequence] = field(default_factory=list)  # siblings waiting for the prompt
    num_finished: int = 0
    # Position p holds the logprob of prompt token p (None for the first, which nothing
    # predicts); filled chunk by chunk when `params.prompt_logprobs` is set.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])


class LLMEngine:
    """Owns the model, KV cache, scheduler and tokenizer of one model replica."""

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        tp_size = self.config.tensor_parallel_size
        if self.config.num_threads or tp_size > 1:
            torch.set_num_threads(threads_per_rank(self.config))
        device = rank_device(self.config, 0)
        self.model_path = Path(model_path)
        model_config = ModelConfig.from_dir(self.model_path)
        self.max_model_len = self.config.max_model_len or model_config.max_position_embeddings
        # Tensor parallelism: the shapes are checked, then the workers spawn first, so they
        # load their shards meanwhile.
        shard = ShardSpec(model_config, 0, tp_size) if tp_size > 1 else None
        self.tp_group = TensorParallelGroup(self.model_path, self.config) if shard else None
        try:
            self.model = load_model(
                self.model_path,
                device=device,
                dtype=self.config.dtype,
                max_positions=self.max_model_len,
                int4_kernel=self.config.int4_kernel,
                lm_head=self.config.lm_head,
                fused_decoder=self.config.fused_decoder,
                shard=shard,
                group=self.tp_group.group if self.tp_group else None,
            )
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.close()
            raise
        self.tokenizer = load_tokenizer(self.model_path)
        self.loras: LoRARegistry | None = None
        if self.config.loras or self.config.enable_lora:
            # Always the per-layer path for adapter rows; base-only steps keep the fused
            # decoder and decode graphs (`ModelRunner.execute`).
            self.model.enable_lora()
            self.loras = LoRARegistry(
                model_config.num_layers, self.model.dtype, device, self.config.max_loras
            )
            for name, path in self.config.loras:
                self.loras.load(name, path)
        eos_token_ids = set(model_config.eos_token_ids) | read_generation_eos(self.model_path)

        cache_dtype = self.config.cache_dtype(self.model.dtype)
        attention_backend = resolve_attention_backend(
            self.config.attention_backend, device, cache_dtype
        )
        capturer = self._graph_capturer(attention_backend)
        block_size = self.config.block_size
        num_blocks = self.config.num_kv_blocks or max(
            1,
            self.config.kv_cache_memory_bytes
            // kv_cache_bytes_per_block(self.model.config, block_size, cache_dtype),
        )  # under TP, rank 0 holds the most kv heads: the budget holds for every rank
        # With graphs, one more block than the block manager hands out: the padding rows of
        # a replayed decode step write and read only this scratch block (id num_blocks).
        num_scratch_blocks = 1 if capturer is not None else 0
        self.kv_caches = allocate_kv_cache(
            self.model.config, num_blocks + num_scratch_blocks, block_size, cache_dtype, device
        )
        if self.tp_group is not None:
            try:
                self.tp_group.send(
                    ("cache", num_blocks, block_size, cache_dtype, attention_backend)
                )
                self.tp_group.wait_ready()
            except BaseException:
                self.tp_group.close()
                raise
            self.model = ParallelModel(self.model, self.tp_group)
        # structured outputs: each request's grammar, compiled once per distinct spec
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size, eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.config,
            self.block_manager,
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
        )
        graph_runner = None
        if capturer is not None:
            graph_runner = DecodeGraphRunner(
                self.model,
                self.kv_caches,
                block_size=block_size,
                max_model_len=self.max_model_len,
                max_batch_size=self.config.max_graph_batch_size,
                scratch_block=num_blocks,
                attention_backend=attention_backend,
                device=device,
                capturer=create_graph_capturer(capturer, device),
            )
            graph_runner.capture()  # after the KV cache exists: the graphs address it
        self.runner = ModelRunner(
            self.model, self.kv_caches, block_size, device, attention_backend, graph_runner
        )
        self._requests: dict[str, _Request] = {}
        self._seq_owner: dict[str, tuple[_Request, int]] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._faults = FaultInjection.from_env()  # drills only
        speculative = self.config.speculative
        self._speculation = SpeculationTracker(speculative) if speculative else None
        self._draft: DraftModel | None = None
        if speculative is not None and speculative.method == "draft":
            assert speculative.draft_model is not None
            self._draft = DraftModel(
                speculative.draft_model,
                self.model_path,
                self.tokenizer,
                num_blocks=num_blocks + num_scratch_blocks,
                block_size=block_size,
                cache_dtype=cache_dtype,
                attention_backend=self.config.attention_backend,
                device=device,
                dtype=self.config.dtype,
                max_model_len=self.max_model_len,
                int4_kernel=self.config.int4_kernel,
                lm_head=self.config.lm_head,
                fused_decoder=self.config.fused_decoder,
            )
        self._default_generator = torch.Generator(device=device)
        self._default_generator.manual_seed(self.config.seed)
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, dtype %s, kv %s, attention %s, "
            "decode graphs %s",
            self.model_path,
            num_blocks,
            block_size,
            self.model.dtype,
            cache_dtype,
            attention_backend,
            capturer or "off",
        )

    def _graph_capturer(self, attention_backend: str) -> str | None:
        """The config's capturer, or None (with a warning) where CUDA graphs were left on by
        default but this attention backend cannot be captured; "replay" refuses loudly."""
        capturer = self.config.graph_capturer
        error = capturer and graph_capture_error(
            attention_backend, self.config.block_size, self.config.torch_device
        )
        if capturer == "cuda" and error:
            logger.warning("decode steps run eagerly: %s", error)
            return None
        return capturer

    # Requests ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also exit when this process does)."""
        if self.tp_group is not None:
            self.tp_group.close()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens); ids pass through."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> list[int]:
        """`add` for callers holding a text prompt (`LLM`, scripts, benchmarks): tokenizes
        it, queues the request and returns its prompt token ids."""
        prompt_token_ids = self.tokenize(prompt)
        self.add(EngineRequest(request_id, prompt_token_ids, params, priority, cache_salt, lora))
        return prompt_token_ids

    def add(self, request: EngineRequest) -> None:
        """Queue a request. Only requests with the same `cache_salt` (a tenant's cache
        namespace) and LoRA adapter share prefix-cache blocks. `lora` names a registered
        adapter (KeyError if it is not one).

        All or nothing: raises `InvalidParamsError`, `EngineOverloadedError`,
        `RequestTooLongError` (or `ValueError` for a bad prompt) at once, leaving no trace.
        With `n > 1` the siblings count against the waiting limits from admission on."""
        request_id, params = request.request_id, request.params
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        vocab_size = self.model.config.vocab_size
        params.verify(vocab_size)
        if params.n > max(1, self.config.max_waiting_requests):  # never admissible: no 429
            raise InvalidParamsError(
                "n", f"n must be at most {self.config.max_waiting_requests} on this server"
            )
        prompt_token_ids = list(request.prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if params.num_resumed_tokens >= len(prompt_token_ids):
            raise InvalidParamsError(
                "num_resumed_tokens", "num_resumed_tokens must be shorter than the prompt"
            )
        adapter = self._adapter(request.lora)
        # Everything that can fail runs before the scheduler takes the first sequence.
        seqs = [
            Sequence(
                f"{request_id}:{i}",
                list(prompt_token_ids),
                params,
                request.priority,
                request.cache_salt,
                adapter,
                index=i,
            )
            for i in range(params.n)
        ]
        if request.constraint is not None:  # a matcher per sequence, past resumed tokens
            resumed = prompt_token_ids[len(prompt_token_ids) - params.num_resumed_tokens :]
            self.grammars.attach(seqs, request.constraint, resumed)
        generators = [self._make_generator(params, index) for index in range(params.n)]
        state = _Request(
            request_id,
            prompt_token_ids,
            params,
            seqs,
            [_detokenizer(self.tokenizer, prompt_token_ids, params) for _ in seqs],
            held_back=seqs[1:],
        )
        self.scheduler.add_request(seqs[0], num_held_back=len(state.held_back))
        try:
            if adapter is not None and self.loras is not None:
                self.loras.acquire(adapter)  # released by `_forget`
            self._requests[request_id] = state
            for index, seq in enumerate(seqs):
                self._seq_owner[seq.seq_id] = (state, index)
                self._generators[seq.seq_id] = generators[index]
        except BaseException:  # nothing above should raise; if it does, undo the admission
            self.scheduler.abort(seqs[0].seq_id)
            self.scheduler.drop_held_back(state.held_back)
            self._forget(state)
            raise

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Stop a request now and free its blocks; returns its final (aborted) deltas."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        deltas = []
        for index, seq in enumerate(request.seqs):
            if seq.is_finished:
                continue
            if seq in request.held_back:
                seq.finish("abort")
                self.scheduler.drop_held_back([seq])
            else:
                self.scheduler.abort(seq.seq_id)
            deltas.append(self._delta(request, index, [], "", None, "abort", None))
        self._forget(request)
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def stats(self) -> EngineStats:
        scheduler, blocks = self.scheduler, self.block_manager
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=blocks.usage,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens=scheduler.num_prompt_tokens,
            num_generation_tokens=scheduler.num_generation_tokens,
            spec_num_drafts=self._speculation.num_drafts if self._speculation else 0,
            spec_num_draft_tokens=self._speculation.num_draft_tokens if self._speculation else 0,
            spec_num_accepted_tokens=(
                self._speculation.num_accepted_tokens if self._speculation else 0
            ),
        )

    def score(self, sequences: list[list[int]]) -> Iterator[torch.Tensor]:
        """For each token sequence, [len - 1, vocab] float32 log-softmax of every next token,
        computed with the kernels this engine serves with (select's quality measurement).
        Only on an idle engine: the KV cache is scratch space meanwhile, so the prefix
        cache is emptied first."""
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine; requests are running")
        self.block_manager.reset_prefix_cache()
        return self.runner.score(sequences)

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers as they sit in memory (shared once)."""
        seen: set[int] = set()
        total = 0
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
        return total

    # Stepping ------------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """Run one iteration: every running sequence advances by its planned tokens."""
        self._propose_drafts()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        if self._draft is not None:  # the slots are reserved: the draft fills them in
            self._draft.propose([scheduled.seq for scheduled in plan.scheduled], self._generators)
        output = self.runner.execute(plan, self._generators)
        sampled: dict[str, list[int]] = {}
        broken: list[Sequence] = []  # their model logits were NaN/inf: they fail alone
        if output.sampler_output is not None:
            token_ids = output.sampler_output.token_ids.tolist()
            nonfinite = set(output.sampler_output.nonfinite_rows)
            for index, seq in enumerate(output.sampled_seqs):
                rows = output.rows_of(index)
                if nonfinite.intersection(rows):
                    broken.append(seq)
                    continue
                samples = token_ids[rows.start : rows.stop]
                if seq.draft_token_ids:
                    samples = accepted_prefix(seq.draft_token_ids, samples)
                    self._speculation.record(seq.seq_id, len(seq.draft_token_ids), len(samples) - 1)
                    # the draft's KV holds the drafts: valid up to the last accepted one
                    seq.num_draft_computed_tokens = min(
                        seq.num_draft_computed_tokens, seq.num_tokens + len(samples) - 1
                    )
                sampled[seq.seq_id] = samples
        num_tokens_before = [seq.num_tokens for seq in output.sampled_seqs]
        self.scheduler.update_from_output(plan, sampled)
        for seq_id, chunk in output.prompt_logprobs.items():
            request, _ = self._seq_owner[seq_id]
            known = len(request.prompt_logprobs)  # a recomputed (preempted) prompt repeats
            request.prompt_logprobs.extend(chunk.entries[max(0, known - chunk.first) :])
        deltas = []
        for seq in broken:
            if seq.seq_id in self._seq_owner:
                deltas.extend(self._fail(seq, NonFiniteLogitsError()))
        for index, seq in enumerate(output.sampled_seqs):
            num_new = seq.num_tokens - num_tokens_before[index]
            if seq.seq_id not in self._seq_owner or num_new == 0:
                continue  # a sibling of a request that failed earlier in this loop
            rows = output.rows_of(index)
            try:
                deltas.append(self._process_sampled(seq, rows, num_new, output.sampler_output))
            except Exception as exc:  # this request alone fails; the batch goes on
                deltas.extend(self._fail(seq, exc))
        self._release_held_back()
        return deltas

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts for the decoding sequences that speculate (see
        `engine.speculative`); none in steps with more than `max_batch_size` running. With a
        draft model, placeholders: the scheduler reserves their slots, then the draft model
        writes the tokens (`engine.draft`)."""
        speculation = self._speculation
        running = self.scheduler.running
        if speculation is None or len(running) > speculation.config.max_batch_size:
            return
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue  # in prefill
            params = seq.params
            # Room: every accepted draft and the token after it are output tokens.
            room = self.max_model_len - seq.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - seq.num_output_tokens - 1)
            num_drafts = speculation.num_to_draft(seq, params.speculative, room, len(running))
            if num_drafts == 0:
                continue
            if self._draft is not None:
                seq.draft_token_ids = [0] * num_drafts
            else:
                seq.draft_token_ids = speculation.propose(seq, num_drafts)

    def _fail(self, seq: Sequence, exc: Exception) -> list[SequenceDelta]:
        """End the request of `seq` with an error: its sequences are aborted (blocks
        freed) and each one without its last delta yet gets one, finish_reason "error"."""
        request, index = self._seq_owner[seq.seq_id]
        message = f"{type(exc).__name__}: {exc}"
        logger.error("request %s failed inside the step: %s", request.request_id, message,
                     exc_info=exc)  # fmt: skip
        finished_now = seq.is_finished  # by this step: `abort` skips it, yet it had no delta
        deltas = self.abort(request.request_id)
        if finished_now:
            deltas.append(self._delta(request, index, [], "", None, "abort", None))
        return [replace(d, finish_reason="error", error=message) for d in deltas]

    def _process_sampled(
        self, seq: Sequence, rows: range, num_new: int, sampler_output
    ) -> SequenceDelta:
        """The delta of the `num_new` tokens `seq` got this step (more than one when drafts
        were accepted); a stop string inside them ends it there, the rest is dropped."""
        request, index = self._seq_owner[seq.seq_id]
        if self._faults is not None:
            self._faults.on_sampled(request.prompt_token_ids, seq.params, seq.num_output_tokens)
        new_tokens = seq.token_ids[seq.num_tokens - num_new :]
        detokenizer = request.detokenizers[index]
        params = seq.params
        text = ""
        kept: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        stop_reason: str | int | None = None
        for row, token_id in zip(rows, new_tokens, strict=False):
            detokenized = detokenizer.update([token_id])
            text += detokenized.delta_text
            kept.append(token_id)
            if logprobs is not None:
                logprobs.append(_token_logprob(sampler_output, row, token_id, params.logprobs))
            if detokenized.stop_reason is not None:
                stop_reason = detokenized.stop_reason
                break
        if stop_reason is not None:
            dropped = len(new_tokens) - len(kept)
            seq.drop_last_tokens(dropped)  # sampled past the stop string
            self.scheduler.num_generation_tokens -= dropped
            if not seq.is_finished:
                self.scheduler.finish(seq.seq_id, "stop")
            else:
                seq.finish_reason = "stop"
        elif seq.is_finished:
            text += detokenizer.flush()  # text held back for a stop string that never came
            if seq.finish_reason == "stop" and kept[-1] in params.stop_token_ids:
                stop_reason = kept[-1]
        finish_reason = seq.finish_reason if seq.is_finished else None
        delta = self._delta(request, index, kept, text, logprobs, finish_reason, stop_reason)
        if params.prompt_logprobs is not None and seq.num_output_tokens == len(kept):
            delta.prompt_logprobs = list(request.prompt_logprobs)
        if seq.is_finished:
            request.num_finished += 1
            if request.num_finished == len(request.seqs):
                self._forget(request)
        return delta

    def _release_held_back(self) -> None:
        for request in list(self._requests.values()):
            first = request.seqs[0]
            if request.held_back and (first.num_output_tokens > 0 or first.is_finished):
                self.scheduler.release_held_back(request.held_back)
                request.held_back = []

    def _delta(self, request, index, token_ids, text, logprobs, finish_reason, stop_reason):
        seq = request.seqs[index]
        return SequenceDelta(
            request_id=request.request_id,
            index=index,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            queue_time_s=seq.queue_time_s if finish_reason is not None else None,
        )

    def _adapter(self, lora: str | None) -> LoRAAdapter | None:
        if lora is None:
            return None
        if self.loras is None or lora not in self.loras.paths:
            raise KeyError(lora)
        return self.loras.get(lora)

    def load_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        """Register and load an adapter at runtime (`LoRAError` for a bad folder)."""
        if self.loras is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora / loras)")
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter for new requests (KeyError if unknown); running ones finish."""
        if self.loras is None:
            raise KeyError(name)
        self.loras.unload(name)

    def _forget(self, request: _Request) -> None:
        if self._requests.pop(request.request_id, None) is not None:
            adapter = request.seqs[0].lora
            if adapter is not None and self.loras is not None:
                self.loras.release(adapter)
        for seq in request.seqs:
            self._seq_owner.pop(seq.seq_id, None)
            self._generators.pop(seq.seq_id, None)
            if self._speculation is not None:
                self._speculation.forget(seq.seq_id)

    def _make_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.is_greedy:
            return None
        if params.seed is None:
            return self._default_generator
        generator = torch.Generator(device=self.config.torch_device)
        generator.manual_seed(params.seed + index)
        return generator


def _token_logprob(sampler_output, row: int, token_id: int, num_top: int) -> TokenLogprob:
    top: dict[int, float] = {}
    if num_top > 0 and sampler_output.top_logprob_ids is not None:
        ids = sampler_output.top_logprob_ids[row, :num_top].tolist()
        values = sampler_output.top_logprobs[row, :num_top].tolist()
        top = dict(zip(ids, values, strict=True))
    return TokenLogprob(token_id, float(sampler_output.logprobs[row]), top)


def _detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams):
    """A resumed request's detokenizer has seen its resumed tokens as output, fed one at a
    time as the replica that generated them did: its text, what it held back (a partial
    character, the start of a stop string) and what it emitted are that replica's."""
    num_resumed = params.num_resumed_tokens
    if not num_resumed:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids[:-num_resumed], params)
    for token_id in prompt_token_ids[-num_resumed:]:
        detokenizer.update([token_id])
    return detokenizer
