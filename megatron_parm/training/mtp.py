"""Multi-token prediction (--mtp-num-layers): Megatron-Core 0.16.1's MTP block in the GPT model,
and its losses for the log.

    config_fields(args)             the TransformerConfig's MTP fields
    block_spec(config, decoder_spec, whole_decoder_spec, vp_stage)
                                    the MTP block of this (virtual) stage, None where it has none
    drop_unused_output_weight(model)
                                    the dead output weight of a tied MTP stage, dropped
    model_layers(args)              layers the routers and the expert load count: the
                                    transformer layers, then the MTP layers' (num_layers + d)
    embedding_ranks(args)           Megatron-LM's embedding group for these flags, or None for
                                    Megatron-Core's default
    MtpLosses(mtp_num_layers).take(microbatches)
                                    the log's 'mtp_k loss' values (collective)

What Megatron-Core computes (gpt_model.py, multi_token_prediction.py), for depth k = 1..d:
h_k = final_norm_k(layer_k(eh_proj_k([enorm_k(emb(x shifted k left)); hnorm_k(h_{k-1})]))),
h_0 the decoder's output after its final norm; its loss is the cross entropy of the shared
output layer's logits of h_k against the labels shifted k left, masked by the loss mask shifted
k left (the last k positions masked off), averaged over the micro-batch's unmasked tokens. The
mean of the d losses times --mtp-loss-scaling-factor joins the language-model loss's gradient
(MTPLossAutoScaler, scaled like the main loss by Megatron's schedule); the loss value itself is
only logged, Megatron-LM's 'mtp_k loss'. Without --pipeline-model-parallel-layout the MTP
layers are on the last pipeline stage; with one, on the stage its m's name, which then holds a
copy of the word embeddings kept equal to the first stage's (its gradients all-reduced over
the embedding group, embedding_ranks).
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch

from megatron_parm import device
from megatron_parm.layout_rules import mtp_stages, pipeline_layout


# The flags Megatron-LM copies into the TransformerConfig under their own names.
CONFIG_FIELDS = ("mtp_num_layers", "mtp_loss_scaling_factor", "mtp_standalone")


def config_fields(args) -> dict:
    """The config's MTP fields (Megatron-LM copies them whatever --mtp-num-layers is:
    --mtp-standalone alone makes the pipeline's sends exchange their shapes)."""
    return {name: getattr(args, name) for name in CONFIG_FIELDS if hasattr(args, name)}


def block_spec(config, decoder_spec, whole_decoder_spec, vp_stage: Optional[int] = None):
    """Megatron-Core's MTP block spec for this (virtual) pipeline stage: one MTP layer per depth
    around a transformer layer of the decoder's last layer's kind (its MoE layer a ParmMoELayer
    where the decoder's is); None without MTP or where this stage holds none.
    decoder_spec: this stage's decoder-block spec; whole_decoder_spec(config): the whole
    model's, asked where a layout's stage holds MTP layers and no transformer layer (Megatron-LM
    then takes a layer spec of the whole model as well)."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not decoder_spec.layer_specs:
        decoder_spec = whole_decoder_spec(unpipelined(config))
    return get_gpt_mtp_block_spec(config, decoder_spec,
                                  use_transformer_engine=config.transformer_impl
                                  == "transformer_engine", vp_stage=vp_stage)


def unpipelined(config):
    """A copy of the config without pipelining (a spec built from it has every layer)."""
    whole = copy.copy(config)
    whole.pipeline_model_parallel_size = 1
    whole.virtual_pipeline_model_parallel_size = None
    whole.pipeline_model_parallel_layout = None
    whole.num_layers_in_first_pipeline_stage = whole.num_layers_in_last_pipeline_stage = None
    whole.account_for_embedding_in_pipeline_split = False
    whole.account_for_loss_in_pipeline_split = False
    return whole


def drop_unused_output_weight(model) -> None:
    """Megatron-Core 0.16.1 gives the output layer of a last pipeline stage that holds the MTP
    layers and shares the embeddings with the output layer (but not the first stage) a weight
    of its own, which its forward never reads (it passes the stage's copy of the word
    embeddings, the shared weight) and its checkpointing refuses to save (an assert in
    LanguageModule.tie_embeddings_and_output_weights_state_dict). Dropped, as the first stage
    does not allocate it."""
    if model.mtp_process and model.post_process and not model.pre_process \
            and model.share_embeddings_and_output_weights:
        model.output_layer.weight = None


def model_layers(args) -> int:
    """The layers Megatron-Core's routers number (the MTP layers' after the transformer
    layers: their MoE layers count as layers num_layers + 1, ...)."""
    return args.num_layers + (getattr(args, "mtp_num_layers", None) or 0)


def embedding_ranks(args):
    """Megatron-LM's rule for the ranks of a pipeline group that hold the word embeddings (its
    pretrain_gpt.get_embedding_ranks): the first stage's, the last's where the output layer
    shares them, and the MTP layers' stage; None (Megatron-Core's default, first and last)
    without MTP."""
    if not getattr(args, "mtp_num_layers", None):
        return None
    pp = args.pipeline_model_parallel_size
    stages = {pp - 1}  # without a layout the MTP layers are on the last stage
    if args.pipeline_model_parallel_layout is not None:
        stages = set(mtp_stages(pipeline_layout(args.pipeline_model_parallel_layout, pp,
                                                args.num_layers, args.mtp_num_layers)))
    if not args.untie_embeddings_and_output_weights:
        stages.add(pp - 1)

    def ranks(pp_ranks):
        if len(pp_ranks) == 1:
            return list(pp_ranks)
        return sorted({pp_ranks[0], *(pp_ranks[stage] for stage in stages)})
    return ranks


class MtpLosses:
    """The MTP losses Megatron-Core's GPTModel tracks (MTPLossLoggingHelper: per depth, the sum
    over the micro-batches of their mean loss, on the ranks of the stage that computes the
    loss), as Megatron-LM's training_log takes them: 'mtp_k loss', the mean over the
    micro-batches, averaged over the ranks that hold them (its data-parallel average; the
    tensor-parallel ranks hold the same value)."""

    def __init__(self, mtp_num_layers: Optional[int]):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        self.num_layers = mtp_num_layers or 0
        self.tracker = MTPLossLoggingHelper.tracker
        self.tracker.clear()  # a previous run in this process leaves its values (and size)

    def take(self, num_microbatches: int) -> Dict[str, float]:
        """{'mtp_k loss': the mean over the NUM_MICROBATCHES micro-batches tracked since the
        last take}, the tracker reset; {} without MTP. Collective over every rank."""
        if not self.num_layers:
            return {}
        # [d losses, 1 where this rank holds them]: summed over every rank, the last entry
        # counts the ranks the values come from
        totals = torch.zeros(self.num_layers + 1, device=device.current())
        if "values" in self.tracker:
            totals[:-1] = self.tracker["values"].detach().float()
            totals[-1] = 1.0
            self.tracker["values"].zero_()
        torch.distributed.all_reduce(totals)
        totals = device.to_host(totals)
        values = (totals[:-1] / (totals[-1].clamp(min=1) * max(num_microbatches, 1))).tolist()
        return {f"mtp_{depth + 1} loss": value for depth, value in enumerate(values)}
