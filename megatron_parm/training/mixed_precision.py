"""Mixed precision as in Megatron-LM: --bf16, or --fp16 with static or dynamic loss scaling.

    add_args(parser)             the flags, in their own group (Megatron-LM's names and defaults)
    validate(args)               refuses inconsistent flags (ValueError naming the flag)
    params_dtype(args)           the dtype the model's parameters are kept in
    wrap(model, config)          Megatron-Core's Float16Module around a bf16 / fp16 model
    optimizer_fields(args)       OptimizerConfig arguments: Megatron-Core then builds its
                                 mixed-precision optimizer (fp32 main parameters, loss scaler)
    grad_reduce_in_fp32(args)    whether DDP accumulates and all-reduces gradients in fp32

The model runs in bf16/fp16 (Float16Module casts inputs in and losses out); the optimizer keeps
an fp32 copy of every parameter ("main params"), steps on it and copies back. With --fp16 the
loss is scaled: by --loss-scale (static), or dynamically from --initial-loss-scale, halved on
every overflow (after --hysteresis overflows) down to --min-loss-scale, doubled after
--loss-scale-window clean iterations. An iteration whose gradients overflow is skipped.
Both work on CPU (gloo) too: the CPU redirects of megatron_parm.mcore_compat cover Megatron's
CUDA-only spots ("float16_param_types", "cuda_device_literals").
"""

from __future__ import annotations

import argparse

import torch

# Megatron-LM's defaults for dynamic loss scaling.
DYNAMIC_DEFAULTS = {"initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0,
                    "loss_scale_window": 1000, "hysteresis": 2}


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixed precision")
    group.add_argument("--bf16", action="store_true",
                       help="Run the model in bfloat16 (fp32 main parameters in the optimizer).")
    group.add_argument("--fp16", action="store_true",
                       help="Run the model in float16 with loss scaling (fp32 main parameters).")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static loss scale (a positive power of 2 helps fp16); without it "
                            "--fp16 scales dynamically.")
    group.add_argument("--initial-loss-scale", type=float, default=None,
                       help=f"Dynamic loss scaling: the first scale (default "
                            f"{DYNAMIC_DEFAULTS['initial_loss_scale']:.0f}, 2^32).")
    group.add_argument("--min-loss-scale", type=float, default=None,
                       help=f"Dynamic loss scaling: the smallest scale (default "
                            f"{DYNAMIC_DEFAULTS['min_loss_scale']}).")
    group.add_argument("--loss-scale-window", type=int, default=None,
                       help=f"Dynamic loss scaling: clean iterations before the scale doubles "
                            f"(default {DYNAMIC_DEFAULTS['loss_scale_window']}).")
    group.add_argument("--hysteresis", type=int, default=None,
                       help=f"Dynamic loss scaling: overflows tolerated before the scale halves "
                            f"(default {DYNAMIC_DEFAULTS['hysteresis']}).")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Accumulate and all-reduce gradients in fp32 (always so with "
                            "--bf16 and in fp32 runs; with --fp16 they are fp16 without it).")


def validate(args: argparse.Namespace) -> None:
    """Refuse what cannot run together; fill the dynamic-scaling defaults."""
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive: pick one")
    dynamic = [flag for flag in DYNAMIC_DEFAULTS if getattr(args, flag) is not None]
    if dynamic and not args.fp16:
        raise ValueError(f"--{dynamic[0].replace('_', '-')} sets dynamic loss scaling, which "
                         f"only --fp16 uses; give --fp16 or drop it")
    if dynamic and args.loss_scale is not None:
        raise ValueError(f"--{dynamic[0].replace('_', '-')} sets dynamic loss scaling, but "
                         f"--loss-scale {args.loss_scale} asks for a static one: give one of them")
    if args.loss_scale is not None:
        if not (args.fp16 or args.bf16):
            raise ValueError("--loss-scale needs --fp16 or --bf16 (fp32 training is not scaled)")
        if args.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {args.loss_scale}")
    for flag, default in DYNAMIC_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    if args.initial_loss_scale <= 0 or args.min_loss_scale <= 0:
        raise ValueError("--initial-loss-scale and --min-loss-scale must be positive")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ValueError(f"--min-loss-scale ({args.min_loss_scale}) must not exceed "
                         f"--initial-loss-scale ({args.initial_loss_scale})")
    for flag in ("loss_scale_window", "hysteresis"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.fp16:
        # Megatron-LM: bf16 (and fp32) gradients are accumulated and all-reduced in fp32.
        args.accumulate_allreduce_grads_in_fp32 = True


def _value(args, flag: str):
    """A flag's value; flags saved by an older version (a checkpoint's args) take the default."""
    if hasattr(args, flag):
        return getattr(args, flag)
    return DYNAMIC_DEFAULTS.get(flag, False if flag in ("bf16", "fp16") else None)


def dtype_name(args) -> str:
    """'bf16', 'fp16' or 'fp32': the parameters' dtype as layout_rules.DTYPE_BYTES names it."""
    return "bf16" if _value(args, "bf16") else "fp16" if _value(args, "fp16") else "fp32"


def params_dtype(args) -> torch.dtype:
    if _value(args, "bf16"):
        return torch.bfloat16
    if _value(args, "fp16"):
        return torch.float16
    return torch.float32


def wrap(model: torch.nn.Module, config) -> torch.nn.Module:
    """Float16Module(model) for a bf16/fp16 config (inputs cast in, outputs cast back to fp32),
    the model itself otherwise."""
    if not (config.bf16 or config.fp16):
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model)


def optimizer_fields(args) -> dict:
    """The mixed-precision part of Megatron-Core's OptimizerConfig."""
    fields = {flag: _value(args, flag) for flag in ("loss_scale", *DYNAMIC_DEFAULTS)}
    return dict(bf16=bool(_value(args, "bf16")), fp16=bool(_value(args, "fp16")),
                params_dtype=params_dtype(args), **fields)


def grad_reduce_in_fp32(args) -> bool:
    return not _value(args, "fp16") or bool(_value(args, "accumulate_allreduce_grads_in_fp32"))
