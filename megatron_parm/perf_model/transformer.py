"""The whole GPT / BERT MoE model as the planner sees it: sizes, and parameters per rank.

Notation (as in shape.py and layout.py, plus):
    L  layers: dense or MoE as --moe-layer-freq says (layout_rules.moe_layer_pattern; every
       layer an MoE layer by default, as GPT-2-MoE)
    h  hidden size            a  attention heads        g  key/value heads (GQA; g = a without)
    c  channels per head (--kv-channels, default h / a): Q a c, K and V g c, projection a c -> h
    MLA (--multi-latent-attention): ql, kl the query and key/value latents (--q-lora-rank,
       --kv-lora-rank), dk, dr, dv a head's channels without and with rotary positions and
       its value channels (--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim)
    F  expert FFN hidden size (--moe-ffn-hidden-size)   D  dense layers' FFN (--ffn-hidden-size)
    S  shared experts' FFN (--moe-shared-expert-intermediate-size, all of them together)
    u  fc1 outputs per FFN channel: 2 with --swiglu (SiLU-gated), else 1
    z  parameters of one norm of width w: 2 w for LayerNorm (weight, bias), w for RMSNorm
    s  sequence length        P  --max-position-embeddings
    V  vocabulary, padded to a multiple of 128 * t (data/vocab.py, as Megatron-LM pads it)
    t = tp, e = ep, x = etp (the expert-tensor-parallel size; `s` is taken by the sequence)

Parameters of one rank, for Megatron-Core's local layer spec (what training/model.py builds:
GPT through get_gpt_decoder_block_spec, BERT through its layer spec):
    word embeddings  V/t * h                  (VocabParallelEmbedding)
    position         P * h                    (learned_absolute only: rope and none have no
                                              table; replicated over TP)
    token types      2 * h                    (BERT with its binary head)
    every layer      two norms z(h), QKV h (a + 2g) c / t (+ (a + 2g) c / t bias), projection
                     a c / t * h (+ h bias), with --qk-layernorm one norm z(c) each for Q and K;
                     with --multi-latent-attention (no biases but the projection's): the query
                     projection h a (dk + dr) / t, or its down h ql / t and up ql a (dk + dr) / t
                     projections, the key/value down projection h (kl + dr) / t and up
                     projection kl a (dk + dv) / t, projection a dv / t * h (+ h bias), with
                     --qk-layernorm the latents' norms z(kl) (and z(ql))
    a dense layer    MLP fc1 u D / t * h (+ u D / t), fc2 h * D / t (+ h)
    an MoE layer     router E*h (+ E bias; replicated), experts E/e * [fc1 u F/x * h (+ u F/x),
                     fc2 h * F/x (+ h)], shared experts fc1 u S / t * h, fc2 h * S / t (split
                     over TP like a dense MLP, no biases), their gate h (--moe-shared-expert-gate)
    final norm       z(h)
    GPT head         V/t * h if the output layer is untied, else nothing (it reuses the embedding)
    BERT head        lm_head dense h*h + h and LayerNorm 2h, output bias V/t, pooler h*h + h,
                     binary head 2h + 2
Dense parameters are those every EP rank holds (their gradients are reduced over the
data-parallel group, size W / t): the shared experts are dense parameters. Expert parameters
are sharded over e * x ranks (reduced over the expert-data-parallel group, size W / (e * x)).
Biases in brackets exist unless --disable-bias-linear. tests/distributed/test_planner_memory.py
checks these counts against the model Megatron-Core builds, per rank, for several layouts and
pipeline stages (the real-size Mixtral, Qwen3 and DeepSeek-V2-Lite configs among them, at 4
layers), and tests/unit/test_planner_models.py those configs whole and every architecture flag
at TP 1.
"""

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterable, Optional, Tuple, Union

from megatron_parm.data.vocab import padded_vocab_size
from megatron_parm.layout_rules import (architecture_problem, capacity_problem, layout_problem,
                                        mla_problem, model_problem, moe_layer_pattern,
                                        shape_problem)
from megatron_parm.perf_model.layout import Layout

MODEL_TYPES = ("gpt", "bert")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT or BERT MoE model with Megatron-LM's flag meanings (see training/arguments.py)."""

    model_type: str  # "gpt" or "bert"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # the tokenizer's, before padding
    num_experts: int
    moe_ffn_hidden_size: int
    topk: int = 2
    max_position_embeddings: Optional[int] = None  # default: seq_length
    capacity_factor: Optional[float] = None  # None = dropless
    pad_to_capacity: bool = False
    add_bias_linear: bool = False  # not --disable-bias-linear
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    bert_binary_head: bool = True
    moe_grouped_gemm: bool = False  # grouped experts (LayerShape.grouped_experts)
    # today's architectures (Megatron-LM's flags; the defaults are GPT-2's)
    ffn_hidden_size: Optional[int] = None  # D, the dense layers' MLP (default: F)
    swiglu: bool = False
    num_query_groups: Optional[int] = None  # g with --group-query-attention (None: g = a)
    kv_channels: Optional[int] = None  # c (None: h / a)
    qk_layernorm: bool = False
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1  # an int N or 0/1 per layer
    shared_expert_size: Optional[int] = None  # S
    shared_expert_gate: bool = False
    # --moe-shared-expert-overlap: the shared experts run while the dispatcher's collectives
    # are in flight (their memory: memory.py; the time they hide: step_time.py)
    shared_expert_overlap: bool = False
    router_pre_softmax: bool = False  # the softmax over all experts before the top-k
    # multi-latent attention (--multi-latent-attention and its widths, Megatron-LM's defaults)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # ql (None: one query projection)
    kv_lora_rank: int = 32  # kl
    qk_head_dim: int = 128  # dk
    qk_pos_emb_head_dim: int = 64  # dr
    v_head_dim: int = 128  # dv

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model type must be one of {', '.join(MODEL_TYPES)}, "
                             f"got {self.model_type!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "num_experts", "moe_ffn_hidden_size", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value!r}")
        problem = shape_problem(self.hidden_size, self.num_attention_heads, self.seq_length,
                                self.positions, self.num_experts, self.topk)
        if problem:
            raise ValueError(problem)
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"--moe-expert-capacity-factor must be positive, "
                             f"got {self.capacity_factor!r}")
        problem = capacity_problem(self.capacity_factor, self.pad_to_capacity)
        if problem:
            raise ValueError(problem)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), "
                                 f"got {getattr(self, name)!r}")
        if isinstance(self.moe_layer_freq, list):  # hashable, as the dataclass is frozen
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, "
                             f"got {self.normalization!r}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"--position-embedding-type must be one of "
                             f"{', '.join(POSITION_EMBEDDINGS)}, got "
                             f"{self.position_embedding_type!r}")
        problem = self._architecture_problem(tp=1)
        if problem:
            raise ValueError(problem)

    def _architecture_problem(self, tp: int) -> Optional[str]:
        """layout_rules.architecture_problem for this model at TP size tp."""
        freq = self.moe_layer_freq
        return architecture_problem(
            model_type=self.model_type, num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, tp=tp, num_experts=self.num_experts,
            topk=self.topk, moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
            group_query_attention=self.num_query_groups is not None,
            num_query_groups=self.num_query_groups or 1,
            position_embedding_type=self.position_embedding_type,
            qk_layernorm=self.qk_layernorm, shared_expert_size=self.shared_expert_size,
            shared_expert_gate=self.shared_expert_gate,
            shared_expert_overlap=self.shared_expert_overlap,
            multi_latent_attention=self.multi_latent_attention,
            add_bias_linear=self.add_bias_linear, sequence_parallel=tp > 1) or (
                mla_problem(tp, self.q_lora_rank, self.kv_lora_rank, self.qk_pos_emb_head_dim)
                if self.multi_latent_attention else None)

    @property
    def positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def key_value_width(self) -> int:
        """The keys' and values' channels (all ranks): 2 g c; MLA: a (dk + dr) + a dv."""
        if self.multi_latent_attention:
            return self.key_width + self.attention_width
        return 2 * self.query_groups * self.head_channels

    @property
    def head_channels(self) -> int:
        """c: channels per attention head."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """g: key/value heads."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_width(self) -> int:
        """(a + 2 g) c: the outputs of the fused QKV projection (all ranks)."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_channels

    @property
    def attention_width(self) -> int:
        """a c (MLA: a dv): the attention's output, the projection's input (all ranks)."""
        if self.multi_latent_attention:
            return self.num_attention_heads * self.v_head_dim
        return self.num_attention_heads * self.head_channels

    @property
    def key_width(self) -> int:
        """a c (MLA: a (dk + dr)): the queries' and the keys' channels (all ranks)."""
        if self.multi_latent_attention:
            return self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
        return self.num_attention_heads * self.head_channels

    @property
    def rotary_channels(self) -> int:
        """The channels of a head that rotate (c with rope; MLA: dr, its own rotary)."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_channels

    @property
    def has_rotary(self) -> bool:
        return self.multi_latent_attention or self.position_embedding_type == "rope"

    def attention_gemms(self) -> Tuple[Tuple[int, int], ...]:
        """(input, output) widths (all ranks) of the column-parallel GEMMs that make the
        queries, keys and values: the fused QKV, or MLA's query projection (or its down and up
        projections), its key/value down projection and their up projection."""
        h = self.hidden_size
        if not self.multi_latent_attention:
            return ((h, self.qkv_width),)
        latent = self.kv_lora_rank
        query = (((h, self.key_width),) if self.q_lora_rank is None else
                 ((h, self.q_lora_rank), (self.q_lora_rank, self.key_width)))
        return query + ((h, latent + self.qk_pos_emb_head_dim),
                        (latent, self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)))

    def attention_norm_parameters(self) -> int:
        """The norms inside the attention (replicated over TP): with --qk-layernorm the q and
        k norms z(c) each, or MLA's latent norms z(kl) and z(ql)."""
        if not self.qk_layernorm:
            return 0
        if not self.multi_latent_attention:
            return 2 * self.norm_parameters(self.head_channels)
        return self.norm_parameters(self.kv_lora_rank) + (
            self.norm_parameters(self.q_lora_rank) if self.q_lora_rank else 0)

    @property
    def dense_ffn_hidden_size(self) -> int:
        """D: the FFN of the dense layers."""
        return self.ffn_hidden_size or self.moe_ffn_hidden_size

    @property
    def fc1_factor(self) -> int:
        """u: fc1 outputs per FFN channel (2 for SwiGLU's gate and value)."""
        return 2 if self.swiglu else 1

    def norm_parameters(self, width: int) -> int:
        """z(width): LayerNorm has a weight and a bias, RMSNorm a weight."""
        return 2 * width if self.normalization == "LayerNorm" else width

    @property
    def moe_layers(self) -> Tuple[bool, ...]:
        """Per layer, True for an MoE layer (Megatron-Core's reading of --moe-layer-freq)."""
        return _moe_layers(self.moe_layer_freq, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def position_table(self) -> bool:
        """True where the model has a learned position-embedding table (not rope / none)."""
        return self.position_embedding_type == "learned_absolute"

    @property
    def tied_output(self) -> bool:
        """True when the output layer reuses the word embeddings (BERT always does)."""
        return self.model_type == "bert" or not self.untie_embeddings_and_output_weights


# The planner asks these hundreds of thousands of times per plan with a few distinct inputs
# (pure functions of frozen specs): kept.
@lru_cache(maxsize=64)
def _moe_layers(freq, num_layers: int) -> Tuple[bool, ...]:
    pattern = moe_layer_pattern(list(freq) if isinstance(freq, tuple) else freq, num_layers)
    return tuple(bool(flag) for flag in pattern)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters held by one rank, by how they are sharded and reduced."""

    embedding: int  # word, position and token-type embeddings (+ untied GPT output layer)
    dense: int  # attention, LayerNorms, routers, heads: replicated over EP
    expert: int  # this rank's expert shards

    @property
    def total(self) -> int:
        return self.embedding + self.dense + self.expert

    def as_dict(self) -> Dict[str, int]:
        return {"embedding": self.embedding, "dense": self.dense, "expert": self.expert,
                "total": self.total}


def mlp_parameters(ffn: int, hidden: int, parts: int, gated: bool, bias: bool) -> int:
    """One MLP on one rank, its FFN split over `parts` ranks: fc1 u ffn / parts * hidden (+ its
    bias), fc2 hidden * ffn / parts (+ the whole hidden-wide bias of a row-parallel linear)."""
    local = ffn // parts
    fc1 = (2 if gated else 1) * local
    return fc1 * hidden + hidden * local + ((fc1 + hidden) if bias else 0)


@lru_cache(maxsize=4096)
def layer_parameter_counts(spec: ModelSpec, moe: bool, tp: int, ep: int, etp: int
                           ) -> Tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank (module docstring)."""
    h, t, bias = spec.hidden_size, tp, spec.add_bias_linear
    dense = 2 * spec.norm_parameters(h)
    for width_in, width_out in spec.attention_gemms():  # QKV (MLA's have no biases)
        dense += width_out // t * width_in + (width_out // t if bias and not
                                              spec.multi_latent_attention else 0)
    dense += spec.attention_width // t * h + (h if bias else 0)  # projection
    dense += spec.attention_norm_parameters()
    if not moe:
        return dense + mlp_parameters(spec.dense_ffn_hidden_size, h, t, spec.swiglu, bias), 0
    dense += spec.num_experts * h + (spec.num_experts if bias else 0)  # router
    if spec.shared_expert_size:
        dense += mlp_parameters(spec.shared_expert_size, h, t, spec.swiglu, False)
        dense += h if spec.shared_expert_gate else 0
    per_expert = mlp_parameters(spec.moe_ffn_hidden_size, h, etp, spec.swiglu, bias)
    return dense, spec.num_experts // ep * per_expert


@lru_cache(maxsize=4096)
def parameter_counts(spec: ModelSpec, tp: int, ep: int, etp: int) -> ParameterCounts:
    """Parameters of one rank of a (tp, ep, etp) layout (every rank holds the same count)."""
    h, t = spec.hidden_size, tp
    problem = _model_problem(spec, tp, ep, etp)
    if problem:
        raise ValueError(problem)
    vocab = padded_vocab_size(spec.vocab_size, t)
    embedding = vocab // t * h + (spec.positions * h if spec.position_table else 0)
    if spec.model_type == "bert" and spec.bert_binary_head:
        embedding += 2 * h
    if not spec.tied_output:
        embedding += vocab // t * h

    dense = expert = 0
    for moe in spec.moe_layers:
        layer_dense, layer_expert = layer_parameter_counts(spec, moe, tp, ep, etp)
        dense, expert = dense + layer_dense, expert + layer_expert
    layernorm = 2 * h
    dense += spec.norm_parameters(h)  # the final norm
    if spec.model_type == "bert":
        dense += (h * h + h) + layernorm + vocab // t  # lm_head dense, its LayerNorm, output bias
        if spec.bert_binary_head:
            dense += (h * h + h) + (2 * h + 2)  # pooler, binary head
    return ParameterCounts(embedding=embedding, dense=dense, expert=expert)


def replicated_over_tp(spec: ModelSpec, layers: Optional[Iterable[int]] = None) -> int:
    """Parameters every TP rank holds whole and, with sequence parallelism, all-reduces the
    gradients of over TP (Megatron's finalize_model_grads): norms, routers, the shared
    experts' gate and the row-parallel biases, of `layers` (indices; default all, with the
    final norm; a stage's layers count the final norm where they hold the last layer)."""
    h, bias = spec.hidden_size, spec.add_bias_linear
    indices = range(spec.num_layers) if layers is None else list(layers)
    count = 0
    for index in indices:
        count += 2 * spec.norm_parameters(h) + (h if bias else 0)
        count += spec.attention_norm_parameters()
        if not spec.moe_layers[index]:
            count += h if bias else 0  # the dense MLP's fc2 bias
            continue
        count += spec.num_experts * h + (spec.num_experts if bias else 0)
        count += h if spec.shared_expert_gate else 0
    if spec.num_layers - 1 in indices:
        count += spec.norm_parameters(h)
        if spec.model_type == "bert":
            count += 2 * h  # the lm_head LayerNorm
    return count


def check_layout(spec: ModelSpec, layout: Layout) -> Optional[str]:
    """Why Megatron or this model cannot run `layout` (one line naming the flag), or None.

    Sequence parallelism is on whenever tp > 1 (the planner always uses it: it divides the
    activations by t and every dispatcher supports it).
    """
    return _model_problem(spec, layout.tp, layout.ep, layout.etp)


def _model_problem(spec: ModelSpec, tp: int, ep: int, etp: int) -> Optional[str]:
    """layout_rules' answer for this model on (tp, ep, etp) ranks of a world that fits them."""
    return (layout_problem(tp * ep * etp, tp, ep, etp, spec.num_experts) or model_problem(
        tp, ep, etp, num_attention_heads=spec.num_attention_heads, seq_length=spec.seq_length,
        sequence_parallel=tp > 1, num_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size, add_bias_linear=spec.add_bias_linear)
        or spec._architecture_problem(tp) or _widths_problem(spec, tp))


def _widths_problem(spec: ModelSpec, tp: int) -> Optional[str]:
    """Why the dense FFN, the shared experts or the QKV do not split over tp ranks, or None."""
    for flag, width in (("--ffn-hidden-size", spec.dense_ffn_hidden_size if
                         not all(spec.moe_layers) else None),
                        ("--moe-shared-expert-intermediate-size", spec.shared_expert_size)):
        if width and width % tp != 0:
            return (f"{flag} ({width}) must be divisible by --tensor-model-parallel-size "
                    f"({tp})")
    return None


def per_rank_spec(spec: ModelSpec, cp: int) -> ModelSpec:
    """The model as one of cp context-parallel ranks computes it: s / c tokens of each sequence
    (its queries attend to all s keys: the step and memory models multiply the scores by c);
    the model itself (its position table) unchanged."""
    if cp == 1:
        return spec
    return dataclasses.replace(spec, seq_length=spec.seq_length // cp,
                               max_position_embeddings=spec.positions)
