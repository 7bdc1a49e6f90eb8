"""Memory of one rank: parameters, gradients, optimizer state and activations.

Notation: see transformer.py (L, h, a, F, s, V, t, e, x) and shape.py (k, E); plus
    b  micro-batch size          n = s * b / t   tokens of one rank's sequence-parallel shard
    p  bytes per activation element (4 fp32, 2 bf16 / fp16)
    r  rows through this rank's experts in one layer (uniform routing, shape.py), read from
       the expert stage of the dispatcher's cost plan (megatron_parm/schedules.py):
           x * E * rows_per_expert(n)   alltoall, parm_s1, parm_s2 (A2A(EP), then AG(ESP))
           E * rows_per_expert(t * n)   ds_baseline (every TP rank routes all t * n tokens)

Model state, bytes per parameter, as Megatron-Core keeps it (the trainer reduces gradients
in fp32: DDP grad_reduce_in_fp32, i.e. --accumulate-allreduce-grads-in-fp32):

    precision   weights  gradients  fp32 main weights  Adam (exp_avg, exp_avg_sq)
    fp32        4        4          -                  8
    bf16, fp16  2        4          4                  8

With --use-distributed-optimizer the main weights and Adam states (and fp32 main gradients
where the gradients themselves are 2-byte) are sharded over the data-parallel group that
reduces them: W / t for dense parameters, W / (e * x) for expert parameters. That is Megatron's
table (fp32: 16 -> 8 + 8/d bytes; bf16 with fp32 gradients: 18 -> 6 + 12/d).

Activations: the bytes autograd keeps for the backward pass of one micro-batch, counted tensor
by tensor for Megatron-Core's local layer spec without activation recomputation (c, g, D, S,
u: transformer.py; w = a c, the attention's width):

    per layer   norms:      inputs 2 n h p + fp32 statistics 2 n y (y = 8 for LayerNorm's
                            mean and rstd, 4 for RMSNorm's rstd, as fused GPU kernels keep them)
                attention:  QKV input n h p; the Q, K, V the matmuls keep, n w p each
                            where it is a tensor of its own (Q and K after rope or the q/k
                            norms, K and V repeated from g to a heads by the local attention
                            under GQA, and Q wherever a rank holds several key/value groups
                            under GQA, g_t > 1 and a > g: its heads are then copied out of the
                            interleaved QKV output, a copy the q norm keeps too, n w p more),
                            and the QKV output t n (a/t + 2 g_t) c p where one of
                            them is a view of it or the q/k norms keep it (g_t = g / t
                            key/value heads a rank computes; at g < t Megatron all-gathers the
                            QKV output of every head over the whole sequence, t n (a + 2 g) c p,
                            and g_t = 1); softmax output b (a/t) s^2 q,
                            projection input n w p
                            (q = 4 in fp32; 6 in bf16/fp16: the softmax runs in fp32 and its
                            fp32 output and the 2-byte copy for the next matmul are both kept)
                MLA:        (--multi-latent-attention, w = a dv) the input n h p, Q and K n a
                            (dk + dr) p each, V (a copy out of the key/value up projection's
                            output) and the projection input n w p each; the key/value latent
                            the up projection takes: a view of the down projection's output,
                            n (kl + dr) p, at t = 1, a sequence-parallel shard of its own,
                            n kl p, at t > 1; the query latent n ql p; with --qk-layernorm each
                            latent's norm keeps its output too, n kl p (n ql p), and its fp32
                            statistics n y
                rope:       the cos and sin of Q and of K, 4 s c p (MLA: 4 s dr p, its own)
                q/k norms:  (--qk-layernorm) their fp32 statistics t n (a/t + g_t) y
                dropout (when > 0): attention mask and output b (a/t) s^2 (m + p), two
                            residual masks 2 n h m (m: bytes of a dropout mask, 1 on GPUs,
                            whose fused dropout keeps a bool mask; p on CPUs, where
                            torch keeps the scaled noise tensor)
                MoE layer:  router input n h p; the router's tensors n (12 k + 4 E) (the
                            int64 top-k index, the fp32 softmax over the top k, the fp32 scores
                            over E the aux loss takes; a second index tensor, saved to make the
                            routing map, is dropped with its graph before the forward ends;
                            with --moe-router-pre-softmax the softmax over all E replaces the
                            one over k: n (8 k + 8 E)); the permutation's 5 E bytes per token
                            it routes (n, ds_baseline's t n: the routing map, the probabilities
                            by expert in fp32) and its int64 row index, 8 bytes per permuted
                            row (E rows_per_expert of those tokens: k per token dropless); a
                            chunked schedule (parm_s2, at its 2 or more chunks) keeps the row
                            index a second time, in chunk order;
                            experts r (h + (j + 1) F / x) p + 4 r (fc1 input, fc1 output and
                            activation j F: j = 2 for GeLU, 5 for SwiGLU (fc1's 2 F, SiLU's
                            output, the linear half plus Megatron's glu_linear_offset, their
                            product), probability-scaled activation; the row probabilities in
                            fp32); shared experts j n S p (their input is the router's), their
                            gate n h p + n p; with --moe-shared-expert-overlap the shared
                            experts keep (j - 1) n S p for SwiGLU (their overlapped forward
                            has no glu_linear_offset tensor) and, at t > 1, the input they
                            all-gather themselves, t n h p (their fc1 keeps it whole)
                dense layer: MLP fc1 input n h p, fc1 output and activation j n D p
    On CPUs (fused_norms False) torch's RMSNorm is not fused and also keeps its normalised
    input, n h p per norm (t n (a/t + g_t) c p for the q/k norms).
    model       token ids 8 b s (t > 1: + b s, the vocab-parallel embedding's mask), learned
                position ids 8 b s (BERT's: 8 s, one row broadcast), BERT's token types
                8 b s, attention mask b s^2 (bool),
                embedding dropout n h m, final LayerNorm n h p + 8 n,
                head: GPT output-layer input n h p; BERT pooler/lm_head inputs 4 n h p + 8 n
                (t > 1: + s b h p, the pooler all-gathers the sequence for its first token),
                loss: the fp32 softmax of the logits s b V / t * 4 (the vocab-parallel cross
                entropy keeps it in fp32 in every precision) + 13 s b (labels, their
                mask, the fp32 loss mask)

Pipeline parallelism (p = pp stages, Megatron's order: layout.py). Stage i holds its L_i
transformer layers (layout_rules.pipeline_stage_layers: L / p each); the first stage the
embeddings, the last the final LayerNorm, the head and, with tied embeddings, its own copy of
the word embeddings (Megatron keeps the two copies equal by an all-reduce of their gradients).
Its activations are those of the micro-batches its schedule holds at once (m micro-batches
per step): Megatron-Core's 1F1B runs p - 1 - i forward passes before its first backward, so
stage i holds min(p - i, m) micro-batches of its layers (the first stage p: the whole model's
layer activations once, L / p layers x p). With interleaving (v virtual stages of L / (p v)
layers per rank), rank i's warm-up runs 2 (p - 1 - i) + (v - 1) p model chunks, so it holds
min(2 (p - 1 - i) + (v - 1) p + 1, m v) chunks: on the first stage L (1 + (p - 1) / (p v))
layers' worth, the interleaving's extra. The model-level terms (ids and embedding on the
first stage, head and loss on the last) count once per micro-batch in flight, min(p - i, m);
the attention mask b s^2 is on every stage (each model chunk's attention reads its own copy
of the micro-batch's), once per (micro-batch, chunk) in flight. A stage whose layers mix dense
and MoE layers (--moe-layer-freq) counts each chunk in flight at the mean of its chunks'
layers. The memory of a layout is that of its fullest stage.

Activation recomputation (--recompute-granularity and its flags; what each choice keeps:
recompute.py) changes a layer's row: selective recomputation drops its modules' parts of it
(LayerActivations.kept), full recomputation keeps a recomputed layer's input n h p alone. The
peak may then come in the backward pass, while one checkpoint's layers are recomputed whole:
the layers the backward has not reached keep what they keep, the head's tensors (last stage)
are gone; a stage holds the larger of that and its forward peak, the other micro-batches in
flight keeping theirs.

tests/distributed/test_planner_memory.py measures the same quantity on CPU (the storages of
the tensors saved for backward, through torch.autograd.graph.saved_tensors_hooks) for the
tiny configs and several layouts and dispatchers, and at pp = 2 and 4 the peak of those a
stage holds in one training step of Megatron-Core's 1F1B schedule.
"""

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm import schedules
from megatron_parm.data.vocab import padded_vocab_size
from megatron_parm.layout_rules import pipeline_stage_layers
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.recompute import NONE, Recompute
from megatron_parm.perf_model.shape import LayerShape
from megatron_parm.perf_model.shape import layer_shape as shape_of_layer
from megatron_parm.perf_model.transformer import (ModelSpec, ParameterCounts,
                                                  layer_parameter_counts, parameter_counts,
                                                  per_rank_spec)
from megatron_parm.perf_model.volumes import build_plan
from megatron_parm.schedules import COMPUTE, EXPERTS, FORWARD

PRECISIONS = ("fp32", "bf16", "fp16")
GIB = 2 ** 30


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state, for --bf16 / --fp16 / neither."""

    name: str
    grad_bytes: int = 4  # the trainer reduces gradients in fp32 (grad_reduce_in_fp32)

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.name!r}")

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    @property
    def activation_bytes(self) -> int:
        return 2 if self.mixed else 4

    @property
    def weight_bytes(self) -> int:
        return 2 if self.mixed else 4

    @property
    def main_state_bytes(self) -> int:
        """Optimizer-side bytes per parameter: fp32 main weights (mixed precision only), fp32
        main gradients where the gradients are 2-byte, Adam's two fp32 moments."""
        main_weights = 4 if self.mixed else 0
        main_grads = 4 if self.grad_bytes < 4 else 0
        return main_weights + main_grads + 8


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    parameters: Dict[str, int]  # ParameterCounts.as_dict()
    stage: int = 0  # the pipeline stage these bytes are of (the fullest one)
    microbatches_in_flight: int = 1  # micro-batches whose activations that stage holds

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> Dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "total": self.total, "parameters": dict(self.parameters),
                "stage": self.stage, "microbatches_in_flight": self.microbatches_in_flight}


def layer_shape(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                precision: Precision) -> LayerShape:
    """The MoE layer of a planned model as the performance model sees it (shape.layer_shape)."""
    return shape_of_layer(seq_length=spec.seq_length, micro_batch_size=micro_batch_size,
                          tp=layout.tp, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.moe_ffn_hidden_size, num_experts=spec.num_experts,
                          topk=spec.topk, capacity_factor=spec.capacity_factor,
                          pad_to_capacity=spec.pad_to_capacity,
                          dtype_bytes=precision.activation_bytes,
                          gated_linear_unit=spec.swiglu, grouped_experts=spec.moe_grouped_gemm)


def expert_rows(shape: LayerShape, layout: Layout, dispatcher: str) -> float:
    """r: rows through this rank's experts in one layer (uniform routing): the forward expert
    flops of the dispatcher's cost plan over the flops of one row."""
    flops = sum(step.flops for step in build_plan(dispatcher, shape, layout)
                if step.kind == COMPUTE and step.direction == FORWARD and step.name == EXPERTS)
    return flops / shape.expert_flops_per_row(layout.etp)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's bytes saved for backward by one micro-batch on one rank (the module
    docstring's table), by the parts activation recomputation can drop (recompute.py)."""

    layer_input: float  # n h p: what a fully recomputed layer keeps
    layernorms: float  # the norms' inputs and statistics (selective layernorm drops as much)
    scores: float  # the softmax output and the attention dropout (selective core_attn)
    attention_rest: float  # the attention's other tensors and the residual dropout masks
    moe: float  # an MoE layer's MLP side: router, routing, experts, shared experts
    expert_activation: float  # of `moe`: the experts' activation outputs (moe_act)
    shared_experts: float  # of `moe`: the shared experts' fc1 outputs and activation
    dense_mlp: float  # a dense layer's MLP

    def total(self, moe: bool) -> float:
        """Without recomputation."""
        return (self.layernorms + self.scores + self.attention_rest
                + (self.moe if moe else self.dense_mlp))

    def kept(self, moe: bool, recompute: Recompute) -> float:
        """What the layer keeps under selective recomputation (or none); a fully recomputed
        layer keeps layer_input (recompute.py)."""
        dropped = self.mlp_dropped(moe, recompute)
        if recompute.selects("layernorm"):
            dropped += self.layernorms
        if recompute.selects("core_attn"):
            dropped += self.scores
        return self.total(moe) - dropped

    def mlp_dropped(self, moe: bool, recompute: Recompute) -> float:
        """What selective recomputation drops of the MLP side (mlp, moe, moe_act,
        shared_experts), the layer's last part: its backward recomputes it while the rest of
        the layer still keeps its tensors (the attention's parts are recomputed after the MLP
        side's backward has freed it)."""
        if moe and recompute.selects("moe"):
            return self.moe - self.layer_input  # its input, the norm output, stays
        if moe:
            return ((self.expert_activation if recompute.selects("moe_act") else 0.0)
                    + (self.shared_experts if recompute.selects("shared_experts") else 0.0))
        return self.dense_mlp - self.layer_input if recompute.selects("mlp") else 0.0


def _activation_terms(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                      precision: Precision, dispatcher: str, dropout_mask_bytes: int,
                      fused_norms: bool = True
                      ) -> Tuple[LayerActivations, float, float, float]:
    """(a layer's parts, the attention mask every stage holds, the first stage's other
    model-level terms, the last stage's): bytes saved for backward by one micro-batch on one
    rank (the module docstring's table)."""
    t, b, s = layout.tp, micro_batch_size, spec.seq_length
    h, p, m = spec.hidden_size, precision.activation_bytes, dropout_mask_bytes
    shape = layer_shape(spec, layout, micro_batch_size, precision)
    n = shape.num_tokens
    width, heads = spec.attention_width, spec.num_attention_heads
    scores = b * (heads // t) * s * s * layout.cp  # a CP rank's queries see every key
    softmax_bytes = 4 + (2 if precision.mixed else 0)
    statistics = 8 if spec.normalization == "LayerNorm" else 4  # y: fp32 mean and rstd / rstd

    unfused_rms = spec.normalization == "RMSNorm" and not fused_norms
    layernorms = 2 * n * h * p * (2 if unfused_rms else 1) + 2 * n * statistics
    if spec.multi_latent_attention:
        attention = n * h * p + _mla_bytes(spec, t, n, p, statistics, unfused_rms) + n * width * p
    else:
        attention = n * h * p + _qkv_bytes(spec, t, n, p) + n * width * p
    if layout.cp > 1:  # the other CP ranks' keys and values, gathered and kept for backward
        attention += (layout.cp - 1) * b * s * spec.key_value_width // t * p
    if spec.has_rotary:
        attention += 4 * s * spec.rotary_channels * p
    if spec.qk_layernorm and not spec.multi_latent_attention:
        rows = t * n * (heads // t + max(spec.query_groups // t, 1))  # (token, head) pairs
        attention += rows * statistics
        attention += rows * spec.head_channels * p if unfused_rms else 0
    scores_bytes = scores * softmax_bytes
    if spec.attention_dropout > 0:
        scores_bytes += scores * (m + p)
    if spec.hidden_dropout > 0:
        attention += 2 * n * h * m
    moe, expert_activation, shared = _moe_terms(spec, layout, shape, dispatcher, p)
    dense_mlp = n * h * p + _mlp_kept(spec) * n * spec.dense_ffn_hidden_size * p
    layer = LayerActivations(layer_input=n * h * p, layernorms=layernorms, scores=scores_bytes,
                             attention_rest=attention, moe=moe,
                             expert_activation=expert_activation, shared_experts=shared,
                             dense_mlp=dense_mlp)

    mask = b * s * s  # bool
    bert = spec.model_type == "bert"
    ids = 8 * b * s + (b * s if t > 1 else 0)  # tokens; the vocab-parallel embedding's mask
    if spec.position_table:  # BERT's position ids are one row, broadcast over the batch
        ids += 8 * s if bert else 8 * b * s
    if bert and spec.bert_binary_head:  # token types
        ids += 8 * b * s
    first = ids + (n * h * m if spec.hidden_dropout > 0 else 0)
    last = n * h * p * (2 if unfused_rms else 1) + n * statistics  # final norm
    if spec.model_type == "bert":
        last += 4 * n * h * p + 8 * n
        if spec.bert_binary_head and t > 1:  # the pooler's gathered sequence
            last += s * b * h * p
    else:
        last += n * h * p
    vocab = padded_vocab_size(spec.vocab_size, t)
    last += s * b * vocab // t * 4 + 13 * s * b
    return layer, mask, first, last


def _mlp_kept(spec: ModelSpec) -> int:
    """j: fc1's output and the activation's tensors an MLP keeps, per FFN channel."""
    return 5 if spec.swiglu else 2


def _moe_terms(spec: ModelSpec, layout: Layout, shape: LayerShape, dispatcher: str,
               p: int) -> Tuple[float, float, float]:
    """(an MoE layer's MLP side, of it the experts' activation outputs moe_act recomputes,
    the shared experts' tensors): the module docstring's MoE row."""
    n, h, k = shape.num_tokens, spec.hidden_size, spec.topk
    rows = expert_rows(shape, layout, dispatcher)
    kept = _mlp_kept(spec)
    channels = spec.moe_ffn_hidden_size / layout.etp
    experts = spec.num_experts
    router = 8 * k + 8 * experts if spec.router_pre_softmax else 12 * k + 4 * experts
    schedule = schedules.get(dispatcher)
    # ds_baseline permutes all t n tokens of its TP group (schedules.baseline_cost)
    routed = layout.tp * n if schedule.kind == schedules.BASELINE else n
    permuted_rows = experts * shape.rows_per_expert(routed)
    indices = 2 if schedule.chunked else 1  # parm_s2's second, in chunk order
    moe = (n * h * p + n * router + routed * 5 * experts + 8 * indices * permuted_rows
           + rows * (h + (kept + 1) * channels) * p + 4 * rows)
    # moe_act: all but fc1's u F outputs of the (j + 1) F per row
    expert_activation = rows * (kept + 1 - spec.fc1_factor) * channels * p
    shared = 0.0
    if spec.shared_expert_size:
        overlapped = spec.shared_expert_overlap
        # overlapped, SwiGLU keeps no glu_linear_offset sum (SharedExpertMLP's own forward)
        per_channel = kept - 1 if overlapped and spec.swiglu else kept
        shared = per_channel * n * spec.shared_expert_size * p
        if overlapped and layout.tp > 1:  # their own gather of the input, kept by fc1
            shared += layout.tp * n * h * p
    moe += shared
    if spec.shared_expert_size and spec.shared_expert_gate:
        moe += n * h * p + n * p  # the gated output's input and the sigmoid's output
    return moe, expert_activation, shared


def _qkv_bytes(spec: ModelSpec, t: int, n: int, p: int) -> float:
    """The Q, K and V one rank's attention keeps, and the QKV output where they (or the q/k
    norms) keep it through views (module docstring)."""
    heads, groups = spec.num_attention_heads // t, max(spec.query_groups // t, 1)
    repeated = heads != groups  # GQA: K and V repeated to the queries' heads
    transformed = spec.position_embedding_type == "rope" or spec.qk_layernorm
    # Q's heads of several groups cannot be a view of the interleaved QKV output: a copy
    q_copy = spec.num_attention_heads > spec.query_groups and groups > 1
    own = (transformed or q_copy, transformed or repeated, repeated)  # Q, K, V: own tensors
    # the QKV output of the rank's sequence (t n tokens): at g < t every head's, gathered
    qkv = t * (spec.qkv_width if spec.query_groups < t else (heads + 2 * groups) * spec.head_channels)
    keeps_qkv = spec.qk_layernorm or not all(own)
    q_norm_input = spec.qk_layernorm and q_copy  # the q norm keeps the copy it normalises
    return ((sum(own) + q_norm_input) * n * spec.attention_width * p
            + (n * qkv * p if keeps_qkv else 0))


def _mla_bytes(spec: ModelSpec, t: int, n: int, p: int, statistics: int,
               unfused_rms: bool) -> float:
    """What multi-latent attention keeps of its queries, keys, values and latents (module
    docstring)."""
    def latent(width: int, kept: float) -> float:  # kept by the up projection, and its norm
        if not spec.qk_layernorm:
            return kept
        return kept + n * statistics + n * width * p * (2 if unfused_rms else 1)

    kv_kept = n * (spec.kv_lora_rank + (spec.qk_pos_emb_head_dim if t == 1 else 0)) * p
    total = 2 * n * spec.key_width * p + n * spec.attention_width * p  # Q, K, V
    total += latent(spec.kv_lora_rank, kv_kept)
    if spec.q_lora_rank:
        total += latent(spec.q_lora_rank, n * spec.q_lora_rank * p)
    return total


def _layers_bytes(spec: ModelSpec, layer: LayerActivations, layers: Sequence[int],
                  recompute: Recompute = NONE) -> Tuple[float, float]:
    """(bytes these transformer layers (a model chunk's, indices) keep for backward, the most
    they hold while the backward pass recomputes one checkpoint of them): dense and MoE
    layers each theirs. The second counts the layers the backward has not reached yet (their
    kept bytes) and the checkpoint's layers whole (selective: the layer's MLP side)."""
    moe_layers, layers = spec.moe_layers, list(layers)
    kept = [layer.kept(moe_layers[index], recompute) for index in layers]
    recomputing = 0.0
    # sums of kept[:i + 1], added in the same order as sum() would (so the same floats)
    through = list(itertools.accumulate(kept))
    for local, index in enumerate(layers):  # selective: a layer's MLP side, recomputed
        dropped = layer.mlp_dropped(moe_layers[index], recompute)
        if dropped:
            recomputing = max(recomputing, through[local] + dropped)
    for unit in recompute.units(len(layers)):
        for local in unit:
            kept[local] = layer.layer_input
        before = sum(kept[:unit[0]])  # the checkpoint's input: its first norm's, in `whole`
        whole = sum(layer.total(moe_layers[layers[local]]) for local in unit)
        recomputing = max(recomputing, before + whole)
    return sum(kept), recomputing


def activation_bytes(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                     precision: Precision, dispatcher: str = "alltoall",
                     dropout_mask_bytes: int = 1, fused_norms: bool = True,
                     recompute: Recompute = NONE) -> float:
    """Bytes saved for backward by one micro-batch of the whole model on one rank (see the
    module docstring; without pipelining, what a rank holds at its peak), with `recompute`
    the most it holds, forward or backward.

    dropout_mask_bytes: m, 1 on GPUs; on CPUs torch keeps p-byte masks. fused_norms: GPUs'
    fused RMSNorm; on CPUs torch's keeps its normalised input too.
    """
    layer, mask, first, last = _activation_terms(spec, layout, micro_batch_size, precision,
                                                 dispatcher, dropout_mask_bytes, fused_norms)
    kept, recomputing = _layers_bytes(spec, layer, range(spec.num_layers), recompute)
    # the head's saved tensors are gone by the time the layers' backward recomputes them
    return mask + first + max(kept + last, recomputing)


def stage_layers(spec: ModelSpec, pp: int, vpp: Optional[int] = None) -> List[List[int]]:
    """Transformer layers of each (stage, virtual stage), [pp][vpp or 1]; ValueError naming
    the flags where the layers do not split so."""
    layers = pipeline_stage_layers(spec.num_layers, pp, vpp)
    if isinstance(layers, str):
        raise ValueError(layers)
    return layers


def stage_layer_indices(spec: ModelSpec, pp: int, vpp: Optional[int] = None
                        ) -> List[List[List[int]]]:
    """The transformer layers (indices) of each (stage, virtual stage), [pp][vpp or 1][...]:
    Megatron's order, virtual stage c of rank i holding the (c pp + i)-th slice of L / (pp v)
    layers (get_transformer_layer_offset)."""
    chunks = stage_layers(spec, pp, vpp)
    per_chunk = chunks[0][0]
    assert all(size == per_chunk for stage in chunks for size in stage)  # even splits only
    return [[list(range((chunk * pp + stage) * per_chunk, (chunk * pp + stage + 1) * per_chunk))
             for chunk in range(len(chunks[stage]))] for stage in range(pp)]


def microbatches_in_flight(pp: int, stage: int, num_microbatches: int,
                           vpp: Optional[int] = None) -> int:
    """(micro-batch, model chunk) pairs whose activations stage `stage` holds at once under
    Megatron-Core's 1F1B schedule (interleaved with vpp virtual stages): its warm-up forward
    passes and the steady state's one (module docstring)."""
    if vpp is None:
        return min(pp - stage, num_microbatches)
    return min(2 * (pp - 1 - stage) + (vpp - 1) * pp + 1, num_microbatches * vpp)


def stage_parameter_counts(spec: ModelSpec, layout: Layout, stage: int, num_layers: int,
                           vpp: Optional[int] = None) -> ParameterCounts:
    """Parameters of one rank of pipeline stage `stage`, which holds num_layers layers (those
    stage_layer_indices gives it with vpp virtual stages): the embeddings on the first stage,
    the final norm and the head on the last (with its copy of tied word embeddings)."""
    whole = parameter_counts(spec, layout.tp, layout.ep, layout.etp)
    if layout.pp == 1:
        return whole
    layers = [index for chunk in stage_layer_indices(spec, layout.pp, vpp)[stage]
              for index in chunk]
    assert len(layers) == num_layers, (layers, num_layers)
    counts = [layer_parameter_counts(spec, moe, layout.tp, layout.ep, layout.etp)
              for moe in spec.moe_layers]
    word = padded_vocab_size(spec.vocab_size, layout.tp) // layout.tp * spec.hidden_size
    embedding = 0
    if stage == 0:  # word, position (and token-type) embeddings
        embedding += whole.embedding - (0 if spec.tied_output else word)
    if stage == layout.pp - 1:  # the output layer's weights (tied: the copy)
        embedding += word
    dense = sum(counts[index][0] for index in layers)
    if stage == layout.pp - 1:
        dense += whole.dense - sum(layer[0] for layer in counts)  # final norm, BERT's head
    return ParameterCounts(embedding=embedding, dense=dense,
                           expert=sum(counts[index][1] for index in layers))


def stage_activation_bytes(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                           precision: Precision, stage: int, num_microbatches: int,
                           vpp: Optional[int] = None, dispatcher: str = "alltoall",
                           dropout_mask_bytes: int = 1, recompute: Recompute = NONE,
                           fused_norms: bool = True) -> Tuple[float, int]:
    """(bytes, micro-batches in flight): the activations one rank of pipeline stage `stage`
    holds at its peak (module docstring); without pipelining, one micro-batch's. With
    recomputation the peak may come in a backward pass, while one chunk of one micro-batch
    recomputes a checkpoint (recompute.py) and the others in flight keep theirs.
    dropout_mask_bytes, fused_norms: as activation_bytes'."""
    layer, mask, first, last = _activation_terms(spec, layout, micro_batch_size, precision,
                                                 dispatcher, dropout_mask_bytes, fused_norms)
    chunks = stage_layer_indices(spec, layout.pp, vpp)[stage]
    in_flight = microbatches_in_flight(layout.pp, stage, num_microbatches)
    chunk_pairs = microbatches_in_flight(layout.pp, stage, num_microbatches, vpp)
    profiles = [_layers_bytes(spec, layer, chunk, recompute) for chunk in chunks]
    kept = sum(profile[0] for profile in profiles) / len(chunks)
    recomputing = max(profile[1] for profile in profiles)
    head = last if stage == layout.pp - 1 else 0.0
    ends = (first if stage == 0 else 0.0) + head
    forward = chunk_pairs * (kept + mask) + in_flight * ends
    # in a backward pass: one chunk pass holds what its recomputation holds, without its head
    backward = forward - kept - head + recomputing
    return max(forward, backward), in_flight


def memory_per_rank(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                    precision: Precision, distributed_optimizer: bool = False,
                    dispatcher: str = "alltoall", num_microbatches: int = 1,
                    vpp: Optional[int] = None, recompute: Recompute = NONE) -> MemoryEstimate:
    """Weights, gradients, optimizer state and activations of one rank; with pipelining, of
    the stage that needs the most (num_microbatches per step, vpp virtual stages), with
    activation recomputation `recompute` (recompute.py)."""
    spec = per_rank_spec(spec, layout.cp)  # one rank's s / c tokens of each sequence
    estimates = [_stage_memory(spec, layout, micro_batch_size, precision, distributed_optimizer,
                               dispatcher, num_microbatches, vpp, stage, sum(chunks), recompute)
                 for stage, chunks in enumerate(stage_layers(spec, layout.pp, vpp))]
    return max(estimates, key=lambda estimate: estimate.total)


def _stage_memory(spec, layout, micro_batch_size, precision, distributed_optimizer,
                  dispatcher, num_microbatches, vpp, stage, num_layers,
                  recompute=NONE) -> MemoryEstimate:
    counts = stage_parameter_counts(spec, layout, stage, num_layers, vpp)
    dense = counts.embedding + counts.dense
    optimizer = precision.main_state_bytes * (dense + counts.expert)
    if distributed_optimizer:
        optimizer = precision.main_state_bytes * (dense / layout.group_size("dp")
                                                  + counts.expert / layout.group_size("expt_dp"))
    activations, in_flight = stage_activation_bytes(spec, layout, micro_batch_size, precision,
                                                    stage, num_microbatches, vpp, dispatcher,
                                                    recompute=recompute)
    return MemoryEstimate(
        weights=precision.weight_bytes * counts.total,
        gradients=precision.grad_bytes * counts.total,
        optimizer=optimizer,
        activations=activations,
        parameters=counts.as_dict(),
        stage=stage,
        microbatches_in_flight=in_flight,
    )
