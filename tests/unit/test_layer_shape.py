"""The tokens-per-rank rule of perf_model.shape.layer_shape against what ParmMoELayer hands its
token dispatcher, with and without sequence parallelism (no process group: the layer's forward
runs on a stand-in layer until routing).

Notation: S sequence length, B micro-batch, M hidden size, t the TP size."""

from __future__ import annotations

import contextlib

from types import SimpleNamespace

import pytest
import torch

from megatron_parm import layer as layer_module
from megatron_parm.layer import ParmMoELayer
from megatron_parm.perf_model.shape import layer_shape, tokens_per_rank

S, B, M = 16, 3, 8


class _Routed(Exception):
    """Stops the forward at the router, carrying the tokens it was given."""


class _TPGroup:
    """A TP group of `size` ranks as this rank sees it (size and rank only: the forward slices
    this rank's rows locally; nothing is communicated before routing)."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def tokens_routed(tp: int, sequence_parallel: bool) -> int:
    """Tokens the layer routes on TP rank 0, given the input Megatron's transformer block hands
    the MLP: this rank's [S/t, B, M] shard with sequence parallelism, else the replicated
    [S, B, M]."""
    def route(hidden_states, padding_mask=None):
        raise _Routed(hidden_states.numel() // hidden_states.shape[-1])

    layer = SimpleNamespace(
        uses_parm_dispatcher=True, attn_tp_group=_TPGroup(tp, 0), moe_layer_recompute=False,
        use_shared_expert=False,
        fwd_execution_map=list(getattr(layer_module, "FULL_EXECUTION_MAP",
                                       ["route", "expert_compute", "postprocess"])),
        config=SimpleNamespace(moe_token_dispatcher_type="parm_s1",
                               sequence_parallel=sequence_parallel),
        shared_experts_compute=lambda hidden_states: None, route=route,
        replicated_input=tp > 1 and not sequence_parallel, on_shard=contextlib.nullcontext)
    rows = S // tp if sequence_parallel else S
    with pytest.raises(_Routed) as routed:
        ParmMoELayer.forward(layer, torch.zeros(rows, B, M))
    return routed.value.args[0]


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_dispatcher_gets_what_the_rule_says(tp, sequence_parallel):
    shape = layer_shape(seq_length=S, micro_batch_size=B, tp=tp, hidden_size=M,
                        ffn_hidden_size=16, num_experts=4, topk=2)
    assert shape.num_tokens == tokens_routed(tp, sequence_parallel) == S // tp * B
    # A rule that divides by t only with sequence parallelism is wrong without it:
    if tp > 1 and not sequence_parallel:
        assert tokens_routed(tp, sequence_parallel) != S * B


def test_a_sequence_that_does_not_split_names_the_flags():
    with pytest.raises(ValueError, match=r"--seq-length \(15\) must be divisible by "
                                         r"--tensor-model-parallel-size \(2\)"):
        tokens_per_rank(15, 2, 2)
