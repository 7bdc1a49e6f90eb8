"""Which layer and expert implementation a run asks for, and whether this machine has it.

    TRANSFORMER_IMPLS            values of --transformer-impl
    expert_implementation(...)   the expert module a run builds (SequentialMLP, TorchGroupedMLP, ...)
    check_implementation(...)    ValueError naming the flag and the missing package
    EXPERT_IMPLS                 the expert modules by name, SequentialMLP (the default) first
    expert_impl_flags(name)      the (--transformer-impl, --moe-grouped-gemm) that build one
    expert_impl_problem(name, ...)  why this machine cannot run one (None: it can)

No torch or Megatron import here: the check runs while the flags are parsed, before any
process group exists. megatron_parm.specs.layer_spec builds the spec that was asked for.
"""

from __future__ import annotations

import importlib
from typing import Optional

from megatron_parm.layout_rules import grouped_gemm_problem

from megatron_parm.settings import TRANSFORMER_IMPLS  # noqa: E402  (with --transformer-impl)


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def expert_implementation(transformer_impl: str, moe_grouped_gemm: bool, *, cuda: bool,
                          bf16: bool) -> str:
    """The expert module a run builds (the start-up line names it): SequentialMLP without
    --moe-grouped-gemm; with it TEGroupedMLP (--transformer-impl transformer_engine),
    Megatron's GroupedMLP where the grouped_gemm package, a GPU and --bf16 are there (the
    flag's meaning in Megatron-LM), else TorchGroupedMLP (PyTorch's grouped_mm)."""
    if not moe_grouped_gemm:
        return "SequentialMLP"
    if transformer_impl == "transformer_engine":
        return "TEGroupedMLP"
    if cuda and bf16 and _importable("grouped_gemm"):
        return "GroupedMLP"
    return "TorchGroupedMLP"


def check_implementation(transformer_impl: str, moe_grouped_gemm: bool, *, model_type: str = "gpt",
                         num_experts=None, dtype: str = "fp32", add_bias_linear: bool = False,
                         cuda: bool = True, hidden_size: int = 0, ffn_per_rank: int = 0) -> None:
    """Refuse an expert / layer implementation this machine cannot build (ValueError naming
    the flag and the missing package or what to change), before any process group exists.

    --transformer-impl transformer_engine: Megatron-Core's TE layer spec (needs transformer-engine
    and a GPU; GPT only: Megatron-Core has no MoE BERT spec with TE).
    --moe-grouped-gemm: the experts of a layer as one grouped GEMM, by expert_implementation:
    grouped experts have no biases (--disable-bias-linear); PyTorch's grouped GEMM needs
    16-byte rows (layout_rules.grouped_gemm_problem).
    """
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl must be one of {', '.join(TRANSFORMER_IMPLS)}, "
                         f"got {transformer_impl!r}")
    if transformer_impl == "transformer_engine":
        if not _importable("transformer_engine"):
            raise ValueError("--transformer-impl transformer_engine needs the transformer-engine "
                             "package, which is not installed (use --transformer-impl local)")
        if not cuda:
            raise ValueError("--transformer-impl transformer_engine needs a GPU")
        if model_type != "gpt":
            raise ValueError(f"--transformer-impl transformer_engine: only GPT models here "
                             f"(Megatron-Core has no MoE {model_type.upper()} spec with "
                             f"Transformer Engine); use --transformer-impl local")
    if not moe_grouped_gemm:
        return
    if not num_experts:
        raise ValueError("--moe-grouped-gemm needs --num-experts (it groups the experts' GEMMs)")
    if transformer_impl == "local":
        if add_bias_linear:
            raise ValueError("--moe-grouped-gemm with --transformer-impl local needs "
                             "--disable-bias-linear (grouped experts have no biases)")
        if expert_implementation(transformer_impl, True, cuda=cuda,
                                 bf16=dtype == "bf16") == "TorchGroupedMLP":
            problem = grouped_gemm_problem(dtype, hidden_size, ffn_per_rank)
            if problem is not None:
                raise ValueError(f"--moe-grouped-gemm: {problem}")


# The expert modules a layer can be built with, by class name; the first is the default.
EXPERT_IMPLS = ("SequentialMLP", "TorchGroupedMLP", "GroupedMLP", "TEGroupedMLP")


def expert_impl_flags(name: str):
    """(--transformer-impl, --moe-grouped-gemm) of the layer spec that builds expert module
    `name` (megatron_parm.specs.layer_spec; ValueError for an unknown name)."""
    if name not in EXPERT_IMPLS:
        raise ValueError(f"unknown expert implementation {name!r}: one of {', '.join(EXPERT_IMPLS)}")
    if name == "TEGroupedMLP":
        return "transformer_engine", True
    return "local", name != "SequentialMLP"


def expert_impl_problem(name: str, *, cuda: bool, dtype: str, num_experts: int,
                        hidden_size: int, ffn_per_rank: int) -> Optional[str]:
    """Why expert module `name` cannot run here with these widths in dtype ('fp32', 'bf16',
    'fp16'), as a sentence; None where it can. For tools that run several side by side."""
    transformer_impl, grouped = expert_impl_flags(name)
    if name == "TorchGroupedMLP":  # what check_implementation checks where it would build it
        problem = grouped_gemm_problem(dtype, hidden_size, ffn_per_rank)
        return None if problem is None else f"--moe-grouped-gemm: {problem}"
    if name == "GroupedMLP" and expert_implementation(
            transformer_impl, grouped, cuda=cuda, bf16=dtype == "bf16") != name:
        return "GroupedMLP needs the grouped_gemm package, a GPU and bf16"
    try:
        check_implementation(transformer_impl, grouped, num_experts=num_experts, dtype=dtype,
                             cuda=cuda, hidden_size=hidden_size, ffn_per_rank=ffn_per_rank)
    except ValueError as err:
        return str(err)
    return None
