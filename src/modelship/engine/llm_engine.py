"""The synchronous engine: requests in, one scheduler step at a time, deltas out.

One step = propose (speculative drafts) -> schedule (a plan of how many tokens each
sequence runs) -> execute (the worker runs the plan on the model) -> accept (the sampled
tokens each sequence keeps: drafts up to the first mismatch) -> update (the scheduler
advances sequences, frees finished ones) -> process (the output processor detokenizes;
stop strings may finish a sequence) -> deltas. A request with `n > 1` becomes n sequences;
the siblings are held back until the first one has computed the prompt, so they take its
full blocks from the prefix cache instead of computing them again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from modelship.engine.block_manager import BlockManager
from modelship.engine.config import EngineConfig
from modelship.engine.faults import FaultInjection
from modelship.engine.model_runner import RunnerOutput
from modelship.engine.output_processor import OutputProcessor, RequestState
from modelship.engine.outputs import EngineStats, SequenceDelta
from modelship.engine.request import EngineRequest
from modelship.engine.sampler import NonFiniteLogitsError
from modelship.engine.sampling_params import InvalidParamsError, SamplingParams
from modelship.engine.scheduler import Scheduler
from modelship.engine.sequence import Sequence
from modelship.engine.speculative import SpeculationTracker, accepted_prefix
from modelship.engine.structured import GrammarCompiler
from modelship.engine.worker import Worker
from modelship.model.lora import LoRAAdapter

logger = logging.getLogger(__name__)


@dataclass
class AcceptedTokens:
    """What a step's sampled rows leave each sequence, before the scheduler's update."""

    token_ids: dict[str, list[int]]  # by sequence id: the samples, or the accepted drafts + 1
    broken: list[Sequence]  # their model logits were NaN/inf: they fail alone
    # `RunnerOutput.sampled_seqs`' token counts before the update: what follows is new
    num_tokens_before: list[int]


class LLMEngine:
    """The scheduler, block manager, output processor and worker of one model replica."""

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.worker = worker = Worker(model_path, self.config)
        # The worker's parts that the server, benchmarks and tests read
        self.model_path, self.max_model_len = worker.model_path, worker.max_model_len
        self.model, self.kv_caches, self.runner = worker.model, worker.kv_caches, worker.runner
        self.tokenizer, self.loras, self.tp_group = worker.tokenizer, worker.loras, worker.tp_group
        # Blocks before every layer's window go back while a sequence runs (Mistral v0.1);
        # not with a draft model, which reads the same block tables over all positions.
        window = worker.model.config.kv_window if worker.draft is None else None
        self.block_manager = BlockManager(
            worker.num_blocks, worker.block_size, self.config.enable_prefix_caching, window
        )
        # structured outputs: each request's grammar, compiled once per distinct spec
        self.grammars = GrammarCompiler(self.tokenizer, worker.vocab_size, worker.eos_token_ids)
        self.scheduler = Scheduler(
            self.config,
            self.block_manager,
            max_model_len=self.max_model_len,
            eos_token_ids=worker.eos_token_ids,
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self._generators: dict[str, torch.Generator | None] = {}
        self._faults = FaultInjection.from_env()  # drills only
        speculative = self.config.speculative
        self._speculation = SpeculationTracker(speculative) if speculative else None
        self._default_generator = torch.Generator(device=worker.device)
        self._default_generator.manual_seed(self.config.seed)

    # Requests ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also exit when this process does)."""
        self.worker.close()

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
        if request_id in self.output_processor.requests:
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
        state = self.output_processor.create(request_id, prompt_token_ids, params, seqs)
        self.scheduler.add_request(seqs[0], num_held_back=len(state.held_back))
        try:
            if adapter is not None and self.loras is not None:
                self.loras.acquire(adapter)  # released by `_forget`
            self.output_processor.add(state)
            for seq, generator in zip(seqs, generators, strict=True):
                self._generators[seq.seq_id] = generator
        except BaseException:  # nothing above should raise; if it does, undo the admission
            self.scheduler.abort(seqs[0].seq_id)
            self.scheduler.drop_held_back(state.held_back)
            self._forget(state)
            raise

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Stop a request now and free its blocks; returns its final (aborted) deltas."""
        request = self.output_processor.requests.get(request_id)
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
            deltas.append(self.output_processor.delta(request, index, [], "", None, "abort", None))
        self._forget(request)
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.output_processor.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.output_processor.requests

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
        return self.worker.score(sequences)

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers as they sit in memory (shared once)."""
        return self.worker.weight_bytes()

    # Stepping ------------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """Run one iteration: every running sequence advances by its planned tokens."""
        self._propose_drafts()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        output = self.worker.execute(plan, self._generators)
        accepted = self._accept(output)
        self.scheduler.update_from_output(plan, accepted.token_ids)
        deltas = self._process(output, accepted)
        self._release_held_back()
        return deltas

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts for the decoding sequences that speculate (see
        `engine.speculative`); none in steps with more than `max_batch_size` running. With a
        draft model, placeholders: the scheduler reserves their slots, then the draft model
        writes the tokens (`Worker.execute`, `engine.draft`)."""
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
            if self.worker.draft is not None:
                seq.draft_token_ids = [0] * num_drafts
            else:
                seq.draft_token_ids = speculation.propose(seq, num_drafts)

    def _accept(self, output: RunnerOutput) -> AcceptedTokens:
        """Each sampled sequence's tokens: its sample, or its drafts up to the first that
        differs from the sample before it plus that sample (recorded for the draft cost
        model); a sequence with a non-finite row gets none."""
        token_ids: dict[str, list[int]] = {}
        broken: list[Sequence] = []
        if output.sampler_output is not None:
            samples_of = output.sampler_output.token_ids.tolist()
            nonfinite = set(output.sampler_output.nonfinite_rows)
            for index, seq in enumerate(output.sampled_seqs):
                rows = output.rows_of(index)
                if nonfinite.intersection(rows):
                    broken.append(seq)
                    continue
                samples = samples_of[rows.start : rows.stop]
                if seq.draft_token_ids:
                    samples = accepted_prefix(seq.draft_token_ids, samples)
                    self._speculation.record(seq.seq_id, len(seq.draft_token_ids), len(samples) - 1)
                    # the draft's KV holds the drafts: valid up to the last accepted one
                    seq.num_draft_computed_tokens = min(
                        seq.num_draft_computed_tokens, seq.num_tokens + len(samples) - 1
                    )
                token_ids[seq.seq_id] = samples
        num_tokens_before = [seq.num_tokens for seq in output.sampled_seqs]
        return AcceptedTokens(token_ids, broken, num_tokens_before)

    def _process(self, output: RunnerOutput, accepted: AcceptedTokens) -> list[SequenceDelta]:
        """The step's deltas, after the scheduler's update: prompt logprobs are recorded,
        then each sequence's new tokens become a delta. A request whose processing raises
        fails alone; the batch goes on."""
        self.output_processor.add_prompt_logprobs(output.prompt_logprobs)
        deltas = []
        for seq in accepted.broken:
            if self.output_processor.has_sequence(seq.seq_id):
                deltas.extend(self._fail(seq, NonFiniteLogitsError()))
        for index, seq in enumerate(output.sampled_seqs):
            num_new = seq.num_tokens - accepted.num_tokens_before[index]
            if not self.output_processor.has_sequence(seq.seq_id) or num_new == 0:
                continue  # a sibling of a request that failed earlier in this loop
            try:
                request, _ = self.output_processor.owner(seq.seq_id)
                if self._faults is not None:
                    self._faults.on_sampled(
                        request.prompt_token_ids, seq.params, seq.num_output_tokens
                    )
                deltas.append(
                    self.output_processor.process_sampled(
                        seq, output.rows_of(index), num_new, output.sampler_output
                    )
                )
                if request.is_finished:
                    self._forget(request)
            except Exception as exc:  # this request alone fails; the batch goes on
                deltas.extend(self._fail(seq, exc))
        return deltas

    def _fail(self, seq: Sequence, exc: Exception) -> list[SequenceDelta]:
        """End the request of `seq` with an error: its sequences are aborted (blocks
        freed) and each one without its last delta yet gets one, finish_reason "error"."""
        request, index = self.output_processor.owner(seq.seq_id)
        message = f"{type(exc).__name__}: {exc}"
        logger.error("request %s failed inside the step: %s", request.request_id, message,
                     exc_info=exc)  # fmt: skip
        finished_now = seq.is_finished  # by this step: `abort` skips it, yet it had no delta
        deltas = self.abort(request.request_id)
        if finished_now:
            deltas.append(self.output_processor.delta(request, index, [], "", None, "abort", None))
        return [replace(d, finish_reason="error", error=message) for d in deltas]

    def _release_held_back(self) -> None:
        for request in list(self.output_processor.requests.values()):
            first = request.seqs[0]
            if request.held_back and (first.num_output_tokens > 0 or first.is_finished):
                self.scheduler.release_held_back(request.held_back)
                request.held_back = []

    # Adapters and bookkeeping ----------------------------------------------------------------
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

    def _forget(self, request: RequestState) -> None:
        if self.output_processor.remove(request):
            adapter = request.seqs[0].lora
            if adapter is not None and self.loras is not None:
                self.loras.release(adapter)
        for seq in request.seqs:
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
