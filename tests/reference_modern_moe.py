"""A plain single-process fine-grained MoE layer (DeepSeek / Qwen style): the ground truth
tests/distributed/modern_moe_worker.py checks every dispatcher against.

No process groups, no Megatron. The router follows Megatron-Core 0.16.1's
moe_utils.topk_routing_with_score_function (unfused, no router replay), written out here:

    softmax   top-k of the logits, softmax among them; with pre_softmax, softmax over all
              experts first, then top-k of those probabilities (not renormalised)
    sigmoid   scores = sigmoid(logits); top-k of scores + expert_bias (the bias only picks
              the experts), their unbiased scores normalised to sum 1 (for k > 1)
    groups    group-limited top-k: the experts in num_groups equal groups, each group scored
              by the sum of its top (k / group_topk) selection scores, top-k only among the
              experts of the group_topk best groups
    scaling   the chosen probabilities times scaling_factor

Experts are SwiGLU: fc2(silu(gate x) * up x), with fc1 = [gate; up] stacked on its output
dimension, each scaled by its routing probability. The shared expert is one more SwiGLU MLP
every token goes through, optionally times sigmoid(gate_weight . x).

Notation: T tokens, M hidden, F expert FFN hidden, Fs shared-expert FFN hidden, E experts,
k top-k, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Routing:
    """The router's options, under Megatron-Core's names (moe_router_*)."""

    topk: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None


def top_experts(selection: torch.Tensor, routing: Routing) -> torch.Tensor:
    """selection [T, E] (the scores experts are picked by) -> chosen experts [T, k]."""
    if routing.group_topk:
        num_tokens, num_experts = selection.shape
        per_group = num_experts // routing.num_groups
        grouped = selection.view(num_tokens, routing.num_groups, per_group)
        group_scores = grouped.topk(routing.topk // routing.group_topk, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(routing.group_topk, dim=-1).indices  # [T, group_topk]
        allowed = torch.zeros(num_tokens, routing.num_groups, dtype=torch.bool)
        allowed = allowed.scatter(1, best_groups, True).repeat_interleave(per_group, dim=1)
        selection = selection.masked_fill(~allowed, float("-inf"))
    return selection.topk(routing.topk, dim=-1).indices


def route(logits: torch.Tensor, routing: Routing,
          expert_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [T, E] -> dense probabilities [T, E] (zero where not routed)."""
    if routing.score_function == "softmax":
        if routing.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            chosen = top_experts(scores, routing)
            probs = scores.gather(1, chosen)
        else:
            chosen = top_experts(logits, routing)
            probs = torch.softmax(logits.gather(1, chosen), dim=-1)
    elif routing.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        chosen = top_experts(scores if expert_bias is None else scores + expert_bias, routing)
        probs = scores.gather(1, chosen)
        if routing.topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown score function {routing.score_function!r}")
    if routing.scaling_factor:
        probs = probs * routing.scaling_factor
    return torch.zeros_like(logits).scatter(1, chosen, probs)


def swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """x [T, M], fc1 [2F, M] ([gate; up]), fc2 [M, F] -> [T, M]."""
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, fc1: torch.Tensor,
                fc2: torch.Tensor, routing: Routing, expert_bias: Optional[torch.Tensor] = None,
                shared_fc1: Optional[torch.Tensor] = None,
                shared_fc2: Optional[torch.Tensor] = None,
                shared_gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, M], router_weight [E, M], fc1 [E, 2F, M], fc2 [E, M, F], expert_bias [E];
    shared_fc1 [2Fs, M], shared_fc2 [M, Fs], shared_gate [1, M] -> [T, M]."""
    probs = route(x @ router_weight.t(), routing, expert_bias)
    out = torch.zeros_like(x)
    for e in range(fc1.shape[0]):
        out = out + probs[:, e : e + 1] * swiglu(x, fc1[e], fc2[e])
    if shared_fc1 is not None:
        shared = swiglu(x, shared_fc1, shared_fc2)
        if shared_gate is not None:
            shared = shared * torch.sigmoid(x @ shared_gate.t())
        out = out + shared
    return out
