"""The mixed-precision flags: bf16 / fp16 and fp16's loss scaling."""

from __future__ import annotations

from typing import List

from megatron_parm.settings import megatron_lm
from megatron_parm.settings.flag import Flag

GROUP = "mixed precision"
# Dynamic loss scaling's flags and Megatron-LM's defaults (training/mixed_precision.py: a value
# other than these asks for dynamic scaling).
DYNAMIC_DEFAULTS = {megatron_lm.option(name).dest: megatron_lm.option(name).default
                    for name in ("--initial-loss-scale", "--min-loss-scale",
                                 "--loss-scale-window", "--hysteresis")}


def flags() -> List[Flag]:
    return [
        Flag("--bf16", GROUP,
             help="Run the model in bfloat16 (fp32 main parameters in the optimizer)."),
        Flag("--fp16", GROUP,
             help="Run the model in float16 with loss scaling (fp32 main parameters)."),
        Flag("--loss-scale", GROUP,
             help="Static loss scale (a positive power of 2 helps fp16); without it --fp16 "
                  "scales dynamically."),
        Flag("--initial-loss-scale", GROUP, help="Dynamic loss scaling: the first scale "
             "(2^32)."),
        Flag("--min-loss-scale", GROUP, help="Dynamic loss scaling: the smallest scale."),
        Flag("--loss-scale-window", GROUP,
             help="Dynamic loss scaling: clean iterations before the scale doubles."),
        Flag("--hysteresis", GROUP,
             help="Dynamic loss scaling: overflows tolerated before the scale halves."),
        Flag("--grad-reduce-in-bf16", GROUP,
             help="With --bf16: accumulate and all-reduce gradients in bf16 (default fp32)."),
        Flag("--fp32-residual-connection", GROUP,
             help="With --bf16 / --fp16: keep the residual stream in fp32 (needs --transformer-impl "
                  "transformer_engine: torch's LayerNorm takes no fp32 input with bf16 weights)."),
        Flag("--accumulate-allreduce-grads-in-fp32", GROUP,
             help="Accumulate and all-reduce gradients in fp32 (always so with --bf16 and in "
                  "fp32 runs; with --fp16 they are fp16 without it)."),
    ]
