"""A CPU stand-in for the grouped_gemm package, so Megatron's GroupedMLP runs in CPU tests.

Megatron-Core's GroupedMLP (--moe-grouped-gemm with --transformer-impl local) calls
``grouped_gemm.ops.gmm(a, b, batch_sizes, trans_b=False)``. The stand-in computes the same
thing with plain matmuls and checks its arguments as the package's kernel does
(csrc/grouped_gemm.cu, GroupedGemm): batch_sizes a 1-D int64 tensor on the CPU, one size
per expert, summing to a's rows; a a contiguous 2-D bf16 tensor, b a contiguous 3-D bf16
tensor with matching inner size. Under tests/device_sim.py's simulated device it also
refuses batch sizes that live on the device. Refusals are raised and recorded in
``violations``.

    install()     put it where Megatron's grouped_gemm_util looks (grouped_gemm, ops)
    uninstall()   put back what was there
"""

from __future__ import annotations

import types
from typing import List

import torch

violations: List[str] = []
_saved = {}


def _check(condition: bool, what: str) -> None:
    if not condition:
        violations.append(what)
        raise RuntimeError(f"fake grouped_gemm: {what}")


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False):
    from device_sim import DEVICE, place

    _check(batch_sizes.device.type == "cpu" and place(batch_sizes) != DEVICE,
           "batch_sizes must be on the CPU (grouped_gemm reads them on the host)")
    _check(batch_sizes.dim() == 1 and batch_sizes.dtype == torch.int64,
           f"batch_sizes must be 1-D int64, got {batch_sizes.dtype} {tuple(batch_sizes.shape)}")
    _check(a.dim() == 2 and a.dtype == torch.bfloat16 and a.is_contiguous(),
           f"a must be a contiguous 2-D bf16 tensor, got {a.dtype} {tuple(a.shape)} "
           f"contiguous={a.is_contiguous()}")
    _check(b.dim() == 3 and b.dtype == torch.bfloat16 and b.is_contiguous(),
           "b must be a contiguous 3-D bf16 tensor")
    _check(batch_sizes.shape[0] == b.shape[0], "one batch size per expert")
    _check((b.shape[2] if trans_b else b.shape[1]) == a.shape[1], "inner sizes differ")
    sizes = batch_sizes.tolist()
    _check(sum(sizes) == a.shape[0], "batch sizes must sum to a's rows")
    pieces = [part @ (b[i].t() if trans_b else b[i]) for i, part in enumerate(a.split(sizes))]
    return torch.cat(pieces)


def install() -> None:
    from megatron.core.transformer.moe import grouped_gemm_util

    _saved.update(grouped_gemm=grouped_gemm_util.grouped_gemm, ops=grouped_gemm_util.ops)
    ops = types.SimpleNamespace(gmm=gmm)
    grouped_gemm_util.grouped_gemm = types.SimpleNamespace(ops=ops)
    grouped_gemm_util.ops = ops


def uninstall() -> None:
    from megatron.core.transformer.moe import grouped_gemm_util

    for name, value in _saved.items():
        setattr(grouped_gemm_util, name, value)
    _saved.clear()
