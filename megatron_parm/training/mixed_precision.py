"""Mixed precision as in Megatron-LM: --bf16, or --fp16 with static or dynamic loss scaling.

    (the flags and their defaults, Megatron-LM's, are declared in megatron_parm.settings)
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

from megatron_parm.layout_rules import precision_problem
from megatron_parm.settings import DYNAMIC_DEFAULTS  # Megatron-LM's, with the flags


def validate(args: argparse.Namespace) -> None:
    """Refuse what cannot run together; fill the dynamic-scaling defaults."""
    problem = precision_problem(args.bf16, args.fp16)
    if problem:
        raise ValueError(problem)
    dynamic = [flag for flag, default in DYNAMIC_DEFAULTS.items()
               if getattr(args, flag) not in (None, default)]
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
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16 (it keeps bf16 gradients in bf16)")
    if not args.fp16:
        # Megatron-LM: bf16 (and fp32) gradients are accumulated and all-reduced in fp32, bf16
        # ones in bf16 with --grad-reduce-in-bf16.
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16


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
    """fp32 gradients in DDP's buffers (fp32 runs; bf16 ones without --grad-reduce-in-bf16;
    fp16 ones with --accumulate-allreduce-grads-in-fp32)."""
    if _value(args, "bf16") and _value(args, "grad_reduce_in_bf16"):
        return False
    return not _value(args, "fp16") or bool(_value(args, "accumulate_allreduce_grads_in_fp32"))
