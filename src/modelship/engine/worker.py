"""The worker: the model side of one replica (vLLM v1's worker, rank 0 of its group).

It loads the model (under tensor parallelism, after spawning ranks 1..N-1 so that they load
their shards meanwhile), the tokenizer and the LoRA adapters, sizes and allocates the KV
cache, captures the decode graphs, loads the draft model, and executes the scheduler's
plans. `ModelRunner` is its inner half: one plan in, sampled rows out. The engine decides
what runs (scheduler, block manager) and what the tokens mean (output processor); the
worker only runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from modelship.engine.config import EngineConfig
from modelship.engine.cuda_graphs import (
    DecodeGraphRunner,
    create_graph_capturer,
    graph_capture_error,
)
from modelship.engine.draft import DraftModel
from modelship.engine.errors import KVCacheTooSmallError
from modelship.engine.loras import LoRARegistry
from modelship.engine.model_runner import ModelRunner, RunnerOutput
from modelship.engine.scheduler import SchedulerOutput
from modelship.engine.step_threads import AdaptiveThreads, StepThreads
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
from modelship.model.loader import load_model, read_generation_eos, resolve_dtype
from modelship.model.tensor_parallel import ShardSpec, check_expert_parallel

logger = logging.getLogger(__name__)


class Worker:
    """The model, tokenizer, KV cache, decode graphs, draft model and adapters of a replica.

    `num_blocks` is what the block manager may hand out; with decode graphs the cache holds
    one scratch block more (id `num_blocks`) that only the padding rows of a replayed step
    touch. `execute` reads the plan's sequences and changes only their draft fields (the
    draft model writes the drafts the scheduler reserved slots for)."""

    def __init__(self, model_path: str | Path, config: EngineConfig) -> None:
        self.config = config
        tp_size = config.tensor_parallel_size
        if config.num_threads or tp_size > 1:
            torch.set_num_threads(threads_per_rank(config))
        self.device = rank_device(config, 0)
        threads = torch.get_num_threads()
        adaptive = (
            AdaptiveThreads(threads)
            if config.adaptive_threads and threads > 1 and tp_size == 1
            and self.device.type == "cpu"
            else None
        )  # fmt: skip
        self.step_threads = StepThreads(config.step_threads, threads, adaptive)
        self.model_path = Path(model_path)
        model_config = ModelConfig.from_dir(self.model_path)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        # Tensor parallelism: the shapes are checked, then the other ranks spawn first, so
        # they load their shards while this one loads its own.
        check_expert_parallel(model_config, tp_size, config.expert_parallel)
        shard = ShardSpec(model_config, 0, tp_size, config.expert_parallel) if tp_size > 1 else None
        self.tp_group = TensorParallelGroup(self.model_path, config) if shard else None
        self.model = self._load_model(shard)
        self.tokenizer = load_tokenizer(self.model_path)
        self.loras = self._load_loras(model_config)
        self.eos_token_ids = set(model_config.eos_token_ids) | read_generation_eos(self.model_path)
        self.vocab_size = model_config.vocab_size

        self.cache_dtype = config.cache_dtype(self.model.dtype)
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, self.cache_dtype
        )
        capturer = self._graph_capturer(self.attention_backend)
        self.block_size = config.block_size
        block_bytes = kv_cache_bytes_per_block(self.model.config, self.block_size, self.cache_dtype)
        # under TP, rank 0 holds the most kv heads: the budget holds for every rank
        self.num_blocks = config.num_kv_blocks or max(1, self._kv_cache_budget() // block_bytes)
        if config.num_kv_blocks is None:  # sized from memory (tests that set blocks: as set)
            check_one_sequence_fits(self.num_blocks * self.block_size, self.max_model_len)
        num_scratch_blocks = 1 if capturer is not None else 0
        self.kv_caches = allocate_kv_cache(
            self.model.config,
            self.num_blocks + num_scratch_blocks,
            self.block_size,
            self.cache_dtype,
            self.device,
        )
        if self.tp_group is not None:
            self._start_ranks()
        graph_runner = self._capture_graphs(capturer) if capturer is not None else None
        self.runner = ModelRunner(
            self.model,
            self.kv_caches,
            self.block_size,
            self.device,
            self.attention_backend,
            graph_runner,
        )
        self.draft = self._load_draft(self.num_blocks + num_scratch_blocks)
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, dtype %s, kv %s, attention %s, "
            "decode graphs %s",
            self.model_path,
            self.num_blocks,
            self.block_size,
            self.model.dtype,
            self.cache_dtype,
            self.attention_backend,
            capturer or "off",
        )

    # Setup -----------------------------------------------------------------------------------
    def _kv_cache_budget(self) -> int:
        """Bytes for the KV cache: the configured amount, or the configured share of the
        memory free now that the weights are in."""
        fraction = self.config.kv_cache_memory_fraction
        if fraction is None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = psutil.virtual_memory().available
        return int(free * fraction)

    def _load_model(self, shard: ShardSpec | None):
        """Rank 0's model, or its shard under TP (the other ranks are stopped on failure)."""
        try:
            return load_model(
                self.model_path,
                device=self.device,
                dtype=self.config.dtype,
                max_positions=self.max_model_len,
                int4_kernel=self.config.int4_kernel,
                lm_head=self.config.lm_head,
                fused_decoder=self.config.fused_decoder,
                shard=shard,
                group=self.tp_group.group if self.tp_group else None,
            )
        except BaseException:
            self.close()
            raise

    def _load_loras(self, model_config: ModelConfig) -> LoRARegistry | None:
        if not (self.config.loras or self.config.enable_lora):
            return None
        # Always the per-layer path for adapter rows; base-only steps keep the fused decoder
        # and decode graphs (`ModelRunner.execute`).
        self.model.enable_lora()
        loras = LoRARegistry(
            model_config.num_layers, self.model.dtype, self.device, self.config.max_loras
        )
        for name, path in self.config.loras:
            loras.load(name, path)
        return loras

    def _start_ranks(self) -> None:
        """Have ranks 1..N-1 allocate their KV caches, wait for them, and wrap the model so
        that each forward sends them the step's inputs."""
        assert self.tp_group is not None
        try:
            self.tp_group.send(
                ("cache", self.num_blocks, self.block_size, self.cache_dtype,
                 self.attention_backend)
            )  # fmt: skip
            self.tp_group.wait_ready()
        except BaseException:
            self.close()
            raise
        self.model = ParallelModel(self.model, self.tp_group)

    def _graph_capturer(self, attention_backend: str) -> str | None:
        """The config's capturer, or None (with a warning) where CUDA graphs were left on by
        default but this attention backend cannot be captured; "replay" refuses loudly."""
        capturer = self.config.graph_capturer
        error = capturer and graph_capture_error(
            attention_backend, self.config.block_size, self.config.torch_device
        )
        if capturer == "cuda":
            # the model's own reason (mixture-of-experts routing); "replay" reruns the
            # forward eagerly, so it takes any model
            error = error or self.model.graph_capture_error()
        if capturer == "cuda" and error:
            logger.warning("decode steps run eagerly: %s", error)
            return None
        return capturer

    def _capture_graphs(self, capturer: str) -> DecodeGraphRunner:
        graph_runner = DecodeGraphRunner(
            self.model,
            self.kv_caches,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_batch_size=self.config.max_graph_batch_size,
            scratch_block=self.num_blocks,
            attention_backend=self.attention_backend,
            device=self.device,
            capturer=create_graph_capturer(capturer, self.device),
        )
        graph_runner.capture()  # after the KV cache exists: the graphs address it
        return graph_runner

    def _load_draft(self, num_blocks: int) -> DraftModel | None:
        """The draft model of draft-model speculation: same block ids as the target's cache
        (scratch block included), its own KV tensors."""
        speculative = self.config.speculative
        if speculative is None or speculative.method != "draft":
            return None
        assert speculative.draft_model is not None
        return DraftModel(
            speculative.draft_model,
            self.model_path,
            self.tokenizer,
            num_blocks=num_blocks,
            block_size=self.block_size,
            cache_dtype=self.cache_dtype,
            attention_backend=self.config.attention_backend,
            device=self.device,
            dtype=self.config.dtype,
            max_model_len=self.max_model_len,
            int4_kernel=self.config.int4_kernel,
            lm_head=self.config.lm_head,
            fused_decoder=self.config.fused_decoder,
        )

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also exit when this process does)."""
        if self.tp_group is not None:
            self.tp_group.close()

    # Running ---------------------------------------------------------------------------------
    def execute(
        self, plan: SchedulerOutput, generators: dict[str, torch.Generator | None]
    ) -> RunnerOutput:
        """Run one plan: the draft model first fills the draft slots the scheduler reserved
        (placeholders until then), then the model runs every planned token and samples for
        the sequences that completed their known tokens. `generators` maps a sequence id to
        its sampling generator (None: greedy)."""
        threads = self.step_threads.apply(plan.num_batched_tokens)
        start = time.perf_counter()
        if self.draft is not None:
            self.draft.propose([scheduled.seq for scheduled in plan.scheduled], generators)
        output = self.runner.execute(plan, generators)
        self.step_threads.record(plan.num_batched_tokens, threads, time.perf_counter() - start)
        return output

    def score(self, sequences: list[list[int]]) -> Iterator[torch.Tensor]:
        """`ModelRunner.score`: the KV cache is scratch space, so no request may hold
        blocks meanwhile (the engine checks)."""
        self.step_threads.apply(None)
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


def check_one_sequence_fits(num_cache_tokens: int, max_model_len: int) -> None:
    """Refuse a KV cache that cannot hold one sequence of `max_model_len` tokens: such a
    replica would start and then fail (or preempt forever) the first long request."""
    if num_cache_tokens < max_model_len:
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_cache_tokens} tokens, fewer than one sequence of "
            f"max_model_len {max_model_len}: raise --kv-cache-memory-mb (or "
            f"--gpu-memory-utilization) or lower --max-model-len"
        )


def planned_cache_tokens(model_path: Path, config: EngineConfig) -> tuple[int, int] | None:
    """(tokens the KV cache will hold, max_model_len) of `config` on CPU, known before the
    model loads (so a start-up that would fail `check_one_sequence_fits` can fail first);
    None where only the loaded worker knows: a share of the memory then free, a set number
    of blocks, shards under TP, a CUDA device (whose compute dtype its kernels decide)."""
    if (
        config.kv_cache_memory_fraction is not None
        or config.num_kv_blocks is not None
        or config.tensor_parallel_size > 1
        or config.torch_device.type != "cpu"
    ):
        return None
    model_config = ModelConfig.from_dir(model_path)
    compute_dtype = resolve_dtype(model_config, config.torch_device, config.dtype)
    cache_dtype = config.cache_dtype(compute_dtype)
    block_bytes = kv_cache_bytes_per_block(model_config, config.block_size, cache_dtype)
    num_blocks = max(1, config.kv_cache_memory_bytes // block_bytes)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    return num_blocks * config.block_size, max_model_len
