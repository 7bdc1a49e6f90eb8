"""Which layer and expert implementation a run asks for, and whether this machine has it.

    TRANSFORMER_IMPLS            values of --transformer-impl
    expert_implementation(...)   the expert module a run builds (SequentialMLP, TorchGroupedMLP, ...)
    check_implementation(...)    ValueError naming the flag and the missing package

No torch or Megatron import here: the check runs while the flags are parsed, before any
process group exists. megatron_parm.specs.layer_spec builds the spec that was asked for.
"""

from __future__ import annotations

import importlib

from megatron_parm.layout_rules import grouped_gemm_problem

TRANSFORMER_IMPLS = ("local", "transformer_engine")


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
