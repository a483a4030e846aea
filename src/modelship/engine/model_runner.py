"""The model runner: executes one scheduler plan on the model and samples the next tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from modelship.engine.cuda_graphs import DecodeGraphRunner
from modelship.engine.outputs import TokenLogprob
from modelship.engine.sampler import SamplerOutput, SamplingMetadata, sample
from modelship.engine.scheduler import SchedulerOutput
from modelship.engine.sequence import Sequence
from modelship.engine.speculative import DraftCheck, verify_draft_probs
from modelship.engine.structured import BitmaskFiller, grammar_rows
from modelship.model.attention import AttentionMetadata
from modelship.model.kv_cache import KVCache
from modelship.model.registry import CausalLM


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens `first .. first + len(entries) - 1` (by position) of one
    sequence, computed in one step; chunked prefill produces them a chunk at a time."""

    first: int
    entries: list[TokenLogprob]


@dataclass
class RunnerOutput:
    """Sampled tokens for the sequences whose computed tokens reached their tokens: one row
    each, or 1 + its drafts for a sequence that verified drafts (`rows_of`)."""

    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # where each sampled sequence's rows start, and one past the last row
    row_starts: list[int] = field(default_factory=lambda: [0])

    def rows_of(self, index: int) -> range:
        """The sampler rows of `sampled_seqs[index]`, in position order."""
        return range(self.row_starts[index], self.row_starts[index + 1])


class ModelRunner:
    """Reads sequences (never changes them), runs the model, returns sampled tokens.

    With a `graph_runner` (captured by the caller), decode-only steps it can take run from
    its graphs; prefill and mixed steps, and batches above its largest size, run eagerly.
    Logits and sampling are always eager."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        attention_backend: str = "sdpa",
        graph_runner: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        # "cpu", "triton" or "sdpa", resolved by the engine
        self.attention_backend = attention_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.graph_runner = graph_runner
        self._bitmasks: BitmaskFiller | None = None  # made at the first constrained step

    def prepare_inputs(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        """Flatten the plan's tokens into one batch; the rows to sample and their sequences."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_indices: list[int] = []
        sampled_seqs: list[Sequence] = []
        for scheduled in plan.scheduled:
            seq, num_new = scheduled.seq, scheduled.num_new_tokens
            start = seq.num_computed_tokens
            end = start + num_new
            token_ids.extend(seq.token_ids[start:end])
            token_ids.extend(seq.draft_token_ids)  # verified after the last known token
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            block_tables.append(seq.block_table)
            if end == seq.num_tokens + len(seq.draft_token_ids):  # completes its known tokens
                num_rows = 1 + len(seq.draft_token_ids)
                sample_indices.extend(range(len(token_ids) - num_rows, len(token_ids)))
                sampled_seqs.append(seq)
        attn_metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device, self.attention_backend
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        return input_ids, position_ids, attn_metadata, sample_indices, sampled_seqs

    @torch.inference_mode()
    def execute(
        self, plan: SchedulerOutput, generators: dict[str, torch.Generator | None]
    ) -> RunnerOutput:
        """Run the plan's tokens through the model; sample for sequences that completed."""
        lora = getattr(self.model, "lora", None)
        has_lora = lora is not None and any(s.seq.lora is not None for s in plan.scheduled)
        if not has_lora and self.graph_runner is not None and self.graph_runner.can_replay(plan):
            seqs = [scheduled.seq for scheduled in plan.scheduled]
            hidden = self.graph_runner.replay(seqs)  # [num_seqs, hidden], one row each
            sample_indices = [
                row for row, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens
            ]
            sampled_seqs = [seqs[row] for row in sample_indices]
        else:
            input_ids, positions, attn_metadata, sample_indices, sampled_seqs = self.prepare_inputs(
                plan
            )
            if has_lora:  # the step's rows grouped by adapter, read by the projection hooks
                lora.segments = self._lora_segments(plan)
            try:
                hidden = self.model(input_ids, positions, self.kv_caches, attn_metadata)
            finally:
                if has_lora:
                    lora.segments = []
        prompt_logprobs = self._prompt_logprobs(plan, hidden)
        self._pool(plan, hidden)
        if not sampled_seqs:
            return RunnerOutput([], None, prompt_logprobs)
        index = torch.tensor(sample_indices, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [num_rows, vocab]
        # One row per sampled token position; a verified draft row sees the drafts before
        # it as output (penalties), as it would have without speculation.
        rows = [(seq, seq.draft_token_ids[:j]) for seq in sampled_seqs
                for j in range(1 + len(seq.draft_token_ids))]  # fmt: skip
        metadata = SamplingMetadata.build(
            params=[seq.params for seq, _ in rows],
            prompt_token_ids=[seq.token_ids[: seq.num_prompt_tokens] for seq, _ in rows],
            output_token_ids=[seq.output_token_ids + drafts for seq, drafts in rows],
            generators=[generators.get(seq.seq_id) for seq, _ in rows],
            vocab_size=self.vocab_size,
            device=logits.device,
        )
        row_starts = list(accumulate((1 + len(seq.draft_token_ids) for seq in sampled_seqs),
                                     initial=0))  # fmt: skip
        constrained = grammar_rows(sampled_seqs, row_starts)
        if constrained:  # structured outputs: the tokens each grammar allows next
            self._bitmasks = self._bitmasks or BitmaskFiller()
            metadata.token_bitmask = self._bitmasks.fill(
                constrained, row_starts[-1], self.vocab_size
            )
        # Drafts that come with a draft model's probabilities: the speculative-sampling rule
        checks = [
            DraftCheck(start, seq.draft_token_ids, seq.draft_probs, generators.get(seq.seq_id))
            for seq, start in zip(sampled_seqs, row_starts, strict=False)
            if seq.draft_probs is not None and seq.draft_token_ids and not seq.params.is_greedy
        ]

        def verify(_, scaled, token_ids) -> None:
            verify_draft_probs(scaled, token_ids, checks)

        output = sample(logits, metadata, verify if checks else None)
        return RunnerOutput(sampled_seqs, output, prompt_logprobs, row_starts)

    @staticmethod
    def _pool(plan: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Embedding requests (`params.pooling`): each prompt's final hidden states pooled
        chunk by chunk as they are computed, the embedding set on the sequence once its
        whole prompt is. Mean pooling counts a position once: a preempted sequence's
        recomputed rows are skipped (`pooled_upto`), and its requests share no cached
        prefix (the server gives them a salt of their own), so no position goes uncounted."""
        row = 0
        for scheduled in plan.scheduled:
            seq, num_new = scheduled.seq, scheduled.num_new_tokens
            pooling, start = seq.params.pooling, seq.num_computed_tokens
            end = min(start + num_new, seq.num_prompt_tokens)
            if pooling == "mean" and end > max(start, seq.pooled_upto):
                first = max(start, seq.pooled_upto)
                rows = hidden[row + first - start : row + end - start].float().sum(0)
                seq.pooled = rows if seq.pooled is None else seq.pooled + rows
                seq.pooled_upto = end
            elif pooling == "last" and start < end == seq.num_prompt_tokens:
                seq.pooled = hidden[row + end - 1 - start].float()
            if pooling and end == seq.num_prompt_tokens and seq.embedding is None:
                mean = pooling == "mean"
                vector = seq.pooled / seq.num_prompt_tokens if mean else seq.pooled
                seq.embedding = vector.tolist()
            row += num_new

    def _lora_segments(self, plan: SchedulerOutput) -> list:
        """(adapter, row indices) per adapter present, rows in `prepare_inputs` order."""
        rows: dict[str, tuple[object, list[int]]] = {}
        row = 0
        for scheduled in plan.scheduled:
            seq = scheduled.seq
            count = scheduled.num_new_tokens  # drafts included
            if seq.lora is not None:
                rows.setdefault(seq.lora.key, (seq.lora, []))[1].extend(range(row, row + count))
            row += count
        return [
            (adapter, torch.tensor(indices, dtype=torch.long, device=self.device))
            for adapter, indices in rows.values()
        ]

    def _prompt_logprobs(
        self, plan: SchedulerOutput, hidden: torch.Tensor
    ) -> dict[str, PromptLogprobs]:
        """For sequences that asked for prompt logprobs: the logprob of each prompt token
        this step can score (the hidden state at position p predicts the token at p + 1)."""
        result: dict[str, PromptLogprobs] = {}
        row = 0
        for scheduled in plan.scheduled:
            seq, num_new = scheduled.seq, scheduled.num_new_tokens
            start = seq.num_computed_tokens
            num_top = seq.params.prompt_logprobs
            end = min(start + num_new, seq.num_prompt_tokens - 1)  # last scorable position + 1
            if num_top is not None and end > start:
                rows = hidden[row : row + end - start]
                logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                targets = torch.tensor(seq.token_ids[start + 1 : end + 1], device=rows.device)
                chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
                top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
                entries = []
                for i, token_id in enumerate(targets.tolist()):
                    top = {}
                    if top_ids is not None:
                        top = dict(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True))
                    entries.append(TokenLogprob(token_id, chosen[i], top))
                result[seq.seq_id] = PromptLogprobs(start + 1, entries)
            row += num_new
        return result

    # Scoring -------------------------------------------------------------------------------
    @torch.inference_mode()
    def score(
        self, sequences: list[list[int]], max_batch_tokens: int = 4096
    ) -> Iterator[torch.Tensor]:
        """For each sequence, [len - 1, vocab] float32 log-softmax of every next token: a
        teacher-forced pass with the serving kernels, no sampling. The KV cache is scratch
        space here (blocks from 0 up): call only while no request holds blocks."""
        num_blocks = self.kv_caches[0].kv.shape[0] // self.block_size
        for batch in self._score_batches(sequences, num_blocks, max_batch_tokens):
            query_lens = [len(s) for s in batch]
            tables, next_block = [], 0
            for length in query_lens:
                count = -(-length // self.block_size)
                tables.append(list(range(next_block, next_block + count)))
                next_block += count
            metadata = AttentionMetadata.build(
                query_lens, query_lens, tables, self.block_size, self.device, self.attention_backend
            )
            ids = torch.tensor([t for s in batch for t in s], device=self.device)
            positions = torch.tensor([p for s in batch for p in range(len(s))], device=self.device)
            hidden = self.model(ids, positions, self.kv_caches, metadata)
            start = 0
            for length in query_lens:
                rows = hidden[start : start + length - 1]
                yield torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                start += length

    def _score_batches(
        self, sequences: list[list[int]], num_blocks: int, max_batch_tokens: int
    ) -> Iterator[list[list[int]]]:
        batch: list[list[int]] = []
        blocks = 0
        for seq in sequences:
            need = -(-len(seq) // self.block_size)
            if need > num_blocks:
                raise ValueError(f"a {len(seq)}-token sequence does not fit the KV cache")
            if blocks + need > num_blocks or sum(map(len, batch)) + len(seq) > max_batch_tokens:
                yield batch
                batch, blocks = [], 0
            batch.append(seq)
            blocks += need
        if batch:
            yield batch
