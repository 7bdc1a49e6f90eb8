"""Which layer and expert implementation a run asks for, and whether this machine has it.

    TRANSFORMER_IMPLS            values of --transformer-impl
    check_implementation(...)    ValueError naming the flag and the missing package

No torch or Megatron import here: the check runs while the flags are parsed, before any
process group exists. megatron_parm.specs.layer_spec builds the spec that was asked for.
"""

from __future__ import annotations

import importlib

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def check_implementation(transformer_impl: str, moe_grouped_gemm: bool, *, model_type: str = "gpt",
                         num_experts=None, bf16: bool = False, add_bias_linear: bool = False,
                         cuda: bool = True) -> None:
    """Refuse an expert / layer implementation this machine cannot build (ValueError naming
    the flag and the package), before any process group exists.

    --transformer-impl transformer_engine: Megatron-Core's TE layer spec (needs transformer-engine
    and a GPU; GPT only: Megatron-Core has no MoE BERT spec with TE).
    --moe-grouped-gemm: the experts of a layer as one grouped GEMM: TEGroupedMLP with
    transformer_engine, else Megatron's GroupedMLP (needs the grouped_gemm package, a GPU,
    --bf16 and --disable-bias-linear, as GroupedMLP asserts).
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
        if not _importable("grouped_gemm"):
            raise ValueError("--moe-grouped-gemm needs the grouped_gemm package, which is not "
                             "installed (or --transformer-impl transformer_engine with "
                             "transformer-engine installed)")
        if not cuda:
            raise ValueError("--moe-grouped-gemm needs a GPU (grouped_gemm runs on CUDA)")
        if not bf16:
            raise ValueError("--moe-grouped-gemm with --transformer-impl local needs --bf16 "
                             "(Megatron-Core's GroupedMLP runs in bf16 only)")
        if add_bias_linear:
            raise ValueError("--moe-grouped-gemm with --transformer-impl local needs "
                             "--disable-bias-linear (GroupedMLP has no biases)")
