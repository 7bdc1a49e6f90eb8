"""Predicted time of one training step of the whole model on one rank.

Notation: see transformer.py and memory.py (L, h, a, s, b, n = s b / t, V, p, t, e, x, E);
    m  micro-batches per step per data-parallel rank = global batch / (b * d),
       d = W / (t p) the data-parallel size
    p  pipeline stages (pp), v virtual stages per rank (interleaving; v = 1 without)

One micro-batch, forward + backward, on the ranks of one pipeline stage (sequence parallel when
t > 1); without pipelining the stage is the whole model:
    MoE layers    (the MoE layers: --moe-layer-freq) each predict(dispatcher, its chunks)
                  (predict.py, the catalog's cost plan): the dispatcher's collectives and the
                  expert GEMMs (SwiGLU: fc1 of 2 F), with the profile's in-layer terms
    dense GEMMs   per layer QKV 2 s b h (a + 2g) c / t, scores and context 2 * 2 b s^2 a c / t,
                  projection 2 s b a c h / t (c, g, D, S, u: transformer.py); a dense layer's
                  MLP fc1 2 s b h u D / t and fc2 2 s b D h / t; an MoE layer's router
                  2 n h E and shared experts fc1 2 s b h u S / t, fc2 2 s b S h / t (their gate
                  2 n h); head: output layer 2 s b h V / t (BERT also its lm_head dense
                  2 n h h); multi-latent attention: one GEMM per projection of
                  transformer.ModelSpec.attention_gemms (2 s b in out / t each) in place of the
                  QKV, scores 2 b s^2 a (dk + dr) / t, context 2 b s^2 a dv / t, projection
                  2 s b a dv h / t; backward twice the forward flops. Each GEMM costs the profile's
                  compute alpha once forward and twice backward (input and weight gradients),
                  plus compute beta per flop
    TP collectives (t > 1) per layer, bytes n h p per peer: forward AG before QKV and RS after
                  the projection; backward the duals plus the AG that re-gathers QKV's input for
                  its weight gradient (Megatron keeps only the shard); the same again for a
                  dense layer's MLP and for the shared experts (overlapped or not: what the
                  overlap saves is its own term below); with fewer
                  key/value heads than t (g < t) an AG of the QKV output forward, its RS
                  backward. Multi-latent attention: each of its column-parallel projections
                  gathers its input (AG forward, AG + RS backward), the down projections'
                  outputs are gathered across their column shards forward and the latents'
                  sequence shards backward, the projection RS forward, AG backward
                  (_mla_tp_collectives). Embedding: RS forward, AG backward; output layer: AG forward, AG +
                  RS backward; the vocab-parallel cross entropy: three AR of s b fp32 values
    shared-expert overlap (--moe-shared-expert-overlap): the shared experts' GEMMs run on a
                  stream of their own while the dispatcher's collectives are in flight
                  (Megatron's alltoall points, forward and backward): per MoE layer and pass
                  the step saves e * min(their GEMMs' seconds, the seconds the layer's compute
                  waits on its collectives, Prediction.comm_wait_s), e the profile's
                  overlap_efficiency (the one share of an ideal overlap a cluster delivers, as
                  for parm_s2's chunks; not measured for this overlap), and at t > 1 the AG
                  that re-gathers their input for fc1's weight gradient (they gather it once
                  and their fc1 keeps it whole); their other TP collectives stay charged (they
                  may share a link with the dispatcher's)
    framework     the profile's microbatch_overhead + L * layer_overhead: the time of a
                  micro-batch that no GEMM or collective above accounts for (Python, autograd,
                  element-wise kernels, Megatron's schedule), fitted by tools/calibrate.py on
                  the real model
    recompute     activation recomputation (--recompute-granularity; recompute.py) runs
                  forward work again in the backward pass, as Megatron-Core 0.16.1 does: full
                  granularity each recomputed layer's whole forward (its GEMMs' forward, its
                  forward TP collectives, an MoE layer's forward from predict: the dispatcher's
                  forward stages of the catalog's cost plan, the experts' forward) and
                  FORWARD_SHARE of its layer_overhead; selective the named modules' forward:
                  core_attn the scores and context GEMMs, moe the router, the shared experts
                  (GEMMs and TP collectives) and the MoE layer's forward, mlp a dense layer's
                  MLP and its TP collectives, shared_experts theirs (a second time where moe is
                  recomputed too: the checkpoints nest). Element-wise work (the softmax, norms,
                  activations) lives in the profile's framework terms, which have no split by
                  module: selective layernorm and moe_act and core_attn's softmax are not
                  charged, nor the selective modules' share of layer_overhead
Pipeline (p > 1): stage i runs its own layers (layout_rules.pipeline_stage_layers), the first
also the embedding (its TP collectives), the last the output layer, loss and their TP
collectives; every stage pays 1/p of microbatch_overhead per micro-batch (the whole model's
framework time per micro-batch, fitted without pipelining, split over the stages: measured,
a stage of the tiny model took ~85 ms per pipeline slot against 215 ms for a micro-batch of
the whole model, docs/planner.md).
Between neighbouring stages each micro-batch sends its activations forward and their gradient
backward, [s / t, b, h] elements of p bytes per rank with sequence parallelism (Megatron's p2p
tensor shape), v times each way with interleaving. Megatron pairs each send with the receive
the other way, so a stage pays one send per neighbouring stage per micro-batch (per model
chunk); each send is timed as a one-peer all-to-all on the link it crosses (intra- or
inter-node from the rank order, layout.py: the profile has no point-to-point term of its own). With T_i the micro-batch time of stage i, sends included, and
T its maximum, Megatron-Core's 1F1B schedule takes
    m T + (sum_i T_i - T) / v
the second term being the pipeline bubble: (p - 1) T / v for equal stages, a share
(p - 1) / (v m + p - 1) of the pipelined time.
Per step:
    the pipelined micro-batches (m * one micro-batch without pipelining)
    + gradient reduction: AR of the dense gradients over "dp" (d = W / (t p) ranks) and of the
      expert gradients over "expt_dp" (W / (e x p) ranks); with --use-distributed-optimizer an RS of the
      gradients and an AG of the updated weights instead; with t > 1 an AR over TP of the
      LayerNorm and router gradients (replicated under sequence parallelism); each stage
      reduces its own parameters (the slowest stage counts), and with p > 1 and tied embeddings
      an AR of the word-embedding gradients between the first and the last stage
A stage's recomputation lengthens its micro-batch, so it enters the bubble as well.
Not modelled: the optimizer step itself, overlap of the gradient reduction with the backward
pass (the trainer reduces after the last micro-batch), overlap of the pipeline's sends with
compute, data loading.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm.data.vocab import padded_vocab_size
from megatron_parm.layout_rules import batch_problem, microbatch_problem
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.memory import (Precision, layer_shape, stage_layer_indices,
                                             stage_parameter_counts)
from megatron_parm.perf_model.predict import Prediction, stage_time, predict
from megatron_parm.perf_model.profile import Profile
from megatron_parm.perf_model.recompute import NONE, Recompute
from megatron_parm.perf_model.transformer import (ModelSpec, parameter_counts, per_rank_spec,
                                                  replicated_over_tp)
from megatron_parm.perf_model.volumes import place_stage
from megatron_parm.schedules import FORWARD, Stage


@dataclass(frozen=True)
class StepTime:
    """Seconds on one rank; the micro-batch terms are forward + backward of one micro-batch on
    the slowest pipeline stage (the whole model without pipelining)."""

    moe_s: float
    dense_compute_s: float
    tp_comm_s: float
    framework_s: float  # the profile's framework terms, one micro-batch
    num_microbatches: int
    grad_reduce_s: float
    tokens_per_step: int
    moe_layer: Prediction  # one MoE layer, for the breakdown
    # --moe-shared-expert-overlap: minus what it saves of one micro-batch (<= 0): the shared
    # experts' GEMMs (in dense_compute_s) hidden behind the dispatchers' collectives, their AG
    # (in tp_comm_s) not repeated
    shared_overlap_s: float = 0.0
    p2p_s: float = 0.0  # the pipeline's sends of one micro-batch on that stage, both ways
    bubble_s: float = 0.0  # the pipeline bubble of one step
    pp: int = 1
    vpp: Optional[int] = None
    p2p_link: Optional[str] = None  # "intra" or "inter": where the stages' sends cross
    p2p_bytes: float = 0.0  # one send (one rank, one micro-batch, one way)
    # activation recomputation's forward work, run again in the backward pass (one micro-batch)
    recompute_s: float = 0.0
    cp_comm_s: float = 0.0  # context parallelism's gathers of the keys and values

    @property
    def microbatch_s(self) -> float:
        return (self.moe_s + self.dense_compute_s + self.tp_comm_s + self.cp_comm_s
                + self.framework_s + self.recompute_s + self.shared_overlap_s)

    @property
    def pipeline_s(self) -> float:
        """The micro-batches of one step, through every stage, bubble included."""
        return self.num_microbatches * (self.microbatch_s + self.p2p_s) + self.bubble_s

    @property
    def bubble_share(self) -> float:
        """The bubble's share of the pipelined time: (p - 1) / (v m + p - 1) for equal stages."""
        return self.bubble_s / self.pipeline_s

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.grad_reduce_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def as_dict(self) -> Dict[str, float]:
        return {"moe_s": self.moe_s, "dense_compute_s": self.dense_compute_s,
                "tp_comm_s": self.tp_comm_s, "cp_comm_s": self.cp_comm_s,
                "framework_s": self.framework_s,
                "recompute_s": self.recompute_s, "microbatch_s": self.microbatch_s,
                "num_microbatches": self.num_microbatches, "grad_reduce_s": self.grad_reduce_s,
                "pp": self.pp, "vpp": self.vpp, "p2p_s": self.p2p_s,
                "p2p_link": self.p2p_link, "p2p_bytes": self.p2p_bytes,
                "bubble_s": self.bubble_s, "bubble_share": self.bubble_share,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "shared_overlap_s": self.shared_overlap_s}


def collective_seconds(profile: Profile, layout: Layout, kind: str, group: str,
                       bytes_per_peer: float) -> float:
    """One collective on `group` ("tp", or the data-parallel "dp" / "expt_dp"), placed and
    timed as the performance model places and times a dispatcher's stages (volumes.py,
    predict.py); 0 for a group of one rank."""
    stage = Stage(FORWARD, kind, kind, group, bytes_per_peer=bytes_per_peer)
    return sum(stage_time(step, profile, 1).seconds for step in place_stage(stage, layout))


def _gemms_seconds(profile: Profile, forward_flops) -> float:
    """Forward + backward of GEMMs with these forward flops (backward: two GEMMs, 2x flops)."""
    return sum(3 * profile.compute_alpha + 3 * flops * profile.compute_beta
               for flops in forward_flops)


def _layers(spec: ModelSpec, num_layers: Optional[int], layers: Optional[Sequence[int]]
            ) -> Sequence[int]:
    """The layer indices a term covers: `layers`, else the first num_layers, else all."""
    if layers is not None:
        return layers
    return range(spec.num_layers if num_layers is None else num_layers)


def layer_gemm_flops(spec: ModelSpec, layout: Layout, micro_batch_size: int
                     ) -> Dict[str, Tuple[float, ...]]:
    """Forward flops of a transformer layer's GEMMs on one rank, by the module that runs them
    (the names recompute.py and Megatron-Core use): qkv; core_attn (scores, context);
    projection; mlp (a dense layer's fc1, fc2); router; shared_experts (fc1, fc2, their gate)."""
    t, h, s = layout.tp, spec.hidden_size, spec.seq_length
    tokens = s * micro_batch_size  # the whole sequence: attention GEMMs see it all under SP
    keys = s * layout.cp  # with context parallelism (spec: per_rank_spec's) every rank's keys
    local = tokens // t
    width, u = spec.attention_width, spec.fc1_factor
    ffn, shared = spec.dense_ffn_hidden_size, spec.shared_expert_size or 0
    return {
        "qkv": tuple(2 * tokens * width_in * width_out / t
                     for width_in, width_out in spec.attention_gemms()),
        "core_attn": (2 * micro_batch_size * s * keys * spec.key_width / t,
                      2 * micro_batch_size * s * keys * width / t),
        "projection": (2 * tokens * width * h / t,),
        "mlp": (2 * tokens * h * u * ffn / t, 2 * tokens * ffn * h / t),
        "router": (2 * local * h * spec.num_experts,),
        "shared_experts": (((2 * tokens * h * u * shared / t, 2 * tokens * shared * h / t)
                            if shared else ())
                           + ((2 * local * h,) if shared and spec.shared_expert_gate else ())),
    }


# The modules of a dense and of an MoE layer that run GEMMs (layer_gemm_flops), in order.
LAYER_GEMMS = (("qkv", "core_attn", "projection", "mlp"),
               ("qkv", "core_attn", "projection", "router", "shared_experts"))


def forward_gemms_seconds(profile: Profile, forward_flops) -> float:
    """The forward pass of GEMMs with these flops (one GEMM each)."""
    return sum(profile.compute_alpha + flops * profile.compute_beta for flops in forward_flops)


def dense_compute_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                          profile: Profile, num_layers: Optional[int] = None,
                          head: bool = True, layers: Optional[Sequence[int]] = None) -> float:
    """The dense GEMMs of `layers` (indices; default the first num_layers, else all) and, with
    head, the output layer."""
    t, h = layout.tp, spec.hidden_size
    tokens = spec.seq_length * micro_batch_size
    gemms = layer_gemm_flops(spec, layout, micro_batch_size)
    per_kind = tuple(_gemms_seconds(profile, [flops for module in modules
                                              for flops in gemms[module]])
                     for modules in LAYER_GEMMS)
    head_flops = [2 * tokens * h * padded_vocab_size(spec.vocab_size, t) / t]
    if spec.model_type == "bert":
        head_flops.append(2 * (tokens // t) * h * h)
    moe_layers = spec.moe_layers
    return (sum(per_kind[moe_layers[index]] for index in _layers(spec, num_layers, layers))
            + (_gemms_seconds(profile, head_flops) if head else 0.0))


def layer_tp_collectives(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                         profile: Profile, precision: Precision
                         ) -> Dict[str, Tuple[float, float]]:
    """(forward, forward + backward) seconds of the TP collectives of a layer's attention and
    of one MLP block (a dense layer's MLP, an MoE layer's shared experts), under sequence
    parallelism; zeros at t = 1 (module docstring)."""
    t = layout.tp
    if t == 1:
        return {"attention": (0.0, 0.0), "mlp": (0.0, 0.0)}
    tokens = spec.seq_length * micro_batch_size
    shard = tokens // t * spec.hidden_size * precision.activation_bytes
    all_gather = collective_seconds(profile, layout, "all_gather", "tp", shard)
    reduce_scatter = collective_seconds(profile, layout, "reduce_scatter", "tp", shard)
    # forward AG before the column-parallel GEMM and RS after the row-parallel one; backward
    # their duals and the AG that re-gathers the input for the weight gradient
    forward, block = all_gather + reduce_scatter, 3 * all_gather + 2 * reduce_scatter
    attention_forward, attention = forward, block
    if spec.multi_latent_attention:
        attention_forward, attention = _mla_tp_collectives(spec, layout, tokens, profile,
                                                           precision)
    elif spec.query_groups < t:  # Megatron gathers the QKV output (attention.py), RS backward
        qkv_shard = tokens * spec.qkv_width // t * precision.activation_bytes
        gathered = collective_seconds(profile, layout, "all_gather", "tp", qkv_shard)
        attention_forward += gathered
        attention += gathered + collective_seconds(profile, layout, "reduce_scatter", "tp",
                                                   qkv_shard)
    return {"attention": (attention_forward, attention), "mlp": (forward, block)}


def _mla_tp_collectives(spec: ModelSpec, layout: Layout, tokens: int, profile: Profile,
                        precision: Precision) -> Tuple[float, float]:
    """(forward, forward + backward) seconds of multi-latent attention's TP collectives under
    sequence parallelism (Megatron-Core's MLASelfAttention on the local spec): each
    column-parallel projection gathers its input's shards (its backward gathers them again and
    reduce-scatters their gradient), the down projections' outputs are gathered across their
    column shards and the latents cut back to the sequence shards (their backward gathers
    those), and the output projection reduce-scatters (its backward gathers)."""
    t, p = layout.tp, precision.activation_bytes

    def gather(width):  # every rank's tokens / t x width
        return collective_seconds(profile, layout, "all_gather", "tp", tokens // t * width * p)

    def scatter(width):
        return collective_seconds(profile, layout, "reduce_scatter", "tp",
                                  tokens // t * width * p)

    forward = backward = 0.0
    for width_in, _ in spec.attention_gemms():  # column-parallel, sequence-parallel input
        forward += gather(width_in)
        backward += gather(width_in) + scatter(width_in)
    latents = [(spec.kv_lora_rank + spec.qk_pos_emb_head_dim, spec.kv_lora_rank)]
    if spec.q_lora_rank:
        latents.append((spec.q_lora_rank, spec.q_lora_rank))
    for output, latent in latents:
        forward += gather(output)  # the down projection's column shards
        backward += gather(latent)  # the latent's sequence shards
    h = spec.hidden_size
    forward += scatter(h)
    backward += gather(h)
    return forward, forward + backward


def cp_comm_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int, profile: Profile,
                    precision: Precision, layers: Sequence[int]) -> float:
    """Context parallelism's collectives of `layers` (spec: per_rank_spec's), forward +
    backward: each layer's attention gathers the keys and values of every CP rank (AG over
    "cp" of this rank's s / c tokens' keys and values of its heads, --cp-comm-type
    all_gather) and reduce-scatters their gradients backward; 0 at c = 1."""
    if layout.cp == 1:
        return 0.0
    shard = (spec.seq_length * micro_batch_size * spec.key_value_width // layout.tp
             * precision.activation_bytes)
    per_layer = (collective_seconds(profile, layout, "all_gather", "cp", shard)
                 + collective_seconds(profile, layout, "reduce_scatter", "cp", shard))
    return len(layers) * per_layer


def tp_comm_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int, profile: Profile,
                    precision: Precision, num_layers: Optional[int] = None,
                    embedding: bool = True, head: bool = True,
                    layers: Optional[Sequence[int]] = None) -> float:
    """TP collectives of `layers` (indices; default the first num_layers, else all), the
    embedding's and the head's."""
    t = layout.tp
    if t == 1:
        return 0.0
    tokens = spec.seq_length * micro_batch_size
    shard = tokens // t * spec.hidden_size * precision.activation_bytes

    def collective(kind, bytes_per_peer):
        return collective_seconds(profile, layout, kind, "tp", bytes_per_peer)

    blocks = layer_tp_collectives(spec, layout, micro_batch_size, profile, precision)
    attention, block = blocks["attention"][1], blocks["mlp"][1]
    per_kind = (attention + block, attention + (block if spec.shared_expert_size else 0.0))
    all_gather, reduce_scatter = collective("all_gather", shard), collective("reduce_scatter", shard)
    embedding_s = reduce_scatter + all_gather
    output_layer = 2 * all_gather + reduce_scatter
    cross_entropy = 3 * collective("all_reduce", 2.0 * tokens * 4 / t)
    moe_layers = spec.moe_layers
    return (sum(per_kind[moe_layers[index]] for index in _layers(spec, num_layers, layers))
            + (embedding_s if embedding else 0.0)
            + ((output_layer + cross_entropy) if head else 0.0))


# The forward pass's share of a layer's framework time (the profile's layer_overhead covers
# forward and backward): a third, as for the layer's GEMMs, whose backward runs two GEMMs of
# the forward's flops. A fully recomputed layer pays it again.
FORWARD_SHARE = 1 / 3


def layer_recompute_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                            profile: Profile, precision: Precision, moe_forward_s: float,
                            recompute: Recompute) -> Tuple[float, float]:
    """(a dense layer's, an MoE layer's) forward work that `recompute` runs again in the
    backward pass of one micro-batch, for a layer it recomputes (module docstring):
    moe_forward_s is one MoE layer's forward (predict's, the catalog's forward stages)."""
    if recompute.granularity is None:
        return 0.0, 0.0
    gemms = layer_gemm_flops(spec, layout, micro_batch_size)
    collectives = layer_tp_collectives(spec, layout, micro_batch_size, profile, precision)

    def forward(*modules):
        return forward_gemms_seconds(profile, [flops for module in modules
                                               for flops in gemms[module]])

    attention_tp, mlp_tp = collectives["attention"][0], collectives["mlp"][0]
    shared = forward("shared_experts") + (mlp_tp if spec.shared_expert_size else 0.0)
    if recompute.full:  # the whole layer's forward
        framework = FORWARD_SHARE * profile.layer_overhead
        return (forward(*LAYER_GEMMS[0]) + attention_tp + mlp_tp + framework,
                forward(*LAYER_GEMMS[1]) + attention_tp + shared + moe_forward_s + framework)
    dense = moe = forward("core_attn") if recompute.selects("core_attn") else 0.0
    if recompute.selects("mlp"):
        dense += forward("mlp") + mlp_tp
    if recompute.selects("moe"):  # the MoE layer's forward, its shared experts included
        moe += forward("router") + shared + moe_forward_s
    if recompute.selects("shared_experts"):  # again, where moe's recomputation runs them too
        moe += shared
    return dense, moe


def grad_reduce_seconds(spec: ModelSpec, layout: Layout, profile: Profile,
                        precision: Precision, distributed_optimizer: bool,
                        vpp: Optional[int] = None) -> float:
    """The slowest stage's gradient reduction (the whole model's without pipelining)."""
    if layout.pp == 1:
        return _stage_grad_reduce_seconds(spec, layout, profile, precision, distributed_optimizer,
                                          parameter_counts(spec, layout.tp, layout.ep, layout.etp),
                                          None)
    seconds = max(_stage_grad_reduce_seconds(
        spec, layout, profile, precision, distributed_optimizer,
        stage_parameter_counts(spec, layout, stage, len(layers), vpp), layers)
        for stage, layers in enumerate(_stage_layer_lists(spec, layout.pp, vpp)))
    if spec.tied_output:  # the word embeddings' two copies, first and last stage
        word = padded_vocab_size(spec.vocab_size, layout.tp) // layout.tp * spec.hidden_size
        seconds += p2p_send_seconds(profile, layout, word * precision.grad_bytes)  # AR of 2
    return seconds


def _stage_layer_lists(spec: ModelSpec, pp: int, vpp: Optional[int]) -> List[List[int]]:
    """Each stage's layer indices, its virtual stages together."""
    return [[index for chunk in chunks for index in chunk]
            for chunks in stage_layer_indices(spec, pp, vpp)]


def _stage_grad_reduce_seconds(spec, layout, profile, precision, distributed_optimizer,
                               counts, layers) -> float:
    """One stage's gradient reduction: its counts, its layers (indices; None: all)."""
    seconds = 0.0
    for group, params in (("dp", counts.embedding + counts.dense), ("expt_dp", counts.expert)):
        size = layout.group_size(group)
        grads = params * precision.grad_bytes
        if distributed_optimizer:
            seconds += collective_seconds(profile, layout, "reduce_scatter", group, grads / size)
            seconds += collective_seconds(profile, layout, "all_gather", group,
                                          params * precision.weight_bytes / size)
        else:
            seconds += collective_seconds(profile, layout, "all_reduce", group,
                                          2.0 * grads / size)
    if layout.tp > 1:
        replicated = replicated_over_tp(spec, layers) * precision.grad_bytes
        seconds += collective_seconds(profile, layout, "all_reduce", "tp",
                                      2.0 * replicated / layout.tp)
    return seconds


def framework_seconds(spec: ModelSpec, profile: Profile, num_layers: Optional[int] = None,
                      num_stages: int = 1) -> float:
    """The profile's framework time of one micro-batch (forward + backward) through num_layers
    layers (default: all) on one of num_stages pipeline stages: microbatch_overhead is the
    whole model's (fitted without pipelining), so a stage pays its 1 / num_stages share."""
    num_layers = spec.num_layers if num_layers is None else num_layers
    return profile.microbatch_overhead / num_stages + num_layers * profile.layer_overhead


def shared_expert_overlap_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                                  profile: Profile, precision: Precision,
                                  moe_layer: Prediction) -> float:
    """Seconds of one MoE layer's forward + backward that --moe-shared-expert-overlap saves:
    per pass e * min(the shared experts' GEMMs, the seconds the layer's compute waits on its
    collectives), and the AG over TP they no longer repeat (module docstring); 0 without the
    flag."""
    if not (spec.shared_expert_overlap and spec.shared_expert_size):
        return 0.0
    flops = layer_gemm_flops(spec, layout, micro_batch_size)["shared_experts"]
    gemms = {"forward": sum(profile.compute_time(f) for f in flops),  # backward: two each
             "backward": sum(2 * profile.compute_time(f) for f in flops)}
    hidden = profile.overlap_efficiency * sum(
        min(seconds, moe_layer.comm_wait_s.get(direction, 0.0))
        for direction, seconds in gemms.items())
    shard = (spec.seq_length * micro_batch_size // layout.tp * spec.hidden_size
             * precision.activation_bytes)
    return hidden + collective_seconds(profile, layout, "all_gather", "tp", shard)


def _stage_layer_lists(spec: ModelSpec, pp: int, vpp: Optional[int]) -> List[List[int]]:
    """Each stage's layer indices, its virtual stages together."""
    return [[index for chunk in chunks for index in chunk]
            for chunks in stage_layer_indices(spec, pp, vpp)]


def pipeline_link(layout: Layout) -> Optional[str]:
    """"inter" where a stage's send to the next stage (rank r to r + S, layout.py) crosses
    nodes for some rank, else "intra"; None without pipelining."""
    if layout.pp == 1:
        return None
    crosses = any(layout.node_of(rank) != layout.node_of(rank + layout.stage_size)
                  for rank in range(layout.world_size - layout.stage_size))
    return "inter" if crosses else "intra"


def p2p_send_seconds(profile: Profile, layout: Layout, num_bytes: float) -> float:
    """One point-to-point send of num_bytes between neighbouring stages, timed as a one-peer
    all-to-all on the link it crosses (the profile has no point-to-point term)."""
    link = pipeline_link(layout)
    return profile.collective_time("all_to_all", link, num_bytes) if link else 0.0


def p2p_bytes(spec: ModelSpec, layout: Layout, micro_batch_size: int,
              precision: Precision) -> float:
    """Bytes of one send between stages (one rank, one micro-batch, one way): Megatron's p2p
    tensor [s / t, b, h] under sequence parallelism (the planner's layouts), [s, b, h] at t = 1."""
    return (spec.seq_length // layout.tp * micro_batch_size * spec.hidden_size
            * precision.activation_bytes)


def stage_times(spec: ModelSpec, layout: Layout, profile: Profile, moe_layer: Prediction,
                micro_batch_size: int, precision: Precision, vpp: Optional[int] = None,
                recompute: Recompute = NONE,
                shared_overlap_s: float = 0.0) -> List[Dict[str, float]]:
    """Per pipeline stage, one micro-batch's terms (forward + backward): moe_s,
    dense_compute_s, tp_comm_s, framework_s, recompute_s, p2p_s (a single stage without
    pipelining), and shared_overlap_s: minus the stage's MoE layers times shared_overlap_s, the
    seconds one MoE layer's shared-expert overlap hides (shared_expert_overlap_seconds);
    moe_layer: one MoE layer's prediction."""
    chunks_of_stages = stage_layer_indices(spec, layout.pp, vpp)
    chunks = vpp or 1
    send = p2p_send_seconds(profile, layout, p2p_bytes(spec, layout, micro_batch_size, precision))
    recomputed = layer_recompute_seconds(spec, layout, micro_batch_size, profile, precision,
                                         moe_layer.forward_s, recompute)
    times = []
    for stage, stage_chunks in enumerate(chunks_of_stages):
        stage_layers = [index for chunk in stage_chunks for index in chunk]
        num_layers = len(stage_layers)
        first, last = stage == 0, stage == layout.pp - 1
        # Megatron pairs each send with the receive the other way (send_forward_recv_backward
        # and its dual): one exchange per micro-batch with each neighbouring stage, both ways
        # at once; interleaved, every rank has both neighbours (the chunks wrap around)
        neighbours = (2 if chunks > 1 else (not first) + (not last))
        times.append({
            "moe_s": sum(spec.moe_layers[index] for index in stage_layers) * moe_layer.total_s,
            "dense_compute_s": dense_compute_seconds(spec, layout, micro_batch_size, profile,
                                                     head=last, layers=stage_layers),
            "tp_comm_s": tp_comm_seconds(spec, layout, micro_batch_size, profile, precision,
                                         embedding=first, head=last, layers=stage_layers),
            "cp_comm_s": cp_comm_seconds(spec, layout, micro_batch_size, profile, precision,
                                         stage_layers),
            "framework_s": framework_seconds(spec, profile, num_layers, layout.pp),
            "recompute_s": sum(recomputed[spec.moe_layers[chunk[local]]]
                               for chunk in stage_chunks
                               for local in recompute.recomputed_layers(len(chunk))),
            "p2p_s": chunks * neighbours * send,
            "shared_overlap_s": -sum(spec.moe_layers[index] for index in stage_layers)
                                * shared_overlap_s,
        })
    return times


def step_time(spec: ModelSpec, layout: Layout, profile: Profile, dispatcher: str,
              num_chunks: Optional[int], micro_batch_size: int, global_batch_size: int,
              precision: Precision, distributed_optimizer: bool = False,
              vpp: Optional[int] = None, recompute: Recompute = NONE) -> StepTime:
    """Predicted step of `spec` on `layout` with `dispatcher` (a schedule with a cost plan in
    the catalog; num_chunks for a chunked one); vpp virtual stages per rank (interleaving),
    with activation recomputation `recompute` (recompute.py)."""
    data_parallel = layout.data_parallel_size
    per_step = micro_batch_size * data_parallel
    problem = batch_problem(global_batch_size, micro_batch_size, data_parallel)
    num_microbatches = global_batch_size // per_step
    problem = problem or microbatch_problem(num_microbatches, layout.pp, vpp)
    if problem:
        raise ValueError(problem)
    tokens_per_step = global_batch_size * spec.seq_length
    spec = per_rank_spec(spec, layout.cp)  # from here on, one rank's s / c tokens
    shape = layer_shape(spec, layout, micro_batch_size, precision)
    moe_layer = predict(dispatcher, shape, layout, profile, num_chunks, sequence_parallel=True)
    stages = stage_times(spec, layout, profile, moe_layer, micro_batch_size, precision, vpp,
                         recompute, shared_expert_overlap_seconds(
                             spec, layout, micro_batch_size, profile, precision, moe_layer))
    totals = [sum(stage.values()) for stage in stages]
    slowest = stages[totals.index(max(totals))]
    return StepTime(
        moe_s=slowest["moe_s"],
        dense_compute_s=slowest["dense_compute_s"],
        tp_comm_s=slowest["tp_comm_s"],
        framework_s=slowest["framework_s"],
        recompute_s=slowest["recompute_s"],
        num_microbatches=num_microbatches,
        grad_reduce_s=grad_reduce_seconds(spec, layout, profile, precision,
                                          distributed_optimizer, vpp),
        tokens_per_step=tokens_per_step,
        cp_comm_s=slowest["cp_comm_s"],
        moe_layer=moe_layer,
        p2p_s=slowest["p2p_s"],
        bubble_s=(sum(totals) - max(totals)) / (vpp or 1),
        pp=layout.pp,
        vpp=vpp,
        p2p_link=pipeline_link(layout),
        p2p_bytes=p2p_bytes(spec, layout, micro_batch_size, precision) if layout.pp > 1 else 0.0,
        shared_overlap_s=slowest["shared_overlap_s"],
    )
