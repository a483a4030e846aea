"""The engine options a user sets, defined once: `pipeline.yaml`'s `serve.engine` section,
the `modelship serve` flags (name, default and help: `modelship.flags`) and the flags a
replica is started with (`cli_args`). A leaf: pydantic only, so reading a config never
imports torch.
`to_engine_config` makes the engine's own `EngineConfig` (bytes, not MiB)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from modelship.engine.devices import check_device_name
from modelship.flags import Flag, flag_args


class EngineOptions(BaseModel):
    """Each field is a `modelship serve` flag (`modelship.flags`): its description the help."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(
        default="cpu", description="cpu, cuda (cuda:N) or auto (cuda where there is one)."
    )
    # vLLM's spellings too: auto (the default), half, float
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"] | None,
        Flag(none_as="auto", value_aliases=(("half", "float16"), ("float", "float32"))),
    ] = Field(
        default=None,
        description="Compute dtype: float32, bfloat16 or float16 (half), or auto: per device "
        "and checkpoint.",
    )
    max_model_len: int | None = Field(  # None: the model's own
        default=None, ge=16, description="Context length cap (default: the model's)."
    )
    max_num_seqs: int = Field(default=64, ge=1, description="Sequences per step.")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="Token budget per step.")
    max_prefill_chunk: int = Field(
        default=256, ge=1, description="Most prompt tokens in a step that also decodes streams."
    )
    kv_cache_memory_mb: int = Field(default=512, ge=1, description="KV cache budget in MiB.")
    # vLLM sizes its cache as a share of the GPU; here the share is of what is free once the
    # weights are in (GPU memory on CUDA, available RAM on CPU), which is what the cache gets
    kv_cache_memory_fraction: Annotated[
        float | None, Flag(aliases=("--gpu-memory-utilization",))
    ] = Field(
        default=None,
        gt=0,
        le=1,
        description="KV cache budget as a fraction of the memory free after the weights "
        "loaded (GPU on CUDA, RAM on CPU); replaces --kv-cache-memory-mb. Also spelled "
        "--gpu-memory-utilization.",
    )
    # None ("auto" as a flag): fp32 on CPU, the compute dtype on CUDA; int8: ~3.7x the
    # blocks of fp32 in the same memory (one fp32 scale per key/value head vector); fp8
    # (e4m3, alias fp8_e4m3): as many blocks as int8, read by SDPA attention
    kv_cache_dtype: Annotated[
        Literal["float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"] | None,
        Flag(none_as="auto"),
    ] = Field(
        default=None,
        description="KV cache dtype (auto: fp32 on CPU, the compute dtype on CUDA); int8 holds "
        "~3.7x the tokens of fp32 in the same memory (CPU kernel and SDPA backends); fp8 "
        "(e4m3) as many (SDPA backend).",
    )
    # the output head's numerics on CPU (`model.quant.int8`, `model.quant.int4_head`); select
    # measures int4 as a candidate of its own and a release records the choice it was
    # measured with, which auto then serves (`with_measured`)
    lm_head: Literal["auto", "int8", "int4", "dense"] = Field(
        default="auto",
        description="Output head numerics (CPU): int8, int4 (4-bit, groups of 64, "
        "round-to-nearest at load; tied embeddings read from it too), dense (the checkpoint's "
        "weights), or auto: what the release was measured with, else int8 for quantized "
        "checkpoints.",
    )
    block_size: int = Field(default=16, ge=1, description="Tokens per KV block.")
    adaptive_threads: bool = Field(
        default=True,
        description="CPU: run each step on one thread or on all, whichever recent steps of "
        "its size ran faster (a busy host makes one thread win; tokens never change).",
    )
    max_waiting_requests: int = Field(
        default=1024, ge=0, description="Queue bound before 429 (requests)."
    )
    prefix_caching: Annotated[
        bool, Flag(aliases=("--enable-prefix-caching/--no-enable-prefix-caching",))
    ] = Field(
        default=True,
        description="Reuse cached prompt blocks (also spelled --enable-prefix-caching).",
    )
    # decode steps from captured CUDA graphs on a CUDA device (no effect on CPU), for
    # batches of up to this many sequences
    cuda_graphs: Annotated[bool, Flag(aliases=(" /--enforce-eager",))] = Field(
        default=True,
        description="Decode steps from captured CUDA graphs (CUDA devices only); "
        "--enforce-eager is --no-cuda-graphs.",
    )
    cuda_graph_max_batch_size: int = Field(
        default=256,
        ge=1,
        le=256,
        description="Largest decode batch captured (up to 256); larger run eagerly.",
    )
    # prompt-lookup speculative decoding: draft tokens verified per step (0: off), for
    # requests that ask (`"speculative": true`) or, with speculative_by_default, all that
    # do not refuse; only in steps of at most speculative_max_batch_size sequences
    num_speculative_tokens: int = Field(
        default=0,
        ge=0,
        le=16,
        description="Speculative decoding (prompt lookup, or --speculative-model): draft "
        'tokens verified per step (0: off). Requests opt in with "speculative": true; the '
        "same output distribution either way.",
    )
    speculative_by_default: bool = Field(
        default=False, description='Speculate for requests that do not say ("speculative").'
    )
    speculative_max_batch_size: int = Field(
        default=2, ge=1, description="No drafts in steps with more running sequences than this."
    )
    # a drafted token's share of a plain decode step's time, from which each sequence picks
    # how many tokens to draft (`engine.speculative`): ~0.3 on a 2-core CPU, ~0.02 on a GPU
    speculative_draft_token_cost: float = Field(
        default=0.3,
        ge=0,
        description="A drafted token's share of a plain decode step's time (about 0.3 on a "
        "2-core CPU, 0.02 on a GPU): each sequence drafts as many tokens as pay for it.",
    )
    # Megatron-style tensor parallelism over this many processes (GPUs per pod on
    # Kubernetes); dense checkpoints only (`engine.tensor_parallel`)
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Shard attention and MLP over this many processes (Megatron-style; gloo "
        "on CPU, NCCL on CUDA, one GPU each); dense checkpoints only.",
    )
    # mixture-of-experts models over the tensor-parallel ranks: whole experts per rank
    # (`model.tensor_parallel`); vLLM spells it --enable-expert-parallel
    expert_parallel: Annotated[
        bool, Flag(aliases=("--enable-expert-parallel/--no-enable-expert-parallel",))
    ] = Field(
        default=False,
        description="Mixture-of-experts models: shard the experts over the "
        "--tensor-parallel-size ranks (whole experts per rank; their count must divide).",
    )
    # a draft model's folder (same tokenizer as the served model): draft-model speculation
    # instead of prompt lookup; needs num_speculative_tokens
    speculative_model: str | None = Field(
        default=None,
        description="Draft model folder (a smaller model of the same tokenizer) for "
        "speculative decoding; needs --num-speculative-tokens. Without it: prompt lookup.",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        return check_device_name(device)

    @field_validator("lm_head")
    @classmethod
    def _head_on_cpu(cls, lm_head: str, info: ValidationInfo) -> str:
        device = info.data.get("device", "cpu")
        if lm_head in ("int8", "int4") and device.startswith("cuda"):
            raise ValueError(
                f"lm_head {lm_head} runs on modelship's CPU kernels, not on {device}: use auto "
                "or dense there"
            )
        return lm_head

    @model_validator(mode="after")
    def _draft_needs_tokens(self) -> EngineOptions:
        if self.speculative_model and not self.num_speculative_tokens:
            raise ValueError(
                "speculative_model needs num_speculative_tokens (draft tokens per step) >= 1"
            )
        return self

    def to_engine_config(self):
        """The engine's `EngineConfig`: fields of the same name as they are (so a new knob
        needs no line here), the rest converted."""
        from dataclasses import fields

        from modelship.engine.config import EngineConfig

        same = {field.name for field in fields(EngineConfig)} & type(self).model_fields.keys()
        values = {name: getattr(self, name) for name in same}
        return EngineConfig(
            **values | {"device": resolve_device(self.device)},
            kv_cache_memory_bytes=self.kv_cache_memory_mb * 1024**2,
            enable_prefix_caching=self.prefix_caching,
            speculative=self.speculative_config(),
        )

    def with_measured(self, measured: Mapping[str, Any]) -> EngineOptions:
        """These options with the served numerics a release was measured with (select
        records them in its manifest: `pipeline.select.candidates`) wherever they are left
        at auto; a value set explicitly wins. Not on a GPU: select measures on the CPU, and
        there the head stays what auto gives."""
        lm_head = measured.get("lm_head")
        if lm_head in (None, "auto") or self.lm_head != "auto":
            return self
        if resolve_device(self.device) != "cpu":
            return self
        return type(self).model_validate(self.model_dump() | {"lm_head": lm_head})

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
        """The same options as `modelship serve` flags, every one given (a replica's command
        line says it all)."""
        return flag_args(self)


def resolve_device(device: str) -> str:
    """`auto` as the device this machine has: cuda where torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
