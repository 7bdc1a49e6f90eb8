"""What a model needs of a parallel layout under Megatron-Core 0.16.1, in one place.

Torch-free, at the bottom of the package: training's flag checks (training/arguments.py) and
the layout planner (perf_model/transformer.py, perf_model/planner.py) ask the same questions
here and get the same one-line answers, each naming the flags to change. A dispatcher's own
rules are its entry in the schedule catalog (schedules.py).
"""

from __future__ import annotations

from typing import Optional

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GROUPED_GEMM_ALIGN_BYTES = 16  # PyTorch's grouped_mm: every operand row on a 16-byte boundary


def shape_problem(hidden_size: int, num_attention_heads: int, seq_length: int,
                  max_position_embeddings: int, num_experts: Optional[int], topk: int
                  ) -> Optional[str]:
    """Why the model's own sizes do not fit together, whatever the layout, or None."""
    if seq_length > max_position_embeddings:
        return (f"--seq-length ({seq_length}) must not exceed --max-position-embeddings "
                f"({max_position_embeddings})")
    if hidden_size % num_attention_heads != 0:
        return (f"--hidden-size ({hidden_size}) must be divisible by --num-attention-heads "
                f"({num_attention_heads})")
    if num_experts is not None and not 1 <= topk <= num_experts:
        return f"--moe-router-topk ({topk}) must be in [1, --num-experts ({num_experts})]"
    return None


def layout_problem(world_size: int, tp: int, ep: int, etp: int,
                   num_experts: Optional[int] = None) -> Optional[str]:
    """Why (tp, ep, etp) cannot lay out world_size ranks (or split num_experts), or None."""
    for flag, value in (("--tensor-model-parallel-size", tp), ("--expert-model-parallel-size", ep),
                        ("--expert-tensor-parallel-size", etp)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if world_size % tp != 0:
        return f"--tensor-model-parallel-size ({tp}) must divide the world size ({world_size})"
    if world_size % etp != 0:
        return f"--expert-tensor-parallel-size ({etp}) must divide the world size ({world_size})"
    if world_size % (etp * ep) != 0:
        return (f"--expert-tensor-parallel-size x --expert-model-parallel-size ({etp} x {ep}) "
                f"must divide the world size ({world_size})")
    if num_experts is not None and num_experts % ep != 0:
        return (f"--num-experts ({num_experts}) must be divisible by "
                f"--expert-model-parallel-size ({ep})")
    return None


def model_problem(tp: int, ep: int, etp: int, *, num_attention_heads: int, seq_length: int,
                  sequence_parallel: bool, num_experts: Optional[int],
                  moe_ffn_hidden_size: Optional[int], add_bias_linear: bool) -> Optional[str]:
    """Why the model cannot be split as (tp, ep, etp), or None.

    Attention heads and (with sequence parallelism) the sequence are split over TP, each
    expert's FFN over ETP (the experts over EP: layout_problem); Megatron-Core 0.16.1 has
    expert biases only at ETP 1.
    """
    if num_attention_heads % tp != 0:
        return (f"--num-attention-heads ({num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
    if sequence_parallel and seq_length % tp != 0:
        return (f"--seq-length ({seq_length}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")
    if num_experts is None:
        return (f"--expert-model-parallel-size {ep} needs --num-experts (without it the model "
                f"is dense)") if ep > 1 else None
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % etp != 0:
        return (f"--moe-ffn-hidden-size ({moe_ffn_hidden_size}) must be divisible by "
                f"--expert-tensor-parallel-size ({etp})")
    if add_bias_linear and etp != 1:
        return (f"--num-experts with linear biases needs --expert-tensor-parallel-size 1 "
                f"(got {etp}): Megatron-Core 0.16.1 supports expert biases only without expert "
                f"tensor parallelism; or give --disable-bias-linear")
    return None


def batch_problem(global_batch_size: int, micro_batch_size: int, data_parallel_size: int
                  ) -> Optional[str]:
    """Why the global batch does not split into micro-batches over the data-parallel ranks."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step != 0:
        return (f"--global-batch-size ({global_batch_size}) must be divisible by "
                f"--micro-batch-size x data-parallel size ({micro_batch_size} x "
                f"{data_parallel_size} = {per_step})")
    return None


def grouped_gemm_problem(dtype: str, hidden_size: int, ffn_per_rank: int) -> Optional[str]:
    """Why PyTorch's grouped GEMM (megatron_parm.experts.TorchGroupedMLP) cannot run experts of
    these widths in dtype ('fp32', 'bf16', 'fp16'): a sentence that says what to change; None
    where it can. Each row of its operands must start on a 16-byte boundary."""
    if dtype not in DTYPE_BYTES:
        return f"the grouped GEMM takes fp32, bf16 or fp16 weights, not {dtype}"
    step = GROUPED_GEMM_ALIGN_BYTES // DTYPE_BYTES[dtype]
    for flag, width in (("--hidden-size", hidden_size),
                        ("--moe-ffn-hidden-size / --expert-tensor-parallel-size", ffn_per_rank)):
        if width % step:
            return (f"{flag} gives rows of {width} {dtype} values ({width * DTYPE_BYTES[dtype]} "
                    f"bytes); the grouped GEMM needs a multiple of {step} values "
                    f"({GROUPED_GEMM_ALIGN_BYTES} bytes): change {flag}, or drop --moe-grouped-gemm")
    return None
