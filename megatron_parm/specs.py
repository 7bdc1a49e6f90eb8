"""Layer specs with ParmMoELayer as the MLP: Megatron's specs, one module swapped."""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_parm.layer import ParmMoELayer


def with_parm_moe(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a transformer-layer spec whose MoELayer MLP is a ParmMoELayer."""
    mlp = spec.submodules.mlp
    if not isinstance(mlp, ModuleSpec) or mlp.module is not MoELayer:
        return spec
    submodules = dataclasses.replace(spec.submodules, mlp=dataclasses.replace(mlp, module=ParmMoELayer))
    return dataclasses.replace(spec, submodules=submodules)


def get_gpt_layer_parm_spec(*args, **kwargs) -> ModuleSpec:
    """get_gpt_layer_local_spec (same arguments) with ParmMoELayer as the MoE MLP."""
    return with_parm_moe(get_gpt_layer_local_spec(*args, **kwargs))


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


def get_bert_layer_parm_spec(num_experts: int, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """Megatron's local BERT layer spec (padding attention mask) with a ParmMoELayer MLP.

    Megatron-Core has no MoE spec for BERT; the MoE MLP is the one of the GPT local spec.
    """
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec

    moe_mlp = get_gpt_layer_parm_spec(num_experts=num_experts,
                                      moe_grouped_gemm=moe_grouped_gemm).submodules.mlp
    submodules = dataclasses.replace(bert_layer_local_spec.submodules, mlp=moe_mlp)
    return dataclasses.replace(bert_layer_local_spec, submodules=submodules)
