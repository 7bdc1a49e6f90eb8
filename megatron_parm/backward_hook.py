"""An identity whose backward calls a hook with the gradient that passes: how the step timer
(training/timing.py) marks a region's end in the backward pass and how the benchmark's byte
accounting (bench/native_accounting.py) sees the backward of Megatron's own collectives."""

from __future__ import annotations

from typing import Callable

import torch


class _OnBackward(torch.autograd.Function):
    """Identity; its backward calls ``hook(grad)`` and passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, tensor, hook):
        ctx.hook = hook
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook(grad)
        return grad, None


def on_backward(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """``tensor``, with ``hook(grad)`` called when its gradient passes; unchanged where no
    gradient flows through it."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _OnBackward.apply(tensor, hook)
    return tensor
