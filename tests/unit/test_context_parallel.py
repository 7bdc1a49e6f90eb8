"""Context parallelism (--context-parallel-size), CPU only:

* the load-balanced split of a sequence (Megatron-LM's get_batch_on_this_cp_rank: 2c chunks,
  rank r holding r and 2c - 1 - r) and its inverse, the causal mask of a CP rank's rows;
* megatron_parm.attention.ParmDotProductAttention on 2 gloo ranks (one spawn, about 15 s)
  against Megatron-Core's local DotProductAttention over the whole sequence on one rank:
  outputs and the gradients of queries, keys and values, for --cp-comm-type all_gather and a2a,
  with grouped-query attention, with the data loader's mask and with none;
* the user's mistakes, one line naming the flag, before any rank starts.

Whole training runs at c = 2 against c = 1: tests/e2e/test_modern_models.py.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY_GPT = ["--config", str(REPO / "configs/gpt2_tiny_moe.yaml")]
S, B, HEADS, GROUPS, WIDTH = 16, 2, 4, 2, 8  # s divisible by 2c; heads and groups by c
CP = 2


def test_the_split_takes_chunks_r_and_2c_minus_1_minus_r_and_the_orders_invert():
    from megatron_parm.attention import (causal_mask_on_cp_rank, context_parallel_positions,
                                         split_for_context_parallel, to_rank_order,
                                         to_sequence_order)

    assert context_parallel_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert context_parallel_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    tokens = torch.arange(2 * 12).view(2, 12)  # [b, s]
    assert split_for_context_parallel(tokens, 1, 3, 2)[1].tolist() == [16, 17, 18, 19]
    parts = torch.cat([context_parallel_positions(12, 3, r) for r in range(3)])
    assert to_sequence_order(parts, 3).tolist() == list(range(12))
    assert to_rank_order(torch.arange(12), 3).tolist() == parts.tolist()
    mask = causal_mask_on_cp_rank(8, 2, 1)  # rows of positions 2, 3, 4, 5
    assert mask.shape == (1, 1, 4, 8)
    assert mask[0, 0].sum(dim=1).tolist() == [5, 4, 3, 2]  # keys after the query's position
    full = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]
    assert torch.equal(split_for_context_parallel(full, 2, 2, 1), mask)


def _config(cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * WIDTH, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=WIDTH, attention_dropout=0.0,
                             hidden_dropout=0.0, context_parallel_size=cp,
                             use_cpu_initialization=True)


def _inputs():
    gen = torch.Generator().manual_seed(7)
    shapes = ((S, B, HEADS, WIDTH), (S, B, GROUPS, WIDTH), (S, B, GROUPS, WIDTH),
              (S, B, HEADS * WIDTH))
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _attend(module, q, k, v, mask, out_grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(out_grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _worker(rank, root):
    sys.path.insert(0, str(REPO))  # spawned interpreters start from scratch
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_parm import mcore_compat
    from megatron_parm.attention import ParmDotProductAttention, split_for_context_parallel

    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                            world_size=CP)
    mcore_compat.setup()
    try:
        parallel_state.initialize_model_parallel(context_parallel_size=CP)
        model_parallel_cuda_manual_seed(1234)
        q, k, v, out_grad = _inputs()
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
        reference = _attend(DotProductAttention(_config(1), 1, AttnMaskType.causal, "self"),
                            q, k, v, causal, out_grad)
        mine = [split_for_context_parallel(t, 0, CP, rank) for t in reference]
        worst = {}
        for comm in ("all_gather", "a2a"):
            module = ParmDotProductAttention(_config(CP), 1, AttnMaskType.causal, "self",
                                             cp_comm_type=comm)
            for masked in (True, False):
                mask = split_for_context_parallel(causal, 2, CP, rank) if masked else None
                ours = _attend(module, *(split_for_context_parallel(t, 0, CP, rank)
                                         for t in (q, k, v)),
                               mask, split_for_context_parallel(out_grad, 0, CP, rank))
                worst[f"{comm} {'mask' if masked else 'no mask'}"] = [
                    float((a - b).abs().max()) for a, b in zip(ours, mine)]
        with open(f"{root}/rank{rank}.json", "w") as handle:
            json.dump(worst, handle)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_two_cp_ranks_attend_as_one_rank_over_the_whole_sequence(tmp_path):
    """Outputs and the gradients of q, k, v on each CP rank: its rows of one rank's attention
    over the whole sequence (fp32, to rounding)."""
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path),), nprocs=CP)
    for rank in range(CP):
        worst = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(worst) == {"all_gather mask", "all_gather no mask", "a2a mask",
                              "a2a no mask"}
        for case, errors in worst.items():
            assert max(errors) < 1e-5, (rank, case, errors)  # output, dq, dk, dv


# ---------------------------------------------------------------------------------------------
# the user's mistakes
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def in_repo(monkeypatch, prepared_data):
    monkeypatch.chdir(REPO)


def _problem(argv, world_size=4, model_type="gpt"):
    from megatron_parm.training.arguments import parse_args

    with pytest.raises(ValueError) as error:
        parse_args(TINY_GPT + argv, model_type=model_type, world_size=world_size)
    return str(error.value)


def test_context_parallel_sizes_the_data_parallel_group(in_repo):
    from megatron_parm.training.arguments import parse_args

    args = parse_args(TINY_GPT + ["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                                  "--expert-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 2 and args.context_parallel_size == 2
    assert args.cp_comm_type == ["a2a"]


@pytest.mark.parametrize("argv, world_size, expected", [
    (["--context-parallel-size", "2"], 4,
     "--cp-comm-type p2p: only all_gather and a2a run without Transformer Engine"),
    (["--context-parallel-size", "3", "--cp-comm-type", "all_gather"], 3,
     "--seq-length (64) must be a multiple of 2 x --context-parallel-size (6)"),
    (["--context-parallel-size", "3", "--cp-comm-type", "all_gather"], 4,
     "--tensor-model-parallel-size x --context-parallel-size (1 x 3) must divide the world "
     "size (4)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "a2a", "a2a"], 4,
     "--cp-comm-type: one value for every layer or one per layer"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "all_gather"], 4,
     "--cp-comm-type a2a all_gather: a type per layer fails in Megatron-Core 0.16.1"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 4,
     "--cp-comm-type: 'ring' is none of p2p, all_gather, a2a, a2a+p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2"], 4,
     "--cp-comm-type a2a splits the heads of a TP rank over the CP ranks: --num-attention-heads"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], 4,
     "--hierarchical-context-parallel-sizes 2 2: hierarchical context parallelism"),
])
def test_a_user_mistake_is_one_line_naming_the_flag(in_repo, argv, world_size, expected):
    assert expected in _problem(argv, world_size)


def test_bert_refuses_context_parallelism(in_repo):
    from megatron_parm.training.arguments import parse_args

    with pytest.raises(ValueError, match="--context-parallel-size 2 with BERT is not built"):
        parse_args(["--config", str(REPO / "configs/bert_tiny_moe.yaml"),
                    "--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
                   model_type="bert", world_size=2)
