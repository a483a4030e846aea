"""The output processor: the engine's request table and what turns tokens into deltas.

A request with `n > 1` is n sequences; its `RequestState` holds them and the state of their
output: incremental detokenizers (which hold back text that may start a stop string),
prompt logprobs as chunked prefill computes them, and how many sequences have finished.
`process_sampled` turns one sequence's accepted tokens of a step into a `SequenceDelta`:
text, sampled logprobs, and a stop string that ends the sequence there (the tokens sampled
past it are dropped and the scheduler finishes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelship.engine.detokenizer import IncrementalDetokenizer
from modelship.engine.model_runner import PromptLogprobs
from modelship.engine.outputs import SequenceDelta, TokenLogprob
from modelship.engine.sampler import SamplerOutput
from modelship.engine.sampling_params import SamplingParams
from modelship.engine.scheduler import Scheduler
from modelship.engine.sequence import Sequence


@dataclass
class RequestState:
    """One request in the engine: its sequences and their output state.

    Per-sequence state sits in lists indexed like `seqs` (`detokenizers`). State a request
    carries for its whole life goes here too: a constraint on what may be sampled (a
    structured-output grammar matcher) would be one more per-sequence list, since siblings
    diverge, built in `OutputProcessor.create` beside the detokenizers, advanced on the
    accepted tokens in `process_sampled`, and read for the token mask before sampling."""

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

    @property
    def is_finished(self) -> bool:
        return self.num_finished == len(self.seqs)


class OutputProcessor:
    """Owns the table of requests in the engine and builds their deltas.

    The engine adds a request once the scheduler has admitted it and removes it when its
    last sequence has finished or it is aborted; `process_sampled` changes a sequence only
    to cut it at a stop string (through the scheduler, which frees its blocks)."""

    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests: dict[str, RequestState] = {}
        self._seq_owner: dict[str, tuple[RequestState, int]] = {}

    # The table -------------------------------------------------------------------------------
    def create(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
    ) -> RequestState:
        """A request's state, its siblings held back; not in the table until `add`."""
        detokenizers = [_detokenizer(self.tokenizer, prompt_token_ids, params) for _ in seqs]
        return RequestState(
            request_id, prompt_token_ids, params, seqs, detokenizers, held_back=seqs[1:]
        )

    def add(self, request: RequestState) -> None:
        self.requests[request.request_id] = request
        for index, seq in enumerate(request.seqs):
            self._seq_owner[seq.seq_id] = (request, index)

    def remove(self, request: RequestState) -> bool:
        """Take the request out of the table; False if it was not in it."""
        for seq in request.seqs:
            self._seq_owner.pop(seq.seq_id, None)
        return self.requests.pop(request.request_id, None) is not None

    def owner(self, seq_id: str) -> tuple[RequestState, int]:
        """The request a sequence belongs to, and the sequence's index in it."""
        return self._seq_owner[seq_id]

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seq_owner

    # Outputs ---------------------------------------------------------------------------------
    def add_prompt_logprobs(self, chunks: dict[str, PromptLogprobs]) -> None:
        """Append a step's prompt logprobs, by sequence id, to their requests."""
        for seq_id, chunk in chunks.items():
            request, _ = self._seq_owner[seq_id]
            known = len(request.prompt_logprobs)  # a recomputed (preempted) prompt repeats
            request.prompt_logprobs.extend(chunk.entries[max(0, known - chunk.first) :])

    def process_sampled(
        self, seq: Sequence, rows: range, num_new: int, sampler_output: SamplerOutput
    ) -> SequenceDelta:
        """The delta of the `num_new` tokens `seq` got this step (more than one when drafts
        were accepted), `rows` their sampler rows; a stop string inside them ends it there,
        the rest is dropped. Counts the sequence as finished when it is."""
        request, index = self._seq_owner[seq.seq_id]
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
        delta = self.delta(request, index, kept, text, logprobs, finish_reason, stop_reason)
        if params.prompt_logprobs is not None and seq.num_output_tokens == len(kept):
            delta.prompt_logprobs = list(request.prompt_logprobs)
        if params.pooling is not None and seq.num_output_tokens == len(kept):
            delta.embedding = seq.embedding  # pooled as its prompt was computed
        if seq.is_finished:
            request.num_finished += 1
        return delta

    def delta(
        self,
        request: RequestState,
        index: int,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> SequenceDelta:
        """Sequence `index` of `request`'s delta; the last one (a finish reason) carries the
        time the sequence waited for its first step."""
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


def _token_logprob(
    sampler_output: SamplerOutput, row: int, token_id: int, num_top: int
) -> TokenLogprob:
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
