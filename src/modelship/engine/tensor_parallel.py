"""Tensor-parallel ranks: rank 0 is the engine (scheduler, sampling); ranks 1..N-1 are
worker processes it spawns, each holding its shard of the model (`model.tensor_parallel`)
and its shard of the KV cache (its kv heads, the same block ids: rank 0's block manager
allocates for all).

Every forward pass of rank 0 first sends the step's inputs (token ids, positions, the
attention metadata with slot mapping and block tables) to every worker over its pipe, then
runs its own shard; each worker runs the same forward, and the ranks meet in the
all-reduces (gloo on CPU, NCCL on CUDA). The step's inputs travel over pipes, not a
collective, so an idle worker waits for work without a collective timeout, and sees EOF
(and exits) when rank 0 goes away.

Failure: a worker that dies closes its gloo connections, so rank 0's next all-reduce raises
at once; one that hangs trips the process group's timeout (`EngineConfig.
tensor_parallel_timeout_s`). Either way rank 0 raises `TensorParallelError` naming the
rank and its exit code; in the engine core that kills the core, so the server fails its
requests and reports itself dead for the supervisor to replace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from modelship.engine.config import EngineConfig
from modelship.model import cpu_kernels
from modelship.model.attention import AttentionMetadata
from modelship.model.base import CausalLM
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import allocate_kv_cache
from modelship.model.loader import load_model
from modelship.model.tensor_parallel import ShardSpec

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or failed to start; the message names it."""


def threads_per_rank(config: EngineConfig) -> int:
    """`num_threads` if set, else the process's cores shared out over the ranks."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The engine's device; under TP on CUDA, GPU `rank` (one GPU per rank)."""
    device = config.torch_device
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        return torch.device("cuda", rank)
    return device


def _store(config: EngineConfig, rank: int, port: int = 0) -> dist.TCPStore:
    """The group's TCP store on 127.0.0.1. Rank 0 hosts it on a port the OS picks as it
    binds (its `port` is then passed to the others): a port found free, closed and bound
    again later could be taken by another process in between."""
    timeout = datetime.timedelta(seconds=config.tensor_parallel_timeout_s)
    size = config.tensor_parallel_size
    if rank == 0:  # the other ranks start after it: the group's creation waits for them
        return dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)


def _process_group(config: EngineConfig, rank: int, store: dist.TCPStore) -> dist.ProcessGroup:
    """This rank's group over `store`."""
    timeout = datetime.timedelta(seconds=config.tensor_parallel_timeout_s)
    size = config.tensor_parallel_size
    if config.torch_device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _to_device(value: Any, device: torch.device) -> Any:
    """Tensors inside (dataclasses, lists of) step inputs moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _to_device(getattr(value, f.name), device)
                   for f in dataclasses.fields(value)}  # fmt: skip
        return dataclasses.replace(value, **changes)
    return value


class TensorParallelGroup:
    """Rank 0's side: the worker processes, their pipes and the process group."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        store = _store(config, 0)
        context = multiprocessing.get_context("spawn")
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self.pipes: list[Any] = []
        for rank in range(1, self.size):
            ours, theirs = context.Pipe()
            worker = context.Process(
                target=_worker_main,
                args=(str(model_path), config, rank, store.port, theirs),
                name=f"modelship-tp{rank}",
                daemon=True,
            )
            worker.start()
            theirs.close()
            self.workers.append(worker)
            self.pipes.append(ours)
        try:
            self.group = _process_group(config, 0, store)
        except Exception as exc:
            self.close()
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error to raise for `exc` in a collective or a pipe: names a dead rank."""
        time.sleep(0.2)  # a rank that just died: let its exit code show
        dead = [(rank, w.exitcode) for rank, w in enumerate(self.workers, 1) if not w.is_alive()]
        if dead:
            ranks = ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead)
            return TensorParallelError(f"tensor-parallel {ranks} died: {exc}")
        return TensorParallelError(f"tensor-parallel collective failed: {exc}")

    def send(self, message: tuple) -> None:
        try:
            for pipe in self.pipes:
                pipe.send(message)
        except OSError as exc:  # BrokenPipeError: a worker has gone
            raise self.failure(exc) from exc

    def wait_ready(self) -> None:
        """Each worker's "ready" (or its error), checking it is alive meanwhile."""
        deadline = time.monotonic() + max(self.config.tensor_parallel_timeout_s, 600)
        for rank, (pipe, worker) in enumerate(zip(self.pipes, self.workers, strict=True), 1):
            while not pipe.poll(0.5):
                if not worker.is_alive() or time.monotonic() > deadline:
                    raise self.failure(RuntimeError(f"rank {rank} did not start"))
            try:
                reply = pipe.recv()
            except EOFError as exc:
                raise self.failure(exc) from exc
            if reply[0] != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {reply[1]}")

    def close(self) -> None:
        """Tell the workers to exit; kill any still there after a grace period."""
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
                pipe.close()
        for worker in self.workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
                worker.join(5)


class ParallelModel(CausalLM):
    """Rank 0's model: sends each forward's inputs to the workers, then runs its shard.
    Logits are computed here only (the head is replicated)."""

    def __init__(self, model: CausalLM, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = model
        self.tp = group
        self.config: ModelConfig = model.config  # rank 0's (narrower) shape

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        cpu = torch.device("cpu")
        self.tp.send(("forward", *_to_device((input_ids, positions), cpu),
                      _to_device(attn_metadata, cpu)))  # fmt: skip
        try:
            return self.inner(input_ids, positions, kv_caches, attn_metadata)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection or timed out
            raise self.tp.failure(exc) from exc

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


def _worker_main(model_path: str, config: EngineConfig, rank: int, port: int, pipe) -> None:
    """A worker rank: join the group, load the shard, then run forwards until EOF/None."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the engine core ignores it; we need not
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when we stop
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s"
    )
    torch.set_num_threads(threads_per_rank(config))
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = _process_group(config, rank, _store(config, rank, port))
    try:
        model_config = ModelConfig.from_dir(model_path)
        shard = ShardSpec(model_config, rank, config.tensor_parallel_size, config.expert_parallel)
        model = load_model(
            model_path, device=device, dtype=config.dtype,
            max_positions=config.max_model_len or model_config.max_position_embeddings,
            lm_head="dense", fused_decoder=False, shard=shard, group=group,
        )  # fmt: skip
        message = pipe.recv()  # ("cache", num_blocks, block_size, cache_dtype, backend)
        _, num_blocks, block_size, cache_dtype, attention_backend = message
        if attention_backend == "cpu":  # rank 0 chose modelship's kernel: register its ops
            cpu_kernels.load()
        kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, cache_dtype, device)
    except EOFError:
        return
    except Exception as exc:
        logger.exception("tensor-parallel rank %d failed to load", rank)
        with contextlib.suppress(OSError):
            pipe.send(("error", repr(exc)))
        raise SystemExit(1) from exc
    pipe.send(("ready",))
    with torch.inference_mode():
        while True:
            try:
                message = pipe.recv()
            except EOFError:  # rank 0 has gone
                return
            if message is None:
                return
            _, input_ids, positions, metadata = _to_device(message, device)
            model(input_ids, positions, kv_caches, metadata)  # outputs live on rank 0
