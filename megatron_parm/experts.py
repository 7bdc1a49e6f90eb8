"""Grouped experts for training on PyTorch's own grouped GEMM: TorchGroupedMLP.

Megatron's ``SequentialMLP`` runs each local expert as its own MLP: two GEMMs, an activation
and a probability product per expert, again for every call. Its ``GroupedMLP`` runs all
local experts as one grouped GEMM per linear layer, but needs the ``grouped_gemm`` package
(and TE's ``TEGroupedMLP`` needs Transformer Engine): neither has a binary wheel. PyTorch's
``grouped_mm`` (``torch._grouped_mm`` before 2.10) is differentiable, runs on CPU (fp32, bf16,
fp16) and on Hopper GPUs (bf16, CUTLASS), and needs nothing extra.

TorchGroupedMLP is Megatron's GroupedMLP with its two GEMMs on ``grouped_mm``:

    weight1  [hidden, E_local * ffn(*2 with GLU) / ETP]   viewed as [E_local, hidden, f1]
    weight2  [E_local * ffn / ETP, hidden]                 viewed as [E_local, f2, hidden]

the same tensors, initialisation and checkpoint mapping (GroupedMLP.sharded_state_dict stores
them under SequentialMLP's global keys, ``...mlp.experts.linear_fc{1,2}.weight`` with a layer
and an expert axis), so a checkpoint moves between the two implementations at any
(tp, ep, etp). Like every expert module here, the output of a rank is its ETP partial sum:
the dispatcher reduces it over ETP.

    grouped_mm_op()                       PyTorch's grouped GEMM, or None
    TorchGroupedMLP(num_local_experts, config, pg_collection)

Which expert module a run builds, and the widths and dtypes the grouped GEMM takes, are
megatron_parm.training.implementation.expert_implementation's and
megatron_parm.layout_rules.grouped_gemm_problem's.

Workflow of one call, ``experts(rows, tokens_per_expert, probs)``:
    1. offsets = cumsum(tokens_per_expert) as int32 on the rows' device (one H2D copy).
    2. fc1 = grouped_mm(rows, weight1 as [E, hidden, f1], offs)           1 operator
    3. act = activation(fc1) * probs, in the rows' dtype                   ~3 operators
    4. out = grouped_mm(act, weight2 as [E, f2, hidden], offs)            1 operator
    The count of operators does not depend on the number of local experts: S2's chunks pay
    a fixed handful each, not a handful per expert.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.moe import experts as megatron_experts
from megatron.core.transformer.moe.experts import GroupedMLP

from megatron_parm.layout_rules import grouped_gemm_problem

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def grouped_mm_op():
    """torch.nn.functional.grouped_mm (torch >= 2.10), torch._grouped_mm before, or None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: grouped_mm's backward refuses an
    expanded one (stride 0), which a plain sum of the output produces."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class TorchGroupedMLP(GroupedMLP):
    """Megatron's GroupedMLP with its GEMMs on PyTorch's grouped_mm (no extra package).

    Same constructor, weights, initialisation and checkpoint keys as GroupedMLP; runs in
    fp32, bf16 or fp16 (GroupedMLP: bf16 only), on CPU and GPU. No biases (as GroupedMLP).
    Activation recompute (``--recompute-modules moe_act``) is supported as in GroupedMLP.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        # GroupedMLP asserts that the grouped_gemm package is importable, only to use it in
        # its forward, which this class replaces. Waive that one check while it builds.
        check = megatron_experts.gg.assert_grouped_gemm_is_available
        megatron_experts.gg.assert_grouped_gemm_is_available = lambda: None
        try:
            super().__init__(num_local_experts, config, pg_collection)
        finally:
            megatron_experts.gg.assert_grouped_gemm_is_available = check
        self._gmm = grouped_mm_op()
        if self._gmm is None:
            raise ValueError(f"--moe-grouped-gemm: torch {torch.__version__} has no grouped_mm "
                             f"(torch >= 2.8 has it), and grouped_gemm is not installed")
        problem = grouped_gemm_problem(_DTYPE_NAMES.get(config.params_dtype, str(config.params_dtype)),
                                       config.hidden_size, self.weight2.shape[0] // num_local_experts)
        if problem is not None:
            raise ValueError(f"--moe-grouped-gemm: {problem}")

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor):
        if self.config.moe_apply_probs_on_input:
            dtype = rows.dtype
            rows = (probs.unsqueeze(-1) * rows).to(dtype)
            probs = torch.ones_like(probs)
        if rows.stride() != (rows.shape[1], 1):
            # A one-row slice of a wider buffer counts as contiguous (S2's sub-chunk of one row
            # of a packed message): .contiguous() keeps its row stride, which grouped_mm refuses
            # unless it is a multiple of 16 bytes.
            rows = rows.clone(memory_format=torch.contiguous_format)
        experts = self.num_local_experts
        w1 = self.weight1.view(experts, self.config.hidden_size, -1)
        w2 = self.weight2.view(experts, -1, self.config.hidden_size)
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        if offsets.device != rows.device:
            offsets = offsets.to(rows.device, non_blocking=True)
        fc1 = self._gmm(rows, w1, offs=offsets)
        probs = probs.unsqueeze(-1)
        if self.activation_recompute:
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            hidden = self.activation_checkpoint.checkpoint(self.activation_func_with_probs,
                                                           fc1, probs)
            out = self._gmm(hidden, w2, offs=offsets)
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        else:
            hidden = self.activation_func_with_probs(fc1, probs)
            out = self._gmm(hidden, w2, offs=offsets)
        return _ContiguousGrad.apply(out), None
