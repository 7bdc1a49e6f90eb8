"""A plain single-process MoE layer: the ground truth the dispatchers are checked against.

No process groups, no Megatron: top-k softmax routing (softmax first for k = 1), optional capacity dropping per
routing shard (Megatron drops among the tokens one rank routes), experts as fc2(gelu(fc1 x))
scaled by the routing probability.

Notation: T tokens, M hidden, F expert FFN hidden, E experts, k top-k.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router_weight: torch.Tensor, topk: int,
          capacity_factor: Optional[float] = None, pad_to_capacity: bool = False):
    """x [T, M] -> dense probs [T, E] (zero where not routed or dropped)."""
    logits = x @ router_weight.t()
    if topk == 1:  # softmax over all experts, then top-1 (Megatron's pre-softmax routing)
        top_probs, top_idx = torch.topk(torch.softmax(logits, dim=-1), k=1, dim=1)
    else:  # top-k logits, then softmax among them
        top_logits, top_idx = torch.topk(logits, k=topk, dim=1)
        top_probs = torch.softmax(top_logits, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top_idx, top_probs)
    routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
    if capacity_factor is None:
        return probs
    num_tokens, num_experts = logits.shape
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    if capacity >= num_tokens:
        return probs
    # Per expert, keep the `capacity` tokens with the highest probability.
    keep_idx = torch.topk(probs, k=capacity, dim=0, sorted=False).indices
    keep = torch.zeros_like(routed).scatter(0, keep_idx, True)
    return probs * (keep if pad_to_capacity else (keep & routed))


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                topk: int, capacity_factor: Optional[float] = None, pad_to_capacity: bool = False,
                num_shards: int = 1) -> torch.Tensor:
    """x [T, M], fc1 [E, F, M], fc2 [E, M, F] -> [T, M].

    num_shards: the tokens are routed in that many equal consecutive shards (one per rank
    that routes), which matters only for capacity dropping.
    """
    shards = x.chunk(num_shards, dim=0)
    probs = torch.cat([route(s, router_weight, topk, capacity_factor, pad_to_capacity) for s in shards])
    out = torch.zeros_like(x)
    for e in range(fc1.shape[0]):
        h = F.gelu(x @ fc1[e].t())
        out = out + probs[:, e : e + 1] * (h @ fc2[e].t())
    return out
