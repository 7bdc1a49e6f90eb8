"""Model FLOPs as Megatron-LM counts them (--log-throughput, --log-progress).

    num_floating_point_operations(args, batch_size, padded_vocab_size)
                    one iteration of batch_size sequences, as Megatron-LM core_v0.16.1's
                    num_floating_point_operations counts it for the models built here
    throughput(flops, seconds, world_size)
                    TFLOP/s per rank: Megatron-LM's "throughput per GPU" (on CPU, per process)

Notation: b sequences, s sequence length, h hidden size, V padded vocabulary, k top-k.

Every GEMM of the model is counted three times (the forward pass, the backward's input and
weight gradients), at 2 FLOPs per multiply-add:
  attention   the q, k and v projections (k and v at the query groups' width with GQA; an
              output gate's projection where there is one), QK^T and its product with V at half
              the sequence (the causal mask), the output projection
  MLP         a dense layer's fc1 and fc2 at --ffn-hidden-size (SwiGLU: 3 widths, else 2); an
              MoE layer's routed experts at --moe-ffn-hidden-size, k per token, and its shared
              experts at --moe-shared-expert-intermediate-size
  logits      h x V
  MTP         per --mtp-num-layers: one more layer of the last layer's kind, its projection
              (2h x h), 3h for its norms (as Megatron-LM counts them), h x V more logits
Left out, as Megatron-LM leaves them out: the router, normalizations, softmax, activations, the
embeddings, BERT's LM-head transform and binary head (BERT is counted with the same formula, its
attention halved too). The count is linear in b: FLOPs so far = samples so far x the count of
one sample, whatever the batch sizes were.
"""

from __future__ import annotations

from typing import List

# Megatron-LM's factors: forward + the backward's two GEMMs; FLOPs per multiply-add.
FORWARD_BACKWARD = 3
PER_MULTIPLY_ADD = 2


def moe_layer_pattern(args) -> List[int]:
    """1 per MoE layer, 0 per dense layer (--moe-layer-freq: every n-th layer, or the list);
    all 0 without --num-experts."""
    if args.num_experts is None:
        return [0] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        return list(freq)
    return [1 if index % freq == 0 else 0 for index in range(args.num_layers)]


def _attention_term(args) -> float:
    """One layer's attention FLOPs per token (forward and backward)."""
    kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    query_groups = args.num_query_groups if args.group_query_attention \
        else args.num_attention_heads
    query = kv_channels * args.num_attention_heads
    key = value = kv_channels * query_groups
    gate = query if getattr(args, "attention_output_gate", False) else 0
    return FORWARD_BACKWARD * PER_MULTIPLY_ADD * (
        args.hidden_size * (query + key + value + gate)   # the projections
        + query * args.seq_length / 2 * 2                 # QK^T and (QK^T)V, causal half
        + query * args.hidden_size)                       # the output projection


def num_floating_point_operations(args, batch_size: int, padded_vocab_size: int) -> float:
    """One iteration's model FLOPs for batch_size sequences of args.seq_length tokens."""
    pattern = moe_layer_pattern(args)
    # the multi-token prediction layers: each one more layer of the last layer's kind, its two
    # norms and the final one, its projection of [embedding; hidden] (2h -> h), its logits
    mtp = args.mtp_num_layers or 0
    num_moe_layers = sum(pattern) + pattern[-1] * mtp
    num_dense_layers = args.num_layers + mtp - num_moe_layers
    topk = args.moe_router_topk if args.num_experts is not None else 0
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    shared_ffn = args.moe_shared_expert_intermediate_size or 0
    widths = 3 if args.swiglu else 2  # fc1 (twice as wide with SwiGLU) and fc2
    mlp = FORWARD_BACKWARD * PER_MULTIPLY_ADD * args.hidden_size * widths * (
        args.ffn_hidden_size * num_dense_layers
        + (moe_ffn * topk + shared_ffn) * num_moe_layers)
    logits = FORWARD_BACKWARD * PER_MULTIPLY_ADD * args.hidden_size * padded_vocab_size \
        * (1 + mtp)
    mtp_extra = FORWARD_BACKWARD * PER_MULTIPLY_ADD * mtp * (
        3 * args.hidden_size + 2 * args.hidden_size * args.hidden_size)
    per_token = mlp + _attention_term(args) * (args.num_layers + mtp) + mtp_extra + logits
    return batch_size * args.seq_length * per_token


def throughput(flops: float, seconds: float, world_size: int) -> float:
    """TFLOP/s per rank of FLOPS done in SECONDS by WORLD_SIZE ranks."""
    return flops / (seconds * 10 ** 12 * world_size)
