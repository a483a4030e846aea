"""The engine options a user sets, defined once: `pipeline.yaml`'s `serve.engine` section,
the `modelship serve` flags (their defaults are these) and the flags a replica is started
with (`cli_args`). A leaf: pydantic only, so reading a config never imports torch.
`to_engine_config` makes the engine's own `EngineConfig` (bytes, not MiB)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_model_len: int | None = Field(default=None, ge=16)  # None: the model's own
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_prefill_chunk: int = Field(default=256, ge=1)
    kv_cache_memory_mb: int = Field(default=512, ge=1)
    # None ("auto" as a flag): fp32 on CPU, the compute dtype on CUDA; int8: ~3.7x the
    # blocks of fp32 in the same memory (one fp32 scale per key/value head vector); fp8
    # (e4m3, alias fp8_e4m3): as many blocks as int8, read by SDPA attention
    kv_cache_dtype: Literal["float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"] | None = (
        None
    )
    block_size: int = Field(default=16, ge=1)
    max_waiting_requests: int = Field(default=1024, ge=0)
    prefix_caching: bool = True
    # decode steps from captured CUDA graphs on a CUDA device (no effect on CPU), for
    # batches of up to this many sequences
    cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = Field(default=256, ge=1, le=256)
    # prompt-lookup speculative decoding: draft tokens verified per step (0: off), for
    # requests that ask (`"speculative": true`) or, with speculative_by_default, all that
    # do not refuse; only in steps of at most speculative_max_batch_size sequences
    num_speculative_tokens: int = Field(default=0, ge=0, le=16)
    speculative_by_default: bool = False
    speculative_max_batch_size: int = Field(default=2, ge=1)
    # a drafted token's share of a plain decode step's time, from which each sequence picks
    # how many tokens to draft (`engine.speculative`): ~0.3 on a 2-core CPU, ~0.02 on a GPU
    speculative_draft_token_cost: float = Field(default=0.3, ge=0)
    # Megatron-style tensor parallelism over this many processes (GPUs per pod on
    # Kubernetes); dense checkpoints only (`engine.tensor_parallel`)
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    # a draft model's folder (same tokenizer as the served model): draft-model speculation
    # instead of prompt lookup; needs num_speculative_tokens
    speculative_model: str | None = None

    @model_validator(mode="after")
    def _draft_needs_tokens(self) -> EngineOptions:
        if self.speculative_model and not self.num_speculative_tokens:
            raise ValueError(
                "speculative_model needs num_speculative_tokens (draft tokens per step) >= 1"
            )
        return self

    def to_engine_config(self):
        from modelship.engine.config import EngineConfig

        return EngineConfig(
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_chunk=self.max_prefill_chunk,
            kv_cache_memory_bytes=self.kv_cache_memory_mb * 1024**2,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            max_waiting_requests=self.max_waiting_requests,
            enable_prefix_caching=self.prefix_caching,
            cuda_graphs=self.cuda_graphs,
            cuda_graph_max_batch_size=self.cuda_graph_max_batch_size,
            speculative=self.speculative_config(),
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def speculative_config(self):
        from modelship.engine.speculative import SpeculativeConfig

        if not self.num_speculative_tokens:
            return None
        return SpeculativeConfig(
            num_tokens=self.num_speculative_tokens,
            by_default=self.speculative_by_default,
            max_batch_size=self.speculative_max_batch_size,
            method="draft" if self.speculative_model else "ngram",
            draft_model=self.speculative_model,
            draft_token_cost=self.speculative_draft_token_cost,
        )

    def cli_args(self) -> list[str]:
        """The same options as `modelship serve` flags (only those that differ from the
        defaults are needed, but all are given: a replica's command line says it all)."""
        args = ["--device", self.device]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        args += [
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-prefill-chunk", str(self.max_prefill_chunk),
            "--kv-cache-memory-mb", str(self.kv_cache_memory_mb),
            "--kv-cache-dtype", self.kv_cache_dtype or "auto",
            "--block-size", str(self.block_size),
            "--max-waiting-requests", str(self.max_waiting_requests),
            "--prefix-caching" if self.prefix_caching else "--no-prefix-caching",
            "--cuda-graphs" if self.cuda_graphs else "--no-cuda-graphs",
            "--cuda-graph-max-batch-size", str(self.cuda_graph_max_batch_size),
            "--num-speculative-tokens", str(self.num_speculative_tokens),
            "--speculative-by-default" if self.speculative_by_default
            else "--no-speculative-by-default",
            "--speculative-max-batch-size", str(self.speculative_max_batch_size),
            "--speculative-draft-token-cost", str(self.speculative_draft_token_cost),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
        ]  # fmt: skip
        if self.speculative_model:
            args += ["--speculative-model", self.speculative_model]
        return args
