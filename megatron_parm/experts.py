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

With ``--delay-wgrad-compute`` (Megatron-Core's combined 1F1B schedule) every training call
defers its weight gradients so, until the schedule calls ``backward_dw()`` after the call's
backward, while the next micro-batch's dispatch is in flight.

Deferred weight gradients (``with experts.deferring_weight_grads() as deferred``): calls inside
build a graph for their input gradients only, keep the GEMMs' inputs and output gradients,
and ``deferred.backward_dw()`` then computes each weight's gradient once, over the rows of
every call, in one grouped GEMM (2D x 2D with offsets). S2 runs its chunks so: one
autograd graph per chunk would otherwise compute and accumulate every weight gradient
once per chunk (two GEMMs over a chunk's few rows per expert and an add of the whole
weight each), which was most of what a chunk cost on CPU (docs/benchmark.md).
"""

from __future__ import annotations

import contextlib
import itertools

from typing import List, Optional

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


class _WeightGradSink(torch.autograd.Function):
    """A node whose backward hands the weights their deferred gradients: grads made inside a
    backward reach AccumulateGrad as the engine's only reference, which takes them as the
    weights' .grad without a copy (a call of torch.autograd.backward on the weights would
    hold them and make AccumulateGrad clone them)."""

    @staticmethod
    def forward(ctx, deferred, *weights):
        ctx.deferred = deferred
        return weights[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        deferred, ctx.deferred = ctx.deferred, None
        return (None, *deferred.weight_grads())


class DeferredWeightGrads:
    """The weight gradients of a run of TorchGroupedMLP calls, computed once for all of them.

    Each call records, per weight, its GEMM's input rows [n, K] and tokens per expert; a hook
    on the GEMM's output records its gradient [n, N] when the backward reaches it. Rows of
    one expert sit in one block per call; ``backward_dw`` puts every call's blocks of one
    expert together (a concatenation; none for one call) and runs grouped_mm(rows^T, grad,
    offsets) -> [E, K, N], the formula PyTorch's grouped_mm backward uses for its second
    operand (bit-identical to it for one call). The gradients reach the weights through
    autograd (their AccumulateGrad nodes), so gradient hooks (Megatron's DDP) run as usual,
    once per weight.
    """

    NAMES = ("weight1", "weight2")

    def __init__(self, experts: "TorchGroupedMLP"):
        self.experts = experts
        # per weight: [(input rows, tokens per expert, offsets, [output gradient once it arrives])]
        self.calls = {name: [] for name in self.NAMES}
        self.sink: Optional[torch.Tensor] = None  # _WeightGradSink's output, with the first call

    def record(self, name: str, rows: torch.Tensor, tokens_per_expert: torch.Tensor,
               offsets: torch.Tensor, out: torch.Tensor) -> None:
        """One call's GEMM of weight ``name``: rows [n, K] in, ``out`` [n, N] its output;
        ``offsets``: the cumulative tokens per expert it ran with (on the rows' device)."""
        if self.sink is None:
            self.sink = _WeightGradSink.apply(self, *(getattr(self.experts, n) for n in self.NAMES))
        grad: list = []
        self.calls[name].append((rows.detach(), tokens_per_expert, offsets, grad))
        out.register_hook(grad.append)

    def _weight_grad(self, calls) -> Optional[torch.Tensor]:
        """The gradient over the calls whose output gradient arrived; None where that is no
        row at all (a zero gradient, left to the caller)."""
        done = [(rows, tokens, grad[0]) for rows, tokens, _, grad in calls if grad]
        if sum(rows.shape[0] for rows, _, _ in done) == 0:
            return None
        if len(done) == 1:  # the call's own offsets
            (rows, _, grad), offsets = done[0], next(o for _, _, o, g in calls if g)
        else:
            # host arithmetic on the split sizes (S2's tokens per expert live on the host)
            sizes = [tokens.tolist() for _, tokens, _ in done]  # [call][expert]
            split_rows = [r.split(n) for (r, _, _), n in zip(done, sizes)]
            split_grads = [g.split(n) for (_, _, g), n in zip(done, sizes)]
            order = [(call, e) for e in range(self.experts.num_local_experts)
                     for call in range(len(done))]
            rows = torch.cat([split_rows[c][e] for c, e in order])
            grad = torch.cat([split_grads[c][e] for c, e in order])
            offsets = torch.tensor(list(itertools.accumulate(map(sum, zip(*sizes)))),
                                   dtype=torch.int32)
            if offsets.device != rows.device:
                offsets = offsets.to(rows.device, non_blocking=True)
        return self.experts._gmm(rows.t(), grad, offs=offsets)

    def weight_grads(self) -> List[torch.Tensor]:
        """Every weight's gradient over the recorded calls; the records are dropped.

        Zero where no row of any call reached the weight (a rank whose local experts got no
        token), as Megatron-Core's GroupedMLP gives its weights for no tokens: never None,
        which AccumulateGrad would pass on to the weight's hooks as a missing gradient
        (Megatron-Core's DDP refuses that with --overlap-grad-reduce)."""
        grads = []
        for name in self.NAMES:
            weight = getattr(self.experts, name)
            grad = self._weight_grad(self.calls.pop(name))
            grads.append(torch.zeros_like(weight) if grad is None else grad.view(weight.shape))
        return grads

    def backward_dw(self) -> None:
        """Every recorded call's weight gradients, accumulated into the weights."""
        sink, self.sink = self.sink, None
        if sink is not None:
            torch.autograd.backward(sink, sink.new_empty(0))


class TorchGroupedMLP(GroupedMLP):
    """Megatron's GroupedMLP with its GEMMs on PyTorch's grouped_mm (no extra package).

    Same constructor, weights, initialisation and checkpoint keys as GroupedMLP; runs in
    fp32, bf16 or fp16 (GroupedMLP: bf16 only), on CPU and GPU. No biases (as GroupedMLP).
    Activation recompute (``--recompute-modules moe_act``) is supported as in GroupedMLP
    (and its calls compute their weight gradients at once, deferred or not).
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
        self._deferred: Optional[DeferredWeightGrads] = None
        # False: calls inside deferring_weight_grads() compute their weight gradients at once
        # (per call, accumulated), as before deferring existed; for comparisons
        self.defer_weight_grads = True
        # --delay-wgrad-compute: each training call's deferred weight gradients, oldest first,
        # until the combined 1F1B schedule asks for them (backward_dw)
        self._delayed: List[DeferredWeightGrads] = []

    @contextlib.contextmanager
    def deferring_weight_grads(self):
        """Calls inside leave their weight gradients to the ``DeferredWeightGrads`` yielded,
        whose ``backward_dw()`` computes them once for all the calls (after their backward)."""
        deferred, previous = DeferredWeightGrads(self), self._deferred
        self._deferred = deferred
        try:
            yield deferred
        finally:
            self._deferred = previous

    def backward_dw(self) -> None:
        """--delay-wgrad-compute (Megatron-Core's combined 1F1B calls it after the experts'
        backward): the weight gradients of the oldest call not yet done, in one grouped GEMM
        per weight. Its forward left them out of its backward (input gradients only)."""
        if self._delayed:
            self._delayed.pop(0).backward_dw()

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
        deferred = self._deferred
        if deferred is None and self.config.delay_wgrad_compute and rows.requires_grad \
                and torch.is_grad_enabled() and not self.activation_recompute:
            deferred = DeferredWeightGrads(self)
            self._delayed.append(deferred)
        if (deferred is None or not self.defer_weight_grads or self.activation_recompute
                or not rows.requires_grad
                or not torch.is_grad_enabled()
                or not (self.weight1.requires_grad and self.weight2.requires_grad)):
            deferred = None  # (rows that need no gradient: only the weights hold the graph)
        # deferred: the graph gets the weights as constants (input gradients only)
        weight1, weight2 = ((self.weight1, self.weight2) if deferred is None
                            else (self.weight1.detach(), self.weight2.detach()))
        w1 = weight1.view(experts, self.config.hidden_size, -1)
        w2 = weight2.view(experts, -1, self.config.hidden_size)
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        if offsets.device != rows.device:
            offsets = offsets.to(rows.device, non_blocking=True)
        fc1 = self._gmm(rows, w1, offs=offsets)
        probs = probs.unsqueeze(-1)
        if deferred is not None:
            hidden = self.activation_func_with_probs(fc1, probs)
            out = self._gmm(hidden, w2, offs=offsets)
            deferred.record("weight1", rows, tokens_per_expert, offsets, fc1)
            deferred.record("weight2", hidden, tokens_per_expert, offsets, out)
        elif self.activation_recompute:
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            hidden = self.activation_checkpoint.checkpoint(self.activation_func_with_probs,
                                                           fc1, probs)
            out = self._gmm(hidden, w2, offs=offsets)
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        else:
            hidden = self.activation_func_with_probs(fc1, probs)
            out = self._gmm(hidden, w2, offs=offsets)
        return _ContiguousGrad.apply(out), None
