"""Shape of one MoE layer as seen by one rank.

Notation:
    n  tokens per rank entering the MoE layer (the sequence-parallel shard); N = t * n
    M  hidden size            H  expert FFN hidden size
    E  experts                k  top-k
    f  capacity factor (None = dropless)
    b  bytes per activation element (4 fp32, 2 bf16/fp16)
    C  capacity per expert = ceil(k * n_routed * f / E), n_routed = tokens this rank routes

Routing is assumed uniform: each token's k copies spread evenly over the E experts, so
every expert gets k * n_routed / E rows (dropless), min(that, C) (capacity, no padding)
or exactly C (capacity with padding to capacity).
"""

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LayerShape:
    num_tokens: int  # n
    hidden_size: int  # M
    ffn_hidden_size: int  # H (the expert's, i.e. --moe-ffn-hidden-size)
    num_experts: int  # E
    topk: int  # k
    capacity_factor: Optional[float] = None  # f; None = dropless
    pad_to_capacity: bool = False
    dtype_bytes: int = 2  # b
    prob_bytes: int = 4  # bytes of the routing probability that travels with each row
    gated_linear_unit: bool = False  # SwiGLU-style fc1 with 2H outputs
    # Experts as one grouped GEMM per linear (--moe-grouped-gemm: TorchGroupedMLP, GroupedMLP,
    # TEGroupedMLP) rather than SequentialMLP's GEMMs per local expert: a chunk then does not
    # pay the profile's chunk_expert_overhead per local expert (predict.chunk_costs)
    grouped_experts: bool = False

    def __post_init__(self):
        for name in ("num_tokens", "hidden_size", "ffn_hidden_size", "num_experts", "topk",
                     "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LayerShape.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prob_bytes, int) or self.prob_bytes < 0:
            raise ValueError(
                f"LayerShape.prob_bytes must be a non-negative integer, got {self.prob_bytes!r}"
            )
        if self.topk > self.num_experts:
            raise ValueError(
                f"LayerShape.topk={self.topk} exceeds LayerShape.num_experts={self.num_experts}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"LayerShape.capacity_factor must be positive or None, got {self.capacity_factor!r}"
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("LayerShape.pad_to_capacity needs LayerShape.capacity_factor")

    def capacity(self, num_routed: int) -> Optional[int]:
        """C for a rank that routes `num_routed` tokens; None when dropless."""
        if self.capacity_factor is None:
            return None
        # round() first so that e.g. 2*8*1.1/4 does not become 4.4000000000000004 -> 5
        return math.ceil(round(self.topk * num_routed * self.capacity_factor / self.num_experts, 9))

    def rows_per_expert(self, num_routed: int) -> float:
        """Rows a rank that routes `num_routed` tokens sends to each expert (uniform routing)."""
        uniform = self.topk * num_routed / self.num_experts
        capacity = self.capacity(num_routed)
        if capacity is None:
            return uniform
        if self.pad_to_capacity:
            return float(capacity)
        return min(uniform, float(capacity))

    def expert_flops_per_row(self, etp: int) -> float:
        """Forward flops of one row through fc1 and fc2 with H split over `etp` ranks."""
        fc1_outputs = (2 if self.gated_linear_unit else 1) * self.ffn_hidden_size / etp
        fc2_inputs = self.ffn_hidden_size / etp
        return 2.0 * self.hidden_size * fc1_outputs + 2.0 * fc2_inputs * self.hidden_size


def tokens_per_rank(seq_length: int, micro_batch_size: int, tp: int) -> int:
    """n: the tokens of one micro-batch that enter a rank's token dispatcher, S / t * B, with
    and without sequence parallelism.

    With --sequence-parallel the MoE layer's input is this rank's [S/t, B, M] shard. Without
    it the input is replicated, [S, B, M] on every TP rank: ParmMoELayer keeps this rank's S/t
    rows before routing (megatron_parm/layer.py) and all-gathers the output after (the cost
    plans' restore_ag), and Megatron-Core 0.16.1's own MoELayer refuses TP > 1 without
    sequence parallelism in training (the catalog's needs_sequence_parallel). So the dispatcher
    sees S / t * B tokens either way; tests/unit/test_layer_shape.py runs the layer's forward
    to check it.
    """
    from megatron_parm.layout_rules import sequence_problem  # the package's one check of it

    problem = sequence_problem(seq_length, tp)
    if problem:
        raise ValueError(problem)
    return seq_length // tp * micro_batch_size


def layer_shape(*, seq_length: int, micro_batch_size: int, tp: int, hidden_size: int,
                ffn_hidden_size: int, num_experts: int, topk: int,
                capacity_factor: Optional[float] = None, pad_to_capacity: bool = False,
                dtype_bytes: int = 2, gated_linear_unit: bool = False,
                grouped_experts: bool = False) -> LayerShape:
    """The one way from a model's settings and its TP size to the LayerShape of its MoE layer
    (the planner, calibration, the benchmark report and plan_schedule all ask here): n from
    tokens_per_rank, the sizes as given (ffn_hidden_size: the expert's, --moe-ffn-hidden-size
    or else --ffn-hidden-size)."""
    return LayerShape(
        num_tokens=tokens_per_rank(seq_length, micro_batch_size, tp), hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size, num_experts=num_experts, topk=topk,
        capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity,
        dtype_bytes=dtype_bytes, gated_linear_unit=gated_linear_unit,
        grouped_experts=grouped_experts)
