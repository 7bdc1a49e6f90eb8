"""Megatron-Core's combined 1F1B schedule (--overlap-moe-expert-parallel-comm,
--delay-wgrad-compute) with every dispatcher, on 4 gloo ranks.

One torchrun launch (this file run as a script) trains, in one process per rank, each case
without and with the flags, from the same seed and data, 2 or 4 micro-batches per iteration
(with one, nothing overlaps):
  * GPT-2 MoE (tiny) at (tp, ep, etp) = (2, 2, 2), sequence parallel, in fp32, every
    dispatcher (Megatron-Core refuses the flag there; the config's field is set after its
    check, as a test may): the schedule itself, without bf16's rounding of sums whose order
    the node boundaries change; and in bf16 with alltoall, parm_s1 and parm;
  * BERT MoE (tiny), bf16, alltoall and parm;
  * GPT-2 MoE with 2 pipeline stages of 2 virtual stages each (tp 1, ep 2), bf16;
  * a DeepSeek-V2-Lite-like model (dense first layer, shared experts, rotary, RMSNorm,
    SwiGLU), bf16, also at TP 2 without sequence parallelism (a replicated layer input);
  * --delay-wgrad-compute with grouped experts (their weight gradients after the dispatch).
The tests then check: losses equal to the run without the flags (bf16 1e-4 relative, fp32
1e-6 relative, the tolerances Megatron-Core's own tests judge by), and that the
communication stream ran every MoE layer's dispatch and combine nodes of every micro-batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
ITERS = ["--train-iters", "3", "--lr-warmup-iters", "1", "--lr-decay-iters", "20",
         "--log-interval", "1", "--eval-interval", "100"]
GPT = ["--config", "configs/gpt2_tiny_moe.yaml", *ITERS]
BERT = ["--config", "configs/bert_tiny_moe.yaml", *ITERS]
DEEPSEEK = ["--config", "configs/deepseek_v2_lite_tiny_moe.yaml", *ITERS]
TP_SP = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
         "--sequence-parallel"]
# 2 micro-batches of 4 per data-parallel rank (DP 2)
TWO = ["--micro-batch-size", "4", "--global-batch-size", "16"]
# tp 1, ep 2, 2 stages of 2 virtual stages (one layer each), 4 micro-batches per rank
PIPELINE = ["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "2",
            "--global-batch-size", "16"]
BF16 = ["--bf16"]


def dispatchers():
    from megatron_parm import schedules

    return [name for name in schedules.names() if name != "allgather"]


def cases():
    """name -> (model type, flags): each is trained without and with OVERLAP."""
    out = {f"bf16_{d}": ("gpt", GPT + TP_SP + TWO + BF16 + ["--moe-token-dispatcher-type", d])
           for d in ("alltoall", "parm")}
    out.update({f"fp32_{d}": ("gpt", GPT + TP_SP + TWO + ["--moe-token-dispatcher-type", d])
                for d in dispatchers()})
    out.update({f"bert_{d}": ("bert", BERT + TP_SP + TWO + BF16 + ["--moe-token-dispatcher-type", d])
                for d in ("alltoall", "parm")})
    out.update({f"pp2_vpp2_{d}": ("gpt", GPT + PIPELINE + BF16 + ["--moe-token-dispatcher-type", d])
                for d in ("alltoall", "parm")})
    out.update({f"deepseek_{d}": ("gpt", DEEPSEEK + TP_SP + TWO + BF16
                                  + ["--moe-token-dispatcher-type", d])
                for d in ("parm_hier",)})
    out["deepseek_replicated_parm"] = ("gpt", DEEPSEEK + TWO + BF16 + [
        "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
        "--moe-token-dispatcher-type", "parm"])
    return out


# the second run of these adds --delay-wgrad-compute to OVERLAP; their first has OVERLAP
DELAY_CASES = {f"delay_{d}": ("gpt", GPT + TP_SP + TWO + BF16 + OVERLAP + [
    "--moe-grouped-gemm", "--moe-token-dispatcher-type", d]) for d in ("alltoall", "parm")}


def _pretrain(model_type, flags, fp32_overlap=False):
    """Losses of one run, and the communication stream's node counts in it."""
    from megatron_parm.mcore_compat import comm_stream
    from megatron_parm.training import model as model_module
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    build_config = model_module.build_config
    if fp32_overlap:  # past Megatron-Core's check, as its tests may
        def with_overlap(args):
            config = build_config(args)
            config.overlap_moe_expert_parallel_comm = True
            return config
        model_module.build_config = with_overlap
    try:
        losses = pretrain(parse_args(flags, model_type=model_type))["losses"]
    finally:
        model_module.build_config = build_config
    stream = comm_stream.worker_stream()
    stats = stream.take_stats() if stream is not None else {}
    return {"losses": losses, "nodes": {name: s["nodes"] for name, s in stats.items()}}


def worker(out_path: str, run_dir: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    results = {}
    for name, (model_type, flags) in cases().items():
        fp32 = name.startswith("fp32_")
        results[name] = {"base": _pretrain(model_type, flags),
                         "overlap": _pretrain(model_type, flags + ([] if fp32 else OVERLAP),
                                              fp32_overlap=fp32)}
    for name, (model_type, flags) in DELAY_CASES.items():
        results[name] = {"base": _pretrain(model_type, flags),
                         "overlap": _pretrain(model_type, flags + ["--delay-wgrad-compute"])}
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def run(tmp_path_factory, prepared_data):
    from launch import run_worker_module

    run_dir = tmp_path_factory.mktemp("moe_overlap")
    return run_worker_module(__file__, 4, run_dir, timeout=1800)[0]


def _relative_gap(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", [*cases(), *DELAY_CASES])
def test_overlap_leaves_the_losses(run, name):
    base, overlap = run[name]["base"]["losses"], run[name]["overlap"]["losses"]
    tolerance = 1e-6 if name.startswith("fp32_") else 1e-4
    assert len(base) == len(overlap) == 3
    assert _relative_gap(overlap, base) <= tolerance, (name, base, overlap)


@pytest.mark.parametrize("name", [*cases(), *DELAY_CASES])
def test_the_communication_stream_ran_every_moe_layers_nodes(run, name):
    """Each MoE layer's dispatch and combine, forward and backward, once per micro-batch of
    every iteration, on the communication stream; none without the flags."""
    nodes = run[name]["overlap"]["nodes"]
    # 3 iterations x micro-batches per rank x the rank's MoE layers: 2 of them in every model
    # here (tiny GPT's 2; DeepSeek-like's 3 but a dense first one; a pipeline rank's 2 chunks
    # of 1 of the 4), and 4 micro-batches per rank with the pipeline, else 2
    expected = 3 * (4 if name.startswith("pp2") else 2) * 2
    kinds = ("moe_dispatch forward", "moe_dispatch backward", "moe_combine forward",
             "moe_combine backward")
    assert {kind: nodes.get(kind) for kind in kinds} == dict.fromkeys(kinds, expected), nodes
    if name not in DELAY_CASES:  # (whose first run has the flag too)
        assert run[name]["base"]["nodes"] == {}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: torchrun --nproc-per-node 4 tests/e2e/test_moe_overlap.py worker OUT.json RUN_DIR")
    worker(sys.argv[2], sys.argv[3])
