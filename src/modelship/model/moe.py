"""Mixture-of-experts MLP: a router picks k of E gated MLPs per token (Mixtral, OLMoE,
Qwen2-MoE, Qwen3-MoE).

Routing: router logits x W_g^T in the compute dtype (the router is never quantized),
softmax in fp32 over all experts, top-k, renormalized over the k where the family asks
(Mixtral always; OLMoE, Qwen2/3-MoE per `norm_topk_prob`), then cast to the compute dtype.
For Mixtral, softmax-then-renormalize equals a softmax over the top-k logits.

Dispatch: the step's (token, expert) pairs are sorted by expert, the rows gathered once
into that order, and each *active* expert runs once on its contiguous group of rows (a
Python loop over at most E experts, never over tokens). The weighted outputs are summed
back per token with one `index_add_`, in ascending expert order, as transformers sums them.
Each expert's projections are whatever the linear factory built: dense, or with an int4
checkpoint one W4A8 kernel call per projection on the expert's whole group of rows.

Expert parallelism: a model built with `MoEConfig.local_experts` holds only those experts
(checkpoint names keep their global index) and returns only their share of the output;
the router still scores all experts, and the caller sums the ranks' shares
(`tensor_parallel.wrap_row_parallel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelship.model.config import ModelConfig, MoEConfig
from modelship.model.layers import GatedMLP, LinearFactory

# The module holding a layer's router and experts (`<layer>.<block>.gate`,
# `<layer>.<block>.experts.<e>.<gate|up|down>_proj`) where a family does not call it `mlp`.
# Experts are asked for under transformers 5's projection names; the loader finds Mixtral's
# original `w1/w3/w2` where a checkpoint uses them (`loader._Checkpoint.module`).
_BLOCKS = {"MixtralForCausalLM": "block_sparse_moe"}


def moe_block(architecture: str) -> str:
    return _BLOCKS.get(architecture, "mlp")


class _GateWeight(nn.Module):
    """A [rows, hidden] weight left on the meta device for the loader to assign."""

    def __init__(self, rows: int, hidden_size: int) -> None:
        super().__init__()
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(rows, hidden_size))


class Router(_GateWeight):
    """[n, hidden] -> (weights [n, k] in x's dtype, experts [n, k] int64)."""

    def __init__(self, config: MoEConfig, hidden_size: int) -> None:
        super().__init__(config.num_experts, hidden_size)
        self.top_k = config.top_k
        self.normalize = config.normalize_top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class MoEMLP(nn.Module):
    """The routed MLP of one layer (plus Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: ModelConfig, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "a dense config has no experts"
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.local_experts = moe.local_experts or (0, moe.num_experts)  # [start, end)
        self.gate = Router(moe, config.hidden_size)
        self.experts = nn.ModuleList()  # local expert i is the checkpoint's start + i
        for e in range(*self.local_experts):
            expert = f"{prefix}.experts.{e}"
            self.experts.append(
                GatedMLP(
                    linear([f"{expert}.gate_proj", f"{expert}.up_proj"], False),
                    linear([f"{expert}.down_proj"], False),
                    moe.intermediate_size,
                )
            )
        self.shared_expert: GatedMLP | None = None
        if moe.shared_intermediate_size:
            shared = f"{prefix}.shared_expert"
            self.shared_expert = GatedMLP(
                linear([f"{shared}.gate_proj", f"{shared}.up_proj"], False),
                linear([f"{shared}.down_proj"], False),
                moe.shared_intermediate_size,
            )
            self.shared_expert_gate = _GateWeight(1, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden], fresh
        weights, experts = self.gate(x)  # [n, k] each
        flat = experts.flatten()  # pair p = token p // k, its (p % k)-th choice
        # Stable: within an expert the pairs stay in token order.
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        first, last = self.local_experts
        local_start = sum(counts[:first])  # this instance's experts' pairs are contiguous
        order = order[local_start : local_start + sum(counts[first:last])]
        out = torch.zeros_like(x)
        if len(order):
            tokens = order // self.top_k  # [pairs]: each sorted pair's token
            rows = x.index_select(0, tokens)  # [pairs, hidden], grouped by expert
            pair_weights = weights.flatten().index_select(0, order).unsqueeze(1)
            outputs = []
            start = 0
            for expert, count in zip(self.experts, counts[first:last], strict=True):
                if count:
                    end = start + count
                    outputs.append(expert(rows[start:end]))
                    start = end
            out.index_add_(0, tokens, torch.cat(outputs).mul_(pair_weights))
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))  # [n, 1]
            out.add_(self.shared_expert(x).mul_(gate))
        return out

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """The experts each row of `x` (the post-attention-norm hidden) goes to, [n, k],
        in descending router probability."""
        return self.gate(x)[1]
