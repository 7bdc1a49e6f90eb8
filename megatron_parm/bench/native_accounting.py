"""Byte accounting for Megatron's own dispatchers, so benchmarks compare like with like.

Megatron's alltoall and allgather dispatchers call three functions of
megatron.core.transformer.moe.token_dispatcher: all_to_all, gather_from_sequence_parallel_region
and reduce_scatter_to_sequence_parallel_region. Inside ``account_native_dispatchers()`` those
names are wrapped so that each call, forward and backward, is recorded with the convention of
megatron_parm.comm.accounting; the collectives themselves are Megatron's, unchanged.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional, Sequence

import torch

from megatron_parm.backward_hook import on_backward
from megatron_parm.comm.collectives import record_bytes


def _sizes(split_sizes: Optional[Sequence[int]], rows: int, size: int):
    if split_sizes is None:
        return [rows // size] * size
    return [int(s) for s in split_sizes]


def _row(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _group_names():
    from megatron.core import parallel_state as ps

    named = {}
    for name, getter in (("tp", ps.get_tensor_model_parallel_group),
                         ("ep", ps.get_expert_model_parallel_group),
                         ("expt_tp", ps.get_expert_tensor_parallel_group),
                         ("tp_ep", ps.get_expert_tensor_and_model_parallel_group)):
        group = getter(check_initialized=False)
        if group is not None and group not in named:
            named[group] = name
    return named


@contextmanager
def account_native_dispatchers():
    from megatron.core.transformer.moe import token_dispatcher as td

    names = _group_names()
    orig_a2a = td.all_to_all
    orig_gather = td.gather_from_sequence_parallel_region
    orig_scatter = td.reduce_scatter_to_sequence_parallel_region

    def a2a(group, input_, output_split_sizes_=None, input_split_sizes=None):
        name, size = names.get(group, "other"), group.size()
        sent = _sizes(input_split_sizes, input_.shape[0], size)
        record_bytes("all_to_all", name, group, [s * _row(input_) for s in sent])
        out = orig_a2a(group, input_, output_split_sizes_, input_split_sizes)
        back = _sizes(output_split_sizes_, out.shape[0], size)
        return on_backward(out, lambda g: record_bytes("all_to_all", name, group, [s * _row(g) for s in back]))

    def gather(input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None,
               use_global_buffer=False):
        name, size = names.get(group, "other"), group.size()
        record_bytes("all_gather", name, group, [input_.shape[0] * _row(input_)] * size)
        out = orig_gather(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        if not tensor_parallel_output_grad:  # backward is a local split
            return out
        chunks = _sizes(output_split_sizes, out.shape[0], size)
        return on_backward(out, lambda g: record_bytes("reduce_scatter", name, group, [c * _row(g) for c in chunks]))

    def scatter(input_, group=None, input_split_sizes=None, use_global_buffer=False):
        name, size = names.get(group, "other"), group.size()
        chunks = _sizes(input_split_sizes, input_.shape[0], size)
        record_bytes("reduce_scatter", name, group, [c * _row(input_) for c in chunks])
        out = orig_scatter(input_, group, input_split_sizes, use_global_buffer)
        return on_backward(out, lambda g: record_bytes("all_gather", name, group, [g.shape[0] * _row(g)] * size))

    td.all_to_all, td.gather_from_sequence_parallel_region = a2a, gather
    td.reduce_scatter_to_sequence_parallel_region = scatter
    try:
        yield
    finally:
        td.all_to_all, td.gather_from_sequence_parallel_region = orig_a2a, orig_gather
        td.reduce_scatter_to_sequence_parallel_region = orig_scatter
