"""Stage b of tools/gpu_check.py: training on one rank in bf16 (checkpoint saved, loaded and
resumed) and in fp16 with dynamic loss scaling."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path


TRAIN_ITERS = 30
RESUME_ITERS = 5
FP16_ITERS = 12


def worker_train(out: Path, quick: bool) -> dict:
    """Stage b: bf16 training with parm on one rank, checkpoint saved / loaded / resumed; fp16."""
    import torch

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import describe_choice, initialize_distributed, pretrain

    initialize_distributed()
    iters = 8 if quick else TRAIN_ITERS
    checkpoint = tempfile.mkdtemp(prefix="gpu_check_ckpt_")
    base = ["--config", "configs/gpt2_tiny_moe.yaml", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--eval-iters", "1", "--moe-token-dispatcher-type", "parm",
            "--log-interval", str(max(iters // 3, 1))]
    bf16 = base + ["--bf16", "--save", checkpoint]
    first = pretrain(parse_args(bf16 + ["--train-iters", str(iters), "--eval-interval", str(iters)]))
    loaded = pretrain(parse_args(bf16 + ["--train-iters", str(iters), "--load", checkpoint,
                                         "--skip-train"]))
    # Longer than the saved run: the checkpoint's learning-rate schedule carries on.
    resumed = pretrain(parse_args(bf16 + ["--train-iters", str(iters + RESUME_ITERS), "--load",
                                          checkpoint, "--eval-interval", "100000",
                                          "--use-checkpoint-opt_param-scheduler"]))
    fp16_iters = 6 if quick else FP16_ITERS
    fp16 = pretrain(parse_args(base + ["--fp16", "--initial-loss-scale", str(2 ** 24),
                                       "--hysteresis", "1", "--train-iters", str(fp16_iters),
                                       "--eval-interval", "100000", "--log-interval",
                                       str(max(fp16_iters // 3, 1))]))
    losses = first["losses"]
    eval_trained = first["eval"][-1][1]["lm loss"]
    eval_loaded = loaded["eval"][-1][1]["lm loss"]
    checks = {
        "bf16 loss falls": losses[-1] < losses[0] - (0.2 if quick else 0.5),
        "checkpoint saved": bool(first["checkpoint"]) and os.path.isdir(first["checkpoint"]),
        # Scatter-adds on a GPU are not bitwise reproducible: equal to 1e-3 relative.
        "loaded checkpoint evaluates to the trained loss":
            abs(eval_loaded - eval_trained) <= 1e-3 * abs(eval_trained),
        "resumed for the remaining iterations":
            len(resumed["losses"]) == RESUME_ITERS and resumed["iteration"] == iters + RESUME_ITERS
            and all(math.isfinite(v) for v in resumed["losses"]),
        "fp16 trains with dynamic loss scaling": len(fp16["losses"]) == fp16_iters
            and all(math.isfinite(v) for v in fp16["losses"][-3:]),
    }
    return {"status": "passed" if all(checks.values()) else "failed",
            "reason": None if all(checks.values()) else
            "failed: " + "; ".join(name for name, ok in checks.items() if not ok),
            "backend": torch.distributed.get_backend(), "checks": checks,
            "bf16_losses": losses, "eval_after_training": eval_trained,
            "eval_after_loading": eval_loaded, "resumed_losses": resumed["losses"],
            "fp16_losses": fp16["losses"], "fp16_loss_scales": fp16.get("loss_scales"),
            "fp16_skipped_iterations": fp16.get("skipped_iterations"),
            "dispatcher_choices": [describe_choice(c) for c in (first.get("dispatcher_choices") or [])]}


MODERN_ITERS = 20
MODERN_CONFIGS = ("configs/qwen3_tiny_moe.yaml", "configs/deepseek_v2_lite_tiny_moe.yaml")


def worker_modern(out: Path, quick: bool) -> dict:
    """Stage h: today's MoE models on one rank in bf16: the Qwen3-like and DeepSeek-like tiny
    configs with parm (the DeepSeek-like one also with DeepSeek-V3's router and with
    --moe-shared-expert-overlap, whose shared experts run in a CUDA stream of their own)."""
    import torch

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import initialize_distributed, pretrain

    initialize_distributed()
    iters = 6 if quick else MODERN_ITERS

    def train(config, *flags):
        return pretrain(parse_args([
            "--config", config, "--bf16", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--train-iters", str(iters), "--eval-interval", str(iters), "--eval-iters", "1",
            "--log-interval", str(max(iters // 3, 1)), "--moe-token-dispatcher-type", "parm",
            *flags]))["losses"]

    losses = {Path(config).stem: train(config) for config in MODERN_CONFIGS}
    deepseek = MODERN_CONFIGS[1]
    losses["v3_router"] = train(deepseek, "--moe-router-score-function", "sigmoid",
                                "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4",
                                "--moe-router-group-topk", "2")
    losses["shared_expert_overlap"] = train(deepseek, "--moe-shared-expert-overlap")
    without = losses[Path(deepseek).stem]
    checks = {f"{name} loss falls": values[-1] < values[0] - (0.1 if quick else 0.3)
              for name, values in losses.items()}
    # bf16 on a GPU: the overlapped shared experts sum in another order (a stream of their own)
    checks["shared-expert overlap keeps the losses (2e-2)"] = max(
        abs(a - b) for a, b in zip(losses["shared_expert_overlap"], without)) <= 2e-2
    return {"status": "passed" if all(checks.values()) else "failed",
            "reason": None if all(checks.values()) else
            "failed: " + "; ".join(name for name, ok in checks.items() if not ok),
            "backend": torch.distributed.get_backend(), "checks": checks, "losses": losses}


OVERLAP_ITERS = 8


def worker_overlap(out: Path, quick: bool) -> dict:
    """Stage i: Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm) with a Parm
    dispatcher on 2 ranks sharing the GPU over gloo (expert parallelism needs 2 ranks; NCCL
    cannot put two on one GPU), bf16, 2 micro-batches per iteration: parm and parm_s1, with the
    schedule's own CUDA streams, and --delay-wgrad-compute with grouped experts; the losses
    equal the runs without the flag (bf16 on a GPU: 2e-2, sums in another order)."""
    import torch

    from megatron_parm import device
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import initialize_distributed, pretrain

    if not torch.distributed.is_initialized():  # gloo, even on the GPU (see the docstring)
        device.set_device(0)
        torch.distributed.init_process_group("gloo")
    initialize_distributed()
    iters = 4 if quick else OVERLAP_ITERS
    base = ["--config", "configs/gpt2_tiny_moe.yaml", "--bf16", "--expert-model-parallel-size",
            "2", "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters",
            str(iters), "--lr-warmup-iters", "1", "--eval-interval", str(10 * iters),
            "--eval-iters", "1", "--log-interval", str(max(iters // 2, 1))]
    runs = {}
    for name, flags in {"parm": ["--moe-token-dispatcher-type", "parm"],
                        "parm_s1": ["--moe-token-dispatcher-type", "parm_s1"],
                        "parm_s1_delay": ["--moe-token-dispatcher-type", "parm_s1",
                                          "--moe-grouped-gemm"]}.items():
        extra = ["--delay-wgrad-compute"] if name.endswith("_delay") else []
        runs[name] = {"without": pretrain(parse_args(base + flags))["losses"],
                      "with": pretrain(parse_args(base + flags + [
                          "--overlap-moe-expert-parallel-comm", *extra]))["losses"]}
    checks = {f"{name}: the overlap keeps the losses (2e-2)":
              len(r["with"]) == iters and max(abs(a - b) for a, b in
                                              zip(r["with"], r["without"])) <= 2e-2
              for name, r in runs.items()}
    return {"status": "passed" if all(checks.values()) else "failed",
            "reason": None if all(checks.values()) else
            "failed: " + "; ".join(name for name, ok in checks.items() if not ok),
            "backend": torch.distributed.get_backend(), "checks": checks, "losses": runs}
