"""The model runner: executes one scheduler plan on the model and samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelship.engine.sampler import SamplerOutput, SamplingMetadata, sample
from modelship.engine.scheduler import SchedulerOutput
from modelship.engine.sequence import Sequence
from modelship.model.attention import AttentionMetadata
from modelship.model.kv_cache import KVCache
from modelship.model.registry import CausalLM


@dataclass
class RunnerOutput:
    """Sampled tokens for the sequences whose computed tokens reached their tokens."""

    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput | None


class ModelRunner:
    """Reads sequences (never changes them), runs the model, returns sampled tokens."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.vocab_size

    def prepare_inputs(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
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
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            block_tables.append(seq.block_table)
            if end == seq.num_tokens:  # this step completes the sequence's known tokens
                sample_indices.append(len(token_ids) - 1)
                sampled_seqs.append(seq)
        attn_metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        return input_ids, position_ids, attn_metadata, sample_indices, sampled_seqs

    @torch.inference_mode()
    def execute(
        self, plan: SchedulerOutput, generators: dict[str, torch.Generator | None]
    ) -> RunnerOutput:
        """Run the plan's tokens through the model; sample for sequences that completed."""
        input_ids, positions, attn_metadata, sample_indices, sampled_seqs = self.prepare_inputs(
            plan
        )
        hidden = self.model(input_ids, positions, self.kv_caches, attn_metadata)
        if not sampled_seqs:
            return RunnerOutput([], None)
        index = torch.tensor(sample_indices, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [num_sampled, vocab]
        metadata = SamplingMetadata.build(
            params=[seq.params for seq in sampled_seqs],
            prompt_token_ids=[seq.token_ids[: seq.num_prompt_tokens] for seq in sampled_seqs],
            output_token_ids=[seq.output_token_ids for seq in sampled_seqs],
            generators=[generators.get(seq.request_id) for seq in sampled_seqs],
            vocab_size=self.vocab_size,
            device=logits.device,
        )
        return RunnerOutput(sampled_seqs, sample(logits, metadata))
