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

Expert parallelism (`--expert-parallel`, mixture-of-experts models only) runs on the same
ranks: attention and any dense MLP layers stay tensor-parallel as above, while each routed
layer's experts are dealt out whole, E / world_size consecutive experts to a rank (E must
divide). The router is replicated: every rank holds the same hidden states (the attention
all-reduce leaves them identical everywhere), routes every token, and runs only its own
experts on the tokens routed to them; Qwen2-MoE's shared expert is split by its
intermediate size like a dense MLP. The partial outputs are summed by one all-reduce of
the [tokens, hidden] output per layer, the same collective the dense MLP ends with. An
all-to-all (send each token only to its experts' ranks, and back) moves less only when
the ranks are many: each rank would send about k/world_size of its rows out and receive
as many back, twice per layer, against a ring all-reduce's 2 (world_size - 1) / world_size
rows; the hidden states are already on every rank, and with 2 ranks on gloo the all-reduce
is the cheaper and the simpler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelship.model.config import ModelConfig
from modelship.model.moe import MoEMLP


def split_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s share of `size` units; the first `size % world_size` ranks
    take one more."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank` of `world_size`: its kv heads [kv_start, kv_end) (and their q heads), its
    intermediate slice [inter_start, inter_end) and, with `expert_parallel`, its experts
    [expert_start, expert_end) and shared-expert slice."""

    full: ModelConfig
    rank: int
    world_size: int
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside tensor-parallel size {self.world_size}")
        check_expert_parallel(self.full, self.world_size, self.expert_parallel)
        if self.world_size > 1 and self.full.quantization_config:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} supports dense checkpoints only "
                "(fp32/bf16/fp16), not quantized ones"
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
    def experts(self) -> tuple[int, int]:
        """The routed experts this rank holds (all of them without expert parallelism)."""
        assert self.full.moe is not None, "a dense model has no experts"
        if not self.expert_parallel:
            return 0, self.full.moe.num_experts
        return split_range(self.full.moe.num_experts, self.world_size, self.rank)

    @property
    def shared_intermediate(self) -> tuple[int, int]:
        assert self.full.moe is not None, "a dense model has no experts"
        return split_range(self.full.moe.shared_intermediate_size, self.world_size, self.rank)

    @property
    def config(self) -> ModelConfig:
        """The narrower model this rank runs: its heads, intermediate size and experts."""
        (q0, q1), (k0, k1), (i0, i1) = self.q_heads, self.kv_heads, self.intermediate
        moe = self.full.moe
        if moe is not None:
            (s0, s1) = self.shared_intermediate
            moe = dataclasses.replace(
                moe, local_experts=self.experts, shared_intermediate_size=s1 - s0
            )
        return dataclasses.replace(
            self.full,
            num_heads=q1 - q0,
            num_kv_heads=k1 - k0,
            intermediate_size=i1 - i0,
            moe=moe,
        )

    def slicer(self, get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """Wrap a checkpoint getter so projection tensors come back as this rank's slice;
        routed experts (the model asks only for its own) and everything else (embeddings,
        norms, routers, the head) whole."""
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
        shared_rows: dict[str, tuple[int, int]] = {}  # Qwen2-MoE's shared expert, split alike
        shared_cols: dict[str, tuple[int, int]] = {}
        if self.full.moe is not None and self.full.moe.shared_intermediate_size:
            s0, s1 = self.shared_intermediate
            shared_rows = {"gate_proj": (s0, s1), "up_proj": (s0, s1)}
            shared_cols = {"down_proj": (s0, s1)}

        def sliced(name: str) -> torch.Tensor:
            tensor = get(name)
            parts = name.rsplit(".", 2)
            if len(parts) < 3 or not name.startswith("model.layers.") or ".experts." in name:
                return tensor
            module, proj, kind = parts
            row_slices, col_slices = (
                (shared_rows, shared_cols) if module.endswith(".shared_expert") else (rows, cols)
            )
            if proj in row_slices and kind in ("weight", "bias"):
                start, end = row_slices[proj]
                return tensor[start:end].contiguous()
            if proj in col_slices and kind == "weight":
                start, end = col_slices[proj]
                return tensor[:, start:end].contiguous()
            if proj in col_slices:
                raise ValueError(f"{name}: row-parallel {kind} is not supported under TP")
            return tensor

        return sliced


def check_expert_parallel(config: ModelConfig, world_size: int, expert_parallel: bool) -> None:
    """Refuse, naming the option, where experts cannot be sharded over `world_size` ranks
    (or a mixture-of-experts model would be split without `--expert-parallel`)."""
    moe = config.moe
    if not expert_parallel:
        if world_size > 1 and moe is not None:
            raise ValueError(
                f"--tensor-parallel-size {world_size} shards mixture-of-experts models "
                f"({config.architecture}) only with --expert-parallel"
            )
        return
    if moe is None:
        raise ValueError(
            f"--expert-parallel needs a mixture-of-experts model; {config.architecture} is dense"
        )
    if moe.num_experts % world_size:
        raise ValueError(
            f"--expert-parallel: {moe.num_experts} experts do not divide over "
            f"--tensor-parallel-size {world_size} ranks"
        )


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
    """Put an all-reduce after every layer's o_proj and down_proj, and after every routed
    MLP as a whole (its experts' and shared-expert slice's partial sums)."""
    for layer in model.layers:
        layer.o_proj = AllReduce(layer.o_proj, group)
        if isinstance(layer.mlp, MoEMLP):
            layer.mlp = AllReduce(layer.mlp, group)
        else:
            layer.mlp.down_proj = AllReduce(layer.mlp.down_proj, group)


def communication_seconds(model: nn.Module) -> float:
    """Total all-reduce time of a sharded model so far."""
    return sum(m.seconds for m in model.modules() if isinstance(m, AllReduce))
