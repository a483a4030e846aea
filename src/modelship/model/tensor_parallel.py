"""Megatron-style tensor parallelism of the Llama decoder: which slice of each projection a
rank holds, and the all-reduce that sums the row-parallel partial outputs.

Per layer: the fused q/k/v projection is column-parallel by whole KV-head groups (a rank
gets whole kv heads and the q heads that attend to them), o_proj row-parallel on the same
heads; gate/up column-parallel on a slice of the intermediate size, down row-parallel on
it. So a rank's layer is an ordinary `DecoderLayer` of a narrower model (`ShardSpec.config`:
fewer heads, smaller intermediate size; its KV cache holds only its kv heads), and the only
communication is one all-reduce (sum) after o_proj and one after down. Splits may be uneven
(SmolLM2-135M: 3 kv heads on 2 ranks = 2 + 1): earlier ranks take the remainder.
Embeddings, norms and the output head are replicated; only rank 0 computes logits.
Row-parallel biases would have to be added once (after the sum); Llama-family o_proj and
down_proj have none, and the loader refuses checkpoints that would need it. Dense
projections only: quantized checkpoints are refused under TP.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelship.model.config import ModelConfig


def split_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s share of `size` units; the first `size % world_size` ranks
    take one more."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank` of `world_size`: its kv heads [kv_start, kv_end) (and their q heads) and
    its intermediate slice [inter_start, inter_end)."""

    full: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside tensor-parallel size {self.world_size}")
        if self.world_size > 1 and self.full.quantization_config:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} supports dense checkpoints only "
                "(fp32/bf16/fp16), not quantized ones"
            )
        if self.world_size > 1 and self.full.moe is not None:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} does not support "
                f"mixture-of-experts models ({self.full.architecture}) yet"
            )
        if self.full.num_kv_heads < self.world_size:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} exceeds the model's "
                f"{self.full.num_kv_heads} kv heads (each rank needs a whole kv head)"
            )
        if self.full.intermediate_size < self.world_size:
            raise ValueError(f"--tensor-parallel-size {self.world_size} exceeds the MLP width")

    @property
    def kv_heads(self) -> tuple[int, int]:
        return split_range(self.full.num_kv_heads, self.world_size, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        group = self.full.num_heads // self.full.num_kv_heads
        start, end = self.kv_heads
        return start * group, end * group

    @property
    def intermediate(self) -> tuple[int, int]:
        return split_range(self.full.intermediate_size, self.world_size, self.rank)

    @property
    def config(self) -> ModelConfig:
        """The narrower model this rank runs: its heads and intermediate size."""
        (q0, q1), (k0, k1), (i0, i1) = self.q_heads, self.kv_heads, self.intermediate
        return dataclasses.replace(
            self.full, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0
        )

    def slicer(self, get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """Wrap a checkpoint getter so projection tensors come back as this rank's slice;
        everything else (embeddings, norms, the head) whole."""
        hd = self.full.head_dim
        (q0, q1), (k0, k1), (i0, i1) = self.q_heads, self.kv_heads, self.intermediate
        rows = {  # column-parallel: output rows (weights and biases)
            "q_proj": (q0 * hd, q1 * hd),
            "k_proj": (k0 * hd, k1 * hd),
            "v_proj": (k0 * hd, k1 * hd),
            "gate_proj": (i0, i1),
            "up_proj": (i0, i1),
        }
        cols = {"o_proj": (q0 * hd, q1 * hd), "down_proj": (i0, i1)}  # row-parallel: inputs

        def sliced(name: str) -> torch.Tensor:
            tensor = get(name)
            parts = name.rsplit(".", 2)
            if len(parts) < 3 or not name.startswith("model.layers."):
                return tensor
            proj, kind = parts[1], parts[2]
            if proj in rows and kind in ("weight", "bias"):
                start, end = rows[proj]
                return tensor[start:end].contiguous()
            if proj in cols and kind == "weight":
                start, end = cols[proj]
                return tensor[:, start:end].contiguous()
            if proj in cols:
                raise ValueError(f"{name}: row-parallel {kind} is not supported under TP")
            return tensor

        return sliced


class AllReduce(nn.Module):
    """Runs a row-parallel projection and sums its partial output over the ranks, in place.
    `seconds` accumulates the time spent in the all-reduce (the benchmark's communication
    share; on rank 0 it includes waiting for slower ranks)."""

    def __init__(self, inner: nn.Module, group: torch.distributed.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        start = time.perf_counter()
        self.group.allreduce([out]).wait()
        self.seconds += time.perf_counter() - start
        return out


def wrap_row_parallel(model: nn.Module, group: torch.distributed.ProcessGroup) -> None:
    """Put an all-reduce after every layer's o_proj and down_proj."""
    for layer in model.layers:
        layer.o_proj = AllReduce(layer.o_proj, group)
        layer.mlp.down_proj = AllReduce(layer.mlp.down_proj, group)


def communication_seconds(model: nn.Module) -> float:
    """Total all-reduce time of a sharded model so far."""
    return sum(m.seconds for m in model.modules() if isinstance(m, AllReduce))
