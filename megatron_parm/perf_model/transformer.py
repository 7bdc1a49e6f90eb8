"""The whole GPT / BERT MoE model as the planner sees it: sizes, and parameters per rank.

Notation (as in shape.py and layout.py, plus):
    L  layers (every layer's MLP is an MoE layer, as training/model.py builds them)
    h  hidden size            a  attention heads        F  expert FFN hidden size
    s  sequence length        P  --max-position-embeddings
    V  vocabulary, padded to a multiple of 128 * t (data/vocab.py, as Megatron-LM pads it)
    t = tp, e = ep, x = etp (the expert-tensor-parallel size; `s` is taken by the sequence)

Parameters of one rank, for Megatron-Core's local layer spec (what training/model.py builds):
    word embeddings  V/t * h                  (VocabParallelEmbedding)
    position         P * h                    (replicated over TP)
    token types      2 * h                    (BERT with its binary head)
    per layer        two LayerNorms 2 * 2h, QKV 3h*h/t (+ 3h/t bias), projection h*h/t (+ h bias),
                     router E*h (replicated), experts E/e * [fc1 F/x * h (+ F/x), fc2 h * F/x (+ h)]
    final LayerNorm  2h
    GPT head         V/t * h if the output layer is untied, else nothing (it reuses the embedding)
    BERT head        lm_head dense h*h + h and LayerNorm 2h, output bias V/t, pooler h*h + h,
                     binary head 2h + 2
Dense parameters are those every EP rank holds (their gradients are reduced over the
data-parallel group, size W / t); expert parameters are sharded over e * x ranks (reduced over
the expert-data-parallel group, size W / (e * x)). Biases in brackets exist unless
--disable-bias-linear. tests/distributed/test_planner_memory.py checks these counts against the
model Megatron-Core builds, per rank, for several layouts.
"""

from dataclasses import dataclass
from typing import Dict, Optional

from megatron_parm.data.vocab import padded_vocab_size
from megatron_parm.layout_rules import (capacity_problem, layout_problem, model_problem,
                                        shape_problem)
from megatron_parm.perf_model.layout import Layout

MODEL_TYPES = ("gpt", "bert")


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

    @property
    def positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def tied_output(self) -> bool:
        """True when the output layer reuses the word embeddings (BERT always does)."""
        return self.model_type == "bert" or not self.untie_embeddings_and_output_weights


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


def parameter_counts(spec: ModelSpec, tp: int, ep: int, etp: int) -> ParameterCounts:
    """Parameters of one rank of a (tp, ep, etp) layout (every rank holds the same count)."""
    h, t, bias = spec.hidden_size, tp, spec.add_bias_linear
    problem = _model_problem(spec, tp, ep, etp)
    if problem:
        raise ValueError(problem)
    vocab = padded_vocab_size(spec.vocab_size, t)
    embedding = vocab // t * h + spec.positions * h
    if spec.model_type == "bert" and spec.bert_binary_head:
        embedding += 2 * h
    if not spec.tied_output:
        embedding += vocab // t * h

    layernorm = 2 * h
    attention = 3 * h * h // t + h * h // t + ((3 * h // t + h) if bias else 0)
    router = spec.num_experts * h
    per_layer_dense = 2 * layernorm + attention + router
    dense = spec.num_layers * per_layer_dense + layernorm  # + final LayerNorm
    if spec.model_type == "bert":
        dense += (h * h + h) + layernorm + vocab // t  # lm_head dense, its LayerNorm, output bias
        if spec.bert_binary_head:
            dense += (h * h + h) + (2 * h + 2)  # pooler, binary head

    ffn = spec.moe_ffn_hidden_size // etp
    per_expert = ffn * h + h * ffn + ((ffn + h) if bias else 0)
    expert = spec.num_layers * spec.num_experts // ep * per_expert
    return ParameterCounts(embedding=embedding, dense=dense, expert=expert)


def replicated_over_tp(spec: ModelSpec) -> int:
    """Parameters every TP rank holds whole and, with sequence parallelism, all-reduces the
    gradients of over TP (Megatron's finalize_model_grads): LayerNorms, routers and the
    projection biases."""
    h = spec.hidden_size
    bias = h if spec.add_bias_linear else 0
    count = spec.num_layers * (2 * 2 * h + spec.num_experts * h + bias) + 2 * h
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
    return layout_problem(tp * ep * etp, tp, ep, etp, spec.num_experts) or model_problem(
        tp, ep, etp, num_attention_heads=spec.num_attention_heads, seq_length=spec.seq_length,
        sequence_parallel=tp > 1, num_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size, add_bias_linear=spec.add_bias_linear)
