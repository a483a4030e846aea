"""Engine configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from modelship.engine.speculative import SpeculativeConfig
from modelship.engine.step_threads import check_step_threads
from modelship.model.attention import ATTENTION_BACKENDS
from modelship.model.quant.int4 import INT4_KERNELS
from modelship.model.quant.int8 import LM_HEADS

# The largest batch a decode step replays from a captured graph (`cuda_graphs.py`'s ladder
# ends here). Defined here, not there: cuda_graphs reads the scheduler's plan, which reads
# this config, so the config must not import cuda_graphs.
MAX_GRAPH_BATCH_SIZE = 256


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance.

    `dtype` is the compute dtype of the weights and activations; None picks bf16 on CPU
    (the int4/int8 CPU kernels are only fast with bf16 activations); on CUDA bf16 for
    W4A16 checkpoints on sm80+ GPUs (the tinygemm int4 kernel is bf16-only), else the
    checkpoint's half-precision dtype (fp16 for fp32); `model.loader.resolve_dtype` decides.
    The KV cache is kept in `kv_cache_dtype`; None picks fp32
    on CPU (fp32 SDPA with GQA is fast and exact there, bf16 SDPA is several times slower
    for decode) and the compute dtype on CUDA. "int8" stores each key and value head vector
    as int8 with one fp32 scale (`model.kv_cache`): ~3.7x the blocks of fp32 in the same
    memory at head_dim 64, read by the CPU kernel and SDPA (not by the Triton kernel).
    "fp8" (alias "fp8_e4m3") stores them as float8_e4m3fn with the same per-vector fp32
    scale (absmax / 448): as many blocks as int8, finer steps near zero, coarser near the
    absmax; read by SDPA only ("auto" attention picks it for an fp8 cache).
    """

    device: str = "cpu"
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024**2
    # set: the budget is this share of the memory free once the weights are loaded (the
    # device's on CUDA, available RAM on CPU) instead of `kv_cache_memory_bytes`
    kv_cache_memory_fraction: float | None = None
    num_kv_blocks: int | None = None  # overrides the memory budget when set (tests)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # While any sequence decodes, a step computes at most this many prompt tokens, so new
    # arrivals stall the running streams by one bounded chunk; a step that decodes nothing
    # takes up to `max_num_batched_tokens` of prompt.
    max_prefill_chunk: int = 256
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1_000_000
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    # CPU: torch threads per step by the step's token count, as (most tokens, threads)
    # pairs in increasing order; larger steps keep the engine's threads (`num_threads`,
    # else torch's). ((1, 1),) runs batch-1 decode steps on one thread. The kernels compute
    # each output the same way on any thread count, so this changes time, never tokens
    # (`engine.step_threads`; docs/performance.md, "Threads per step").
    step_threads: tuple[tuple[int, int], ...] = ()
    # CPU, one rank, 2+ threads, no step_threads rule for the step: each step runs on one
    # thread or on all, whichever recent steps of its size ran faster (timed as it serves;
    # `engine.step_threads.AdaptiveThreads`). Off here; `modelship serve` turns it on.
    adaptive_threads: bool = False
    seed: int = 0
    # CPU int4 kernel: "auto" (modelship's W4A8 where AVX2 and the group size allow, else
    # torch's), "w4a8" or "torch" (bf16 arithmetic; `model.quant.int4`)
    int4_kernel: str = "auto"
    # logits: "auto" (an int8 copy of the head for quantized checkpoints on CPU), "int8",
    # "int4" (a 4-bit copy, which tied embeddings also read: `model.quant.int4_head`) or
    # "dense" (`model.quant.int8`); int8 and int4 are CPU only
    lm_head: str = "auto"
    # attention: "auto" (modelship's CPU kernel on an AVX2 CPU with an fp32 cache: batch-
    # and chunk-invariant, so greedy output is repeatable; on CUDA the Triton kernel where
    # triton imports), "cpu", "triton" or "sdpa"
    attention_backend: str = "auto"
    # run all decoder layers in one C++ call on CPU-kernel steps where the model allows it
    # (W4A8 or dense CPU projections; `model.fused_decoder`), else layer by layer in Python
    fused_decoder: bool = True
    # decode-only steps of up to `cuda_graph_max_batch_size` sequences (and `max_num_seqs`)
    # replayed from captured graphs (`engine.cuda_graphs`): True captures CUDA graphs on a
    # CUDA device and is off elsewhere; "replay" runs the graph runner's static buffers,
    # padding and bucketing with the forward called eagerly, on any device (tests)
    cuda_graphs: bool | Literal["replay"] = True
    cuda_graph_max_batch_size: int = 256
    # prompt-lookup speculative decoding (`engine.speculative`); None: off
    speculative: SpeculativeConfig | None = None
    # ranks of Megatron-style tensor parallelism (`engine.tensor_parallel`): this process
    # is rank 0 and spawns the others; dense checkpoints only, no CUDA graphs or fused
    # decoder. A collective waiting longer than `tensor_parallel_timeout_s` (a hung rank)
    # fails the engine.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    # mixture-of-experts models: deal each routed layer's experts out over the
    # tensor-parallel ranks (whole experts, summed by one all-reduce) instead of refusing
    # them; attention stays tensor-parallel (`model.tensor_parallel`)
    expert_parallel: bool = False
    # LoRA adapters (PEFT folders) served over the base as (name, path); more can be
    # loaded at runtime (`LLMEngine.load_lora`). `max_loras` adapters are resident at once:
    # loading another evicts the least recently used one that no running request uses.
    loras: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    # hook the projections for LoRA even with no adapter configured (runtime loading)
    enable_lora: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
        if self.max_waiting_requests < 0 or self.max_waiting_tokens < 0:
            raise ValueError("max_waiting_requests and max_waiting_tokens must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError("tensor_parallel_timeout_s must be positive")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "replay"):
            raise ValueError(f"cuda_graphs must be True, False or 'replay': {self.cuda_graphs!r}")
        if not 1 <= self.cuda_graph_max_batch_size <= MAX_GRAPH_BATCH_SIZE:
            raise ValueError(f"cuda_graph_max_batch_size must be in [1, {MAX_GRAPH_BATCH_SIZE}]")
        for name, choices in (
            ("int4_kernel", INT4_KERNELS),
            ("lm_head", LM_HEADS),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.lm_head in ("int8", "int4") and self.torch_device.type != "cpu":
            raise ValueError(
                f"lm_head {self.lm_head} runs on modelship's CPU kernels, not on "
                f"{self.device}: use auto or dense there"
            )
        for name, dtypes in (("dtype", _DTYPES), ("kv_cache_dtype", _KV_CACHE_DTYPES)):
            value = getattr(self, name)
            if value is not None and value not in dtypes:
                raise ValueError(f"{name} must be one of {sorted(dtypes)}, got {value!r}")
        check_step_threads(self.step_threads)
        if self.step_threads and self.tensor_parallel_size > 1:
            # the ranks are processes of their own, each with its thread count
            raise ValueError("step_threads is not supported with tensor_parallel_size > 1")
        if self.tensor_parallel_size > 1 and (self.loras or self.enable_lora):
            # an adapter's delta is computed over whole projections, a rank holds a slice
            raise ValueError("LoRA adapters are not supported with tensor_parallel_size > 1")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def graph_capturer(self) -> str | None:
        """How decode steps are captured: "cuda", "replay" or None (every step eager)."""
        if self.tensor_parallel_size > 1:
            return None  # workers replay nothing: every step runs eagerly on all ranks
        if self.cuda_graphs == "replay":
            return "replay"
        return "cuda" if self.cuda_graphs and self.torch_device.type == "cuda" else None

    @property
    def max_graph_batch_size(self) -> int:
        """The largest captured decode batch: no step runs more sequences than this."""
        return min(self.cuda_graph_max_batch_size, self.max_num_seqs, self.max_num_batched_tokens)

    def cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        if self.kv_cache_dtype is not None:
            return _KV_CACHE_DTYPES[self.kv_cache_dtype]
        return torch.float32 if self.torch_device.type == "cpu" else compute_dtype


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_CACHE_DTYPES = {
    **_DTYPES,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
