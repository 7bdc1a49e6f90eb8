"""TorchGroupedMLP's deferred weight gradients (megatron_parm/experts.py) under Megatron-Core's
DistributedDataParallel with --overlap-grad-reduce, in one process: a layer call whose rank got
no token (every expert empty, as S2's sub-chunks are on a rank whose local experts the router
left out) still gives each expert weight a gradient, zero, as Megatron-Core's GroupedMLP does.
Megatron-Core's gradient hook refuses a missing one ("param.grad being None is not safe when
overlap_grad_reduce is True"), which an 8-rank run of Megatron-LM's
moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed configuration hit with parm_s2.
"""

from __future__ import annotations

import pytest
import torch

HIDDEN, FFN, EXPERTS = 8, 16, 2


def grouped_experts():
    """TorchGroupedMLP with two local experts (float32, SwiGLU off)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from megatron_parm.experts import TorchGroupedMLP

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                               num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
                               moe_grouped_gemm=True, add_bias_linear=False,
                               use_cpu_initialization=True)
    return TorchGroupedMLP(EXPERTS, config, ProcessGroupCollection.use_mpu_process_groups())


def wrapped_experts():
    """The experts in Megatron-Core's DDP with overlap_grad_reduce, as the trainer wraps them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    experts = grouped_experts()
    ddp = DistributedDataParallel(experts.config,
                                  DistributedDataParallelConfig(overlap_grad_reduce=True), experts)
    return experts, ddp


@pytest.mark.parametrize("backward", ["empty", "none"])
def test_an_expert_call_without_rows_gives_zero_weight_gradients(megatron_world, backward):
    """A deferred call over no rows, its output's backward run on the empty output (as S2 does)
    or never run (no gradient arrived): backward_dw hands both weights a zero gradient, which
    Megatron-Core's hook (it asserts on a missing one) adds to the weights' main_grad, and the
    step's gradient reduction finds every parameter ready."""
    experts, ddp = wrapped_experts()
    calls = []
    for _ in range(2):  # two micro-batches; the second's hooks run with the learnt counts
        ddp.zero_grad_buffer()
        with experts.deferring_weight_grads() as deferred:
            rows = torch.zeros(0, HIDDEN, requires_grad=True)
            out, _ = experts(rows, torch.zeros(EXPERTS, dtype=torch.long), torch.zeros(0))
        assert deferred.sink is not None  # the call was recorded: the weights are in its graph
        if backward == "empty":
            out.backward(torch.zeros_like(out))
        deferred.backward_dw()  # before the fix: AssertionError in Megatron-Core's hook
        ddp.finish_grad_sync()
        calls.append([param.main_grad.clone() for param in (experts.weight1, experts.weight2)])
        for param in (experts.weight1, experts.weight2):
            assert param.grad is None  # the hook moved it into main_grad
    for grads in calls:
        for grad in grads:
            assert grad.shape[0] > 0 and torch.equal(grad, torch.zeros_like(grad))


def test_calls_with_and_without_rows_sum_only_the_rows(megatron_world):
    """An empty call next to one with rows (S2: an empty sub-chunk beside a full one) adds
    nothing: the deferred gradients equal those of the full call's own graph."""
    experts = grouped_experts()
    torch.manual_seed(0)
    tokens = torch.tensor([3, 2])
    rows, probs, grad = torch.randn(5, HIDDEN), torch.rand(5), torch.randn(5, HIDDEN)
    experts.weight1.grad = experts.weight2.grad = None
    out, _ = experts(rows.requires_grad_(), tokens, probs)  # not deferred: autograd's own
    out.backward(grad)
    expected = [experts.weight1.grad.clone(), experts.weight2.grad.clone()]
    experts.weight1.grad = experts.weight2.grad = None
    with experts.deferring_weight_grads() as deferred:
        empty, _ = experts(torch.zeros(0, HIDDEN, requires_grad=True),
                           torch.zeros(EXPERTS, dtype=torch.long), torch.zeros(0))
        full, _ = experts(rows.detach().requires_grad_(), tokens, probs)
    torch.autograd.backward([empty, full], [torch.zeros_like(empty), grad])
    deferred.backward_dw()
    assert torch.allclose(experts.weight1.grad, expected[0], atol=1e-6)
    assert torch.allclose(experts.weight2.grad, expected[1], atol=1e-6)
