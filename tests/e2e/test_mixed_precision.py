"""bf16 and fp16 pretraining on 4 gloo ranks (tp=2, ep=2, sequence parallel), tiny GPT-2 MoE.

One torchrun launch (this file run as a script), in one process per rank:
  * --bf16 for 20 iterations with alltoall, parm_s1, parm_s2 and ds_baseline, same seed;
  * --bf16 with parm: 10 iterations saved at 5 and 10, and the same run stopped at 5 by
    --exit-interval and resumed from its checkpoint;
  * --fp16 with dynamic loss scaling from 2^24 (hysteresis 1): the first iterations overflow,
    are skipped and halve the scale, then training proceeds.
The tests check: bf16 loss falls; the Parm dispatchers follow alltoall's bf16 curve within 2e-2
relative; the model runs in bf16 with fp32 main parameters in Megatron's mixed-precision
optimizer, which the checkpoint holds (optimizer.state.fp32_param...); the resumed bf16 run
reproduces the uninterrupted one exactly; its --log-params-norm is the saved main parameters'
norm;
fp16's skipped iterations and loss scale show in Megatron-LM's log line.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = ["--config", "configs/gpt2_tiny_moe.yaml", "--tensor-model-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--eval-interval", "1000", "--eval-iters", "0"]
NUM_ITERS = 20
COMPARED = ["alltoall", "parm_s1", "parm_s2", "ds_baseline"]
REL_TOL = 2e-2


def worker(out_path: str, run_dir: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    run = Path(run_dir)
    results = {"bf16": {}}

    def train(*flags):
        return pretrain(parse_args(BASE + list(flags)))

    for name in COMPARED:
        results["bf16"][name] = train("--bf16", "--moe-token-dispatcher-type", name,
                                      "--train-iters", str(NUM_ITERS), "--log-interval", "10")["losses"]

    # parm decides by the model here: measured tuning would still be trying candidates at the
    # resume (16 calls per layer), and schedules agree in bf16 only to rounding.
    resume = ["--bf16", "--moe-token-dispatcher-type", "parm", "--no-parm-tune", "--train-iters", "10",
              "--log-interval", "5", "--hidden-dropout", "0.1", "--log-params-norm"]
    results["reference"] = train(*resume, "--save", f"{run}/ref", "--save-interval", "5")["losses"]
    results["first_half"] = train(*resume, "--save", f"{run}/stop", "--exit-interval", "5")["losses"]
    results["resumed"] = train(*resume, "--save", f"{run}/stop", "--load", f"{run}/stop")["losses"]

    fp16 = train("--fp16", "--initial-loss-scale", str(2 ** 24), "--hysteresis", "1",
                 "--moe-token-dispatcher-type", "parm_s2", "--train-iters", "16",
                 "--log-interval", "4")
    results["fp16"] = {key: fp16[key] for key in ("losses", "loss_scales", "skipped_iterations")}

    # What the bf16 run builds: parameter dtypes and the optimizer's main parameters.
    from megatron_parm.training.trainer import build_model_and_optimizer

    args = parse_args(BASE + ["--bf16", "--train-iters", "10"])
    chunks, optimizer, _ = build_model_and_optimizer(args, 8000)  # one per virtual stage
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    results["built"] = {
        "model_dtypes": sorted({str(p.dtype) for chunk in chunks for p in chunk.parameters()}),
        "optimizers": sorted({type(part).__name__ for part in parts}),
        "main_dtypes": sorted({str(p.dtype) for part in parts for p in part.get_parameters()}),
    }
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def run(tmp_path_factory, prepared_data):
    from launch import run_worker_module

    run_dir = tmp_path_factory.mktemp("mixed_precision")
    return (*run_worker_module(__file__, 4, run_dir), run_dir)


def test_bf16_builds_float16_module_and_fp32_main_params(run):
    built = run[0]["built"]
    assert built["model_dtypes"] == ["torch.bfloat16"], built
    assert built["optimizers"] == ["Float16OptimizerWithFloat16Params"], built
    assert built["main_dtypes"] == ["torch.float32"], built


def test_bf16_loss_falls(run):
    losses = run[0]["bf16"]["alltoall"]
    assert len(losses) == NUM_ITERS and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("dispatcher", COMPARED[1:])
def test_bf16_dispatchers_follow_alltoall(run, dispatcher):
    reference, losses = run[0]["bf16"]["alltoall"], run[0]["bf16"][dispatcher]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert len(losses) == NUM_ITERS and worst <= REL_TOL, (dispatcher, worst, losses, reference)


def test_bf16_resume_is_exact(run):
    results, _, run_dir = run
    reference = results["reference"]
    assert len(reference) == 10 and results["first_half"] == reference[:5]
    assert results["resumed"] == reference[5:], (results["resumed"], reference[5:])
    from megatron_parm.checkpointing.full import read_full

    full = read_full(str(run_dir / "ref/iter_0000010"))
    main = [key for key in full.tensors if key.startswith("optimizer.state.fp32_param.")]
    assert main and all(full.tensors[key].dtype.is_floating_point and
                        full.tensors[key].element_size() == 4 for key in main)
    weight = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert str(full.tensors[weight].dtype) == "torch.bfloat16"
    assert f"optimizer.state.fp32_param.{weight}" in full.tensors


def test_bf16_params_norm_is_the_saved_main_params_norm(run):
    """--log-params-norm in bf16 with Megatron-Core's mixed-precision optimizer: as Megatron-LM
    computes it, the norm of the fp32 main parameters the optimizer keeps on each bf16
    parameter, each shard of tp=2, ep=2 once, i.e. that of the main parameters the checkpoint
    of iteration 10 holds (the run that resumed to 10 prints the same)."""
    _, stdout, run_dir = run
    from megatron_parm.checkpointing.full import read_full

    full = read_full(str(run_dir / "ref/iter_0000010"))
    prefix = "optimizer.state.fp32_param."
    main = {key[len(prefix):]: tensor for key, tensor in full.tensors.items()
            if key.startswith(prefix)}
    assert set(main) == {key for key in full.tensors if not key.startswith("optimizer")}
    norm = sum(float((tensor.double() ** 2).sum()) for tensor in main.values()) ** 0.5
    logged = re.findall(r"^ iteration +10/ +10 \|.* params norm: ([\d.]+) \|", stdout, re.M)
    assert len(logged) == 2, stdout[-3000:]
    assert all(float(value) == pytest.approx(norm, abs=6e-4) for value in logged), (logged, norm)


def test_fp16_dynamic_loss_scaling(run):
    results, stdout, _ = run
    fp16 = results["fp16"]
    scales = [scale for _, scale in fp16["loss_scales"]]
    assert fp16["skipped_iterations"] >= 1 and scales[-1] < 2 ** 24, fp16
    assert all(value == value for value in fp16["losses"]), fp16  # no nan
    assert fp16["losses"][-1] < fp16["losses"][0] - 0.2, fp16
    line = re.search(r"loss scale: (\d+\.\d) \| (grad norm: [\d.]+ \| )?number of skipped "
                     r"iterations: +(\d+) \| number of nan iterations: +0 \|", stdout)
    assert line, stdout[-3000:]


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: torchrun --nproc-per-node 4 tests/e2e/test_mixed_precision.py worker OUT.json RUN_DIR")
    worker(sys.argv[2], sys.argv[3])
