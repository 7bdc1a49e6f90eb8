"""BERT under Megatron-Core's combined 1F1B schedule (--overlap-moe-expert-parallel-comm).

Megatron-Core 0.16.1 runs the combined 1F1B on models that build a schedule plan, which only
GPTModel does: ``TransformerModelChunkSchedulePlan`` cuts every transformer layer into nodes
(attention, MoE dispatch, experts, MoE combine) between a pre-process node (the embedding)
and a post-process node (the output layer and loss). A BERT encoder's layers are the same
TransformerLayers; only the two ends differ. ``ParmBertModel`` is Megatron-Core's BertModel
with ``build_schedule_plan``: Megatron's own plan over the encoder's layers, with BERT's ends:

    pre-process    token, position and token-type embeddings (the input tensor on a later
                   pipeline stage)
    post-process   the LM head, the output layer (tied to the embedding) and the per-token
                   loss, and with --bert-binary-head the pooler and binary head: the node's
                   outputs are (loss, binary logits), the loss function's arguments

The schedule's assertion that the model is a GPTModel is lifted for BertModel by
mcore_compat's ``combined_1f1b_bert`` redirect.
"""

from __future__ import annotations

import weakref

from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan
from megatron.core.pipeline_parallel.utils import ScheduleNode
from megatron.core.transformer.module import float16_to_fp32


class _EncoderAsDecoder:
    """What Megatron's chunk plan and layer nodes read of a GPTModel, for a BertModel: its
    transformer block as ``decoder`` (the last layer's node applies its final norm), its
    stage and its ends."""

    def __init__(self, bert: BertModel):
        self.decoder = bert.encoder
        self.mtp = None
        self.vp_stage = bert.vp_stage
        self.pre_process, self.post_process = bert.pre_process, bert.post_process
        self.config = bert.config


class _BertEnd(ScheduleNode):
    """A BERT end of the plan, on the compute stream (the model held weakly, as Megatron's
    own nodes hold theirs)."""

    def __init__(self, bert: BertModel, state, event, stream, name: str):
        self._bert = weakref.ref(bert)
        self.state = state
        ref = weakref.WeakMethod(self.forward_impl)
        super().__init__(lambda *args: ref()(*args), stream, event, name=name)

    @property
    def bert(self) -> BertModel:
        return self._bert()


class _BertPreProcess(_BertEnd):
    def forward_impl(self):
        bert, state = self.bert, self.state
        if not bert.pre_process:  # a later pipeline stage: the previous stage's activations
            return bert.encoder.input_tensor
        return bert.embedding(input_ids=state.input_ids,
                              position_ids=bert.bert_position_ids(state.input_ids),
                              tokentype_ids=state.tokentype_ids)


class _BertPostProcess(_BertEnd):
    def forward_impl(self, hidden_states):
        bert, state = self.bert, self.state
        head = bert.lm_head(hidden_states=hidden_states)
        weight = bert.shared_embedding_or_output_weight() \
            if bert.share_embeddings_and_output_weights else None
        logits, _ = bert.output_layer(head, weight=weight)
        loss = float16_to_fp32(bert.compute_language_model_loss(state.labels, logits))
        if bert.binary_head is None:
            return loss
        return loss, float16_to_fp32(bert.binary_head(bert.pooler(hidden_states, 0)))


class BertSchedulePlan(TransformerModelChunkSchedulePlan):
    """Megatron's chunk plan over a BertModel's encoder layers, with BERT's two ends."""

    def __init__(self, bert: BertModel, input_ids, attention_mask, tokentype_ids=None,
                 lm_labels=None):
        super().__init__(_EncoderAsDecoder(bert), input_ids, position_ids=None,
                         attention_mask=bert.bert_extended_attention_mask(attention_mask),
                         labels=lm_labels)
        state = self.state
        state.tokentype_ids = tokentype_ids
        # what the layer nodes read besides the mask (no rotary, packing or offsets in BERT)
        state.rotary_pos_emb = state.rotary_pos_cos = state.rotary_pos_sin = None
        state.sequence_len_offset = None
        stream = self.pre_process.stream
        self.pre_process = _BertPreProcess(bert, state, self.event, stream, "pre_process")
        if bert.post_process:
            self.post_process = _BertPostProcess(bert, state, self.event, stream, "post_process")


class ParmBertModel(BertModel):
    """Megatron-Core's BertModel, which the combined 1F1B schedule can also run."""

    def build_schedule_plan(self, input_ids, attention_mask, tokentype_ids=None, lm_labels=None):
        """The plan of one micro-batch: forward()'s arguments, its work cut into nodes."""
        return BertSchedulePlan(self, input_ids, attention_mask, tokentype_ids, lm_labels)
