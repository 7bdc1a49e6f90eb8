"""Upcycling: a dense GPT checkpoint -> a MoE checkpoint whose experts are copies of the MLP.

    upcycle(dense, num_experts, topk, router_init_std, seed) -> FullCheckpoint (iteration 0,
    model only: the optimizer and the schedule start fresh)

Why the first loss is the dense model's: Megatron's router (moe_router_pre_softmax off, as this
trainer uses for top-k > 1) takes the softmax over the k selected logits, so each token's k
probabilities sum to 1; with every expert equal to the MLP, sum_i p_i MLP(x) = MLP(x). A zero
router (router_init_std 0) picks experts by ties and gives p_i = 1/k exactly; a small random
router (the default) spreads tokens over experts and still sums to 1, up to float rounding.
Biases (a dense model without --disable-bias-linear, e.g. GPT-2 from Hugging Face) are copied
into every expert like the weights; each expert adds its fc2 bias scaled by its probability,
so they too sum to the dense MLP's. Such a MoE runs with --expert-tensor-parallel-size 1.

Notation: L layers, E experts, F ffn hidden size, H hidden size.
"""

from __future__ import annotations

import re

import torch

from megatron_parm.checkpointing.full import FullCheckpoint
from megatron_parm.checkpointing.errors import CheckpointError

DENSE_MLP = re.compile(r"^decoder\.layers\.mlp\.(linear_fc[12])\.(weight|bias)$")
DENSE_MLP_OBJECT = re.compile(r"^decoder\.layers\.mlp\.(linear_fc[12])\._extra_state/shard_(\d+)_(\d+)$")
ROUTER_KEY = "decoder.layers.mlp.router.weight"
ROUTER_BIAS_KEY = "decoder.layers.mlp.router.bias"


def upcycle(dense: FullCheckpoint, num_experts: int, topk: int, router_init_std: float = 0.01,
            seed: int = 1234) -> FullCheckpoint:
    args = dict(dense.common.get("args") or {})
    if args.get("num_experts"):
        raise CheckpointError(f"--upcycle needs a dense checkpoint; this one already has "
                              f"--num-experts {args['num_experts']}")
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise CheckpointError(f"--num-experts ({num_experts}) and --moe-router-topk ({topk}) "
                              f"must satisfy 1 <= topk <= num_experts")
    tensors, objects = {}, {}
    num_layers = hidden = None
    biased = False
    for key, tensor in dense.tensors.items():
        if key.startswith("optimizer."):
            continue  # Adam's moments of the dense MLP mean nothing for a router: start fresh
        match = DENSE_MLP.match(key)
        if match is None:
            tensors[key] = tensor
            continue
        # weight [L, F, H] or [L, H, F], bias [L, F] or [L, H] -> [L, E, ...]: E copies of
        # each layer's MLP
        if match.group(2) == "weight":
            num_layers = tensor.shape[0]
            hidden = tensor.shape[2] if match.group(1) == "linear_fc1" else tensor.shape[1]
        else:
            biased = True
        expanded = tensor.unsqueeze(1).expand(tensor.shape[0], num_experts, *tensor.shape[1:])
        tensors[f"decoder.layers.mlp.experts.experts.{match.group(1)}.{match.group(2)}"] = \
            expanded.clone()
    if num_layers is None:
        raise CheckpointError("no dense MLP weights (decoder.layers.mlp.linear_fc1.weight) in the "
                              "checkpoint: is it a GPT checkpoint of this project?")
    dtype = tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].dtype
    generator = torch.Generator().manual_seed(seed)
    router_LEH = torch.randn(num_layers, num_experts, hidden, generator=generator) * router_init_std
    tensors[ROUTER_KEY] = router_LEH.to(dtype)
    if biased:  # with linear biases the router has one too: zero, so routing is the weights'
        tensors[ROUTER_BIAS_KEY] = torch.zeros(num_layers, num_experts, dtype=dtype)

    for key, value in dense.objects.items():
        match = DENSE_MLP_OBJECT.match(key)
        if match is None:
            objects[key] = value
            continue
        layer, total = int(match.group(2)), int(match.group(3))
        for expert in range(num_experts):
            objects[f"decoder.layers.mlp.experts.experts.{match.group(1)}._extra_state/"
                    f"shard_{layer}.{expert}_{total}.{num_experts}"] = value

    args.update(num_experts=num_experts, moe_router_topk=topk)
    common = {key: value for key, value in dense.common.items()
              if key not in ("optimizer_step", "opt_param_scheduler", "rng_state")}
    common.update(iteration=0, consumed_samples=0, args=args,
                  upcycled_from={"iteration": dense.common.get("iteration"),
                                 "num_experts": num_experts, "topk": topk,
                                 "router_init_std": router_init_std})
    return FullCheckpoint(tensors, objects, common)
