"""The parameters' L2 norm over the whole model (--log-params-norm), as Megatron-LM's
calc_params_l2_norm computes it: every parameter once, however the layout cuts it.

    params_norm(model, bf16)   collective over every rank; the same float on each

Which copy counts (the rules of Megatron-LM core_v0.16.1):
  * a parameter that tensor parallelism replicates (layer norms, biases of row-parallel layers)
    counts on tensor-parallel rank 0 only; a tensor-parallel shard counts on every rank;
  * a parameter marked shared (the last pipeline stage's copy of the tied word embedding)
    does not count;
  * with --bf16 the fp32 main parameters count, which Megatron-Core's mixed-precision
    optimizers keep on each parameter (main_param; the distributed optimizer's are shards, one
    per data-parallel rank, summed over the data-parallel group); else (fp32, --fp16) the
    parameters themselves, in fp32.
Dense parameters are then summed over the model-parallel group (tensor x pipeline), expert
parameters over the expert-model-parallel group (expert tensor x expert x pipeline): each shard
of the model once.
"""

from __future__ import annotations

import torch

from megatron_parm import device


def _squares(tensors) -> torch.Tensor:
    """Sum of squares of TENSORS in fp32, as a [1] tensor on this rank's device."""
    total = torch.zeros(1, dtype=torch.float32, device=device.current())
    for tensor in tensors:
        total += tensor.detach().float().pow(2).sum()
    return total


def params_norm(model, bf16: bool = False) -> float:
    """The L2 norm of every parameter of the model (MODEL: this rank's chunks), each counted
    once over the ranks. Collective."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    dense, expert, sharded = [], [], []
    for chunk in model:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param) or not param_is_not_shared(param):
                continue
            is_expert = not getattr(param, "allreduce", True)
            main = getattr(param, "main_param", None) if bf16 else None
            if bf16 and getattr(param, "main_param_sharded", False):
                if main is not None:
                    sharded.append(main)
            else:
                (expert if is_expert else dense).append(main if main is not None else param)
    dense_squares, expert_squares = _squares(dense), _squares(expert)
    # Megatron-LM sums the distributed optimizer's shards over the data-parallel group (with
    # context parallelism) and adds them to the dense part.
    sharded_squares = _squares(sharded)
    torch.distributed.all_reduce(sharded_squares, group=parallel_state.get_data_parallel_group(
        with_context_parallel=True))
    dense_squares += sharded_squares
    dense_group = parallel_state.get_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    if torch.distributed.get_process_group_ranks(dense_group) == \
            torch.distributed.get_process_group_ranks(expert_group):
        dense_squares += expert_squares
        torch.distributed.all_reduce(dense_squares, group=dense_group)
    else:
        torch.distributed.all_reduce(dense_squares, group=dense_group)
        torch.distributed.all_reduce(expert_squares, group=expert_group)
        dense_squares += expert_squares
    return device.to_host(dense_squares).item() ** 0.5
