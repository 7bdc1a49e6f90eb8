"""Layer specs with ParmMoELayer as the MLP: Megatron's specs, one module swapped."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_parm.layer import ParmMoELayer


class _KnownMoESubclass(logging.Filter):
    """Drops TransformerLayer's "Unknown MLP type" warning, once per layer per build.

    TransformerLayer hands its process groups only to MLP classes it knows by identity, so
    for a ParmMoELayer it warns and passes none; ParmMoELayer then takes Megatron's
    default process-group collection, the very groups it would have been handed. The
    warning says nothing true about our layer and buries real errors in the logs. It
    names only the spec's type, so this filter is installed once a Parm spec is built.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


_FILTER = _KnownMoESubclass()


class ExpertRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output an expert may add its bias to in place.

    An expert MLP with a bias adds it to linear_fc2's output in place (scaled by each token's
    probability). With EP = ETP = 1, Megatron's RowParallelLinear returns its output through
    an identity "all-reduce" over a group of one, a view autograd refuses to modify in place.
    This class copies the output in exactly that case (only with biases on); otherwise it is
    RowParallelLinear.
    """

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if self.is_expert and bias is not None and not self.explicit_expert_comm:
            output = output.clone()
        return output, bias


def with_parm_moe(spec: ModuleSpec, expert_impl: Optional[str] = None) -> ModuleSpec:
    """A copy of a transformer-layer spec whose MoELayer MLP is a ParmMoELayer.

    expert_impl "TorchGroupedMLP" puts megatron_parm.experts.TorchGroupedMLP in place of the
    spec's experts (see megatron_parm.experts.implementation_name); None keeps them."""
    mlp = spec.submodules.mlp
    if not isinstance(mlp, ModuleSpec) or mlp.module is not MoELayer:
        return spec
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    experts = mlp.submodules.experts
    if expert_impl == "TorchGroupedMLP":
        from megatron_parm.experts import TorchGroupedMLP

        experts = ModuleSpec(module=TorchGroupedMLP)
    elif expert_impl not in (None, experts.module.__name__):
        raise ValueError(f"expert_impl {expert_impl!r}: the spec builds {experts.module.__name__}")
    if getattr(experts.submodules, "linear_fc2", None) is RowParallelLinear:
        experts = dataclasses.replace(experts, submodules=dataclasses.replace(
            experts.submodules, linear_fc2=ExpertRowParallelLinear))
    moe = dataclasses.replace(mlp.submodules, experts=experts)
    submodules = dataclasses.replace(spec.submodules,
                                     mlp=dataclasses.replace(mlp, module=ParmMoELayer, submodules=moe))
    return dataclasses.replace(spec, submodules=submodules)


def with_core_attention(spec: ModuleSpec, context_parallel: bool = False) -> ModuleSpec:
    """A copy of a transformer-layer spec with the project's core attention in place of the
    local DotProductAttention: megatron_parm.attention.MLADotProductAttention in multi-latent
    attention (the local one cannot take MLA's key and value widths), and
    ParmDotProductAttention in the others where CONTEXT_PARALLEL (the local one refuses
    --context-parallel-size > 1); any other spec (Transformer Engine's) unchanged."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_parm.attention import MLADotProductAttention, ParmDotProductAttention

    attention = spec.submodules.self_attention
    if not isinstance(attention, ModuleSpec) \
            or attention.submodules.core_attention is not DotProductAttention:
        return spec
    if attention.module is MLASelfAttention:
        core = MLADotProductAttention
    elif context_parallel and issubclass(attention.module, SelfAttention):
        core = ParmDotProductAttention
    else:
        return spec
    submodules = dataclasses.replace(attention.submodules, core_attention=core)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attention, submodules=submodules)))


def get_gpt_layer_parm_spec(*args, expert_impl: Optional[str] = None, **kwargs) -> ModuleSpec:
    """get_gpt_layer_local_spec (same arguments) with ParmMoELayer as the MoE MLP (and
    expert_impl's experts: see with_parm_moe)."""
    if expert_impl == "TorchGroupedMLP":
        # Its experts replace the spec's: skip the legacy GroupedMLP spec and its warning.
        kwargs["moe_grouped_gemm"] = False
    return with_parm_moe(with_core_attention(get_gpt_layer_local_spec(*args, **kwargs)),
                         expert_impl)


def get_gpt_layer_parm_te_spec(*args, **kwargs) -> ModuleSpec:
    """get_gpt_layer_with_transformer_engine_spec (same arguments) with ParmMoELayer.

    Needs transformer-engine; raises ImportError naming it otherwise.
    """
    try:
        import transformer_engine  # noqa: F401
    except ImportError as err:
        raise ImportError("get_gpt_layer_parm_te_spec needs transformer-engine; use "
                          "get_gpt_layer_parm_spec without it") from err
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return with_parm_moe(get_gpt_layer_with_transformer_engine_spec(*args, **kwargs))


def gpt_block_spec(config, expert_impl: Optional[str] = None, vp_stage: Optional[int] = None):
    """Megatron-Core's GPT decoder-block spec for this config and pipeline stage (dense and MoE
    layers as config.moe_layer_freq says; its normalization, q/k norms: L2 with
    config.qk_l2_norm, as Megatron-LM's GPT builder asks), with ParmMoELayer in
    every MoE layer (and expert_impl's experts: see with_parm_moe)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = config.transformer_impl == "transformer_engine"
    if expert_impl == "TorchGroupedMLP":
        # Its experts replace the spec's: skip the legacy GroupedMLP spec and its warning.
        config = copy.copy(config)
        config.moe_grouped_gemm = False
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                       normalization=config.normalization,
                                       qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    context_parallel = config.context_parallel_size > 1
    block.layer_specs = [with_parm_moe(with_core_attention(spec, context_parallel), expert_impl)
                         for spec in block.layer_specs]
    return block


def layer_spec(model_type: str, num_experts, transformer_impl: str = "local",
               moe_grouped_gemm: bool = False, expert_impl: Optional[str] = None) -> ModuleSpec:
    """The transformer-layer spec with ParmMoELayer for a model type and implementation
    (checked first by megatron_parm.training.implementation.check_implementation); expert_impl
    as megatron_parm.experts.implementation_name names it."""
    if transformer_impl == "transformer_engine":
        return get_gpt_layer_parm_te_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    if model_type == "gpt":
        return get_gpt_layer_parm_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                       expert_impl=expert_impl)
    return get_bert_layer_parm_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                    expert_impl=expert_impl)


def get_bert_layer_parm_spec(num_experts: int, moe_grouped_gemm: bool = False,
                             expert_impl: Optional[str] = None) -> ModuleSpec:
    """Megatron's local BERT layer spec (padding attention mask) with a ParmMoELayer MLP.

    Megatron-Core has no MoE spec for BERT; the MoE MLP is the one of the GPT local spec.
    """
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec

    moe_mlp = get_gpt_layer_parm_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                      expert_impl=expert_impl).submodules.mlp
    submodules = dataclasses.replace(bert_layer_local_spec.submodules, mlp=moe_mlp)
    return dataclasses.replace(bert_layer_local_spec, submodules=submodules)
