"""Draft-model speculation: a smaller model of the target's tokenizer proposes k tokens
autoregressively, with its probabilities q, for the target to verify in one step
(`engine.speculative.verify_draft_probs`).

The draft keeps its own paged KV cache (tensors shaped for the draft) addressed through the
target's block tables: same block ids, same slots, so the scheduler's allocation covers both
and a rejected draft's slots go back with the target's. Each sequence counts the leading
tokens whose draft KV is computed (`Sequence.num_draft_computed_tokens`); a proposal first
catches up on the rest (the prompt, the tokens accepted last step) in one batched pass, then
runs k - 1 one-token steps. Drafting runs after the scheduler has reserved the draft slots
(the engine plans with placeholder drafts, the scheduler trims or drops them, then
`propose` fills in the tokens).

Prefix-cache hits: a cached block's draft KV may never have been computed (no draft ran
when it was filled) or may be stale, so a sequence's count starts at 0 and the draft
recomputes from the start of the sequence, writing the draft slots of shared blocks with
the same values any other holder wrote (same tokens, same positions, same draft).
Preemption frees the blocks and resets the count.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from modelship.engine.sampler import SamplingMetadata, process_logits, random_sample
from modelship.engine.sequence import Sequence
from modelship.engine.tokenizer import load_tokenizer
from modelship.model.attention import AttentionMetadata, resolve_attention_backend
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import allocate_kv_cache
from modelship.model.loader import load_model

logger = logging.getLogger(__name__)


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (another vocabulary or tokenizer)."""


def check_same_tokenizer(draft_path: Path, target_path: Path, target_tokenizer) -> None:
    """Raise `DraftModelError` unless the draft's vocabulary size and tokenizer (its token
    to id map) are the target's: a draft token id must mean the same text to both."""
    draft_config = ModelConfig.from_dir(draft_path)
    target_config = ModelConfig.from_dir(target_path)
    if draft_config.vocab_size != target_config.vocab_size:
        raise DraftModelError(
            f"speculative model {draft_path}: vocab_size {draft_config.vocab_size} differs "
            f"from the target's {target_config.vocab_size} ({target_path}); a draft model "
            "must share the target's tokenizer"
        )
    if load_tokenizer(draft_path).get_vocab() != target_tokenizer.get_vocab():
        raise DraftModelError(
            f"speculative model {draft_path}: its tokenizer differs from the target's "
            f"({target_path}); a draft model must share the target's tokenizer"
        )


class DraftModel:
    """The draft model, its KV cache and its proposer. Reads the target's block tables,
    writes only its own cache and the sequences' draft fields."""

    def __init__(
        self,
        path: str | Path,
        target_path: Path,
        target_tokenizer,
        *,
        num_blocks: int,
        block_size: int,
        cache_dtype: torch.dtype,
        attention_backend: str,
        device: torch.device,
        dtype: str | None,
        max_model_len: int,
        int4_kernel: str = "auto",
        lm_head: str = "auto",
        fused_decoder: bool = True,
    ) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise DraftModelError(f"speculative model {self.path}: no config.json there")
        check_same_tokenizer(self.path, target_path, target_tokenizer)
        self.model = load_model(  # the target's loader and switches: any checkpoint it loads
            self.path,
            device=device,
            dtype=dtype,
            max_positions=max_model_len,
            int4_kernel=int4_kernel,
            lm_head=lm_head,
            fused_decoder=fused_decoder,
        )
        self.kv_caches = allocate_kv_cache(
            self.model.config, num_blocks, block_size, cache_dtype, device
        )
        self.attention_backend = resolve_attention_backend(attention_backend, device, cache_dtype)
        self.block_size = block_size
        self.device = device
        self.vocab_size = self.model.config.vocab_size
        logger.info(
            "draft model %s: %d layers, attention %s",
            self.path,
            self.model.config.num_layers,
            self.attention_backend,
        )

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], generators: dict[str, torch.Generator | None]) -> None:
        """Replace each sequence's placeholder drafts (their number is what the scheduler
        reserved slots for) with the draft model's tokens, and set `draft_probs` (sampled
        requests) and `num_draft_computed_tokens`."""
        seqs = [seq for seq in seqs if seq.draft_token_ids]
        if not seqs:
            return
        num_drafts = {seq.seq_id: len(seq.draft_token_ids) for seq in seqs}
        drafts: dict[str, list[int]] = {seq.seq_id: [] for seq in seqs}
        probs: dict[str, list[torch.Tensor]] = {seq.seq_id: [] for seq in seqs}
        # Step 0: catch up on the tokens without draft KV, up to and including the last.
        starts = [min(seq.num_draft_computed_tokens, seq.num_tokens - 1) for seq in seqs]
        token_ids = [t for seq, s in zip(seqs, starts, strict=True) for t in seq.token_ids[s:]]
        positions = [p for seq, s in zip(seqs, starts, strict=True)
                     for p in range(s, seq.num_tokens)]  # fmt: skip
        query_lens = [seq.num_tokens - s for seq, s in zip(seqs, starts, strict=True)]
        seq_lens = [seq.num_tokens for seq in seqs]
        active = seqs
        for step in range(max(num_drafts.values())):
            if step:
                active = [seq for seq in active if num_drafts[seq.seq_id] > step]
                token_ids = [drafts[seq.seq_id][-1] for seq in active]
                positions = [seq.num_tokens + step - 1 for seq in active]
                query_lens = [1] * len(active)
                seq_lens = [seq.num_tokens + step for seq in active]
            meta = AttentionMetadata.build(
                query_lens,
                seq_lens,
                [seq.block_table for seq in active],
                self.block_size,
                self.device,
                self.attention_backend,
            )
            hidden = self.model(
                torch.tensor(token_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_caches,
                meta,
            )
            last_rows = torch.tensor(
                [sum(query_lens[: i + 1]) - 1 for i in range(len(active))], device=hidden.device
            )
            logits = self.model.compute_logits(hidden.index_select(0, last_rows)).float()
            self._sample(active, logits, drafts, probs, generators)
        for seq in seqs:
            count = num_drafts[seq.seq_id]
            seq.draft_token_ids = drafts[seq.seq_id]
            seq.draft_probs = torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None
            # KV written: every known token and the drafts but the last
            seq.num_draft_computed_tokens = seq.num_tokens + count - 1

    def _sample(self, seqs, logits, drafts, probs, generators) -> None:
        """One draft token per row, drawn from the draft's distribution under the request's
        own processing (penalties see the drafts so far as output, as the target's rows do);
        greedy requests take its argmax and keep no probabilities."""
        metadata = SamplingMetadata.build(
            params=[seq.params for seq in seqs],
            prompt_token_ids=[seq.token_ids[: seq.num_prompt_tokens] for seq in seqs],
            output_token_ids=[seq.output_token_ids + drafts[seq.seq_id] for seq in seqs],
            generators=[generators.get(seq.seq_id) for seq in seqs],
            vocab_size=self.vocab_size,
            device=logits.device,
        )
        penalized, scaled = process_logits(logits, metadata)
        tokens = penalized.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if scaled is not None and not seq.params.is_greedy:
                q = scaled[row].softmax(dim=-1)
                tokens[row] = int(random_sample(q[None], [metadata.generators[row]])[0])
                probs[seq.seq_id].append(q)
            drafts[seq.seq_id].append(tokens[row])
