"""The mixture-of-experts flags: experts, router, dispatcher, shared experts, the combined 1F1B."""

from __future__ import annotations

from typing import List

from megatron_parm import schedules
from megatron_parm.settings.flag import (
    Flag, layer_pattern_check, non_negative_number, positive_int, positive_number)

GROUP = "mixture of experts"
# Megatron-Core's dispatcher that needs DeepEP or HybridEP (GPU kernels); alltoall is what it
# computes.
FLEX = "flex"


def _dispatchers():
    return (*schedules.names(), FLEX)


def _dispatcher_help() -> str:
    return ("; ".join(f"{s.name}: {s.summary}" for s in map(schedules.get, schedules.names()))
            + f"; {FLEX}: Megatron-Core's DeepEP / HybridEP dispatcher (refused here)")


def _each(check):
    """A check of every item of a list value (nargs='+')."""
    def check_each(flag: str, value) -> None:
        for item in value if isinstance(value, list) else [value]:
            check(flag, item)
    return check_each


def flags() -> List[Flag]:
    return [
        Flag("--num-experts", GROUP, check=positive_int),
        Flag("--moe-ffn-hidden-size", GROUP, help="Default: --ffn-hidden-size.",
             check=positive_int),
        Flag("--moe-router-topk", GROUP, check=positive_int),
        Flag("--moe-layer-freq", GROUP,
             check=layer_pattern_check("1 (MoE layer) or 0 (dense layer)"),
             help="Which layers are MoE layers: every N-th (an integer), or Megatron-LM's list "
                  "expression of 1 (MoE) and 0 (dense) per layer, e.g. '[0]*1+[1]*3' for a "
                  "dense first layer."),
        Flag("--moe-shared-expert-intermediate-size", GROUP, check=positive_int,
             help="Shared experts: the FFN width of all of them together (every token goes "
                  "through them besides its routed experts; needs --disable-bias-linear)."),
        Flag("--moe-shared-expert-gate", GROUP,
             help="Scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)."),
        Flag("--moe-shared-expert-overlap", GROUP,
             help="Run the shared experts while the dispatcher's collectives are in flight "
                  "(on a GPU in a stream of their own, as Megatron's alltoall does)."),
        Flag("--overlap-moe-expert-parallel-comm", GROUP,
             help="Megatron-Core's combined 1F1B schedule: one micro-batch's dispatch and "
                  "combine communication runs while another micro-batch computes (needs "
                  "--bf16 or --fp16 and expert parallelism; with pipelines, virtual stages)."),
        Flag("--delay-wgrad-compute", GROUP,
             help="With --overlap-moe-expert-parallel-comm: compute the experts' weight "
                  "gradients after the layer's backward communication has started."),
        *_router_flags(),
        Flag("--moe-aux-loss-coeff", GROUP, check=_each(non_negative_number),
             help="Weight of the load-balancing loss (one per --moe-router-load-balancing-type)."),
        Flag("--moe-router-load-balancing-type", GROUP,
             help="The load-balancing loss, or several at once (one --moe-aux-loss-coeff "
                  "each)."),
        Flag("--moe-expert-capacity-factor", GROUP, help="Default: no capacity limit "
             "(dropless).", check=positive_number),
        Flag("--moe-pad-expert-input-to-capacity", GROUP),
        Flag("--moe-token-dispatcher-type", GROUP, choices=_dispatchers, help=_dispatcher_help,
             differs="adds Parm's dispatchers to Megatron-LM's three",
             supported=schedules.names,
             unsupported="Megatron-Core's flex dispatcher needs DeepEP or HybridEP on a GPU, "
                         "and alltoall computes the same here"),
        Flag("--moe-grouped-gemm", GROUP,
             help="Run a layer's local experts as grouped GEMMs: TEGroupedMLP with "
                  "--transformer-impl transformer_engine, GroupedMLP with the grouped_gemm "
                  "package on a GPU in --bf16 (Megatron-LM's meaning), else TorchGroupedMLP "
                  "(PyTorch's grouped_mm, no extra package; the start-up line names it)."),
        *_upcycling_flags(),
    ]


def _upcycling_flags() -> List[Flag]:
    """Megatron-LM's upcycling at the start of a run (tools/convert_checkpoint.py --upcycle
    does it offline)."""
    return [
        Flag("--moe-use-upcycling", GROUP,
             help="Start from the dense checkpoint in --load: its MLPs become the experts "
                  "(Megatron-Core's upcycling), saved to --save as iteration 1, then train on. "
                  "For the first run only."),
        Flag("--moe-upcycling-granularity", GROUP, check=positive_int,
             help="With --moe-use-upcycling: each dense MLP splits into this many experts of "
                  "--ffn-hidden-size (the dense one is this many times wider)."),
    ]


def _router_flags() -> List[Flag]:
    """The router's flags beyond top-k and its losses (today's models)."""
    return [
        Flag("--moe-router-score-function", GROUP,
             help="The router's scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."),
        Flag("--moe-router-pre-softmax", GROUP,
             help="Softmax over all experts before the top-k (default: after it; always "
                  "before with --moe-router-topk 1)."),
        Flag("--moe-router-topk-scaling-factor", GROUP, check=positive_number,
             help="Scale the top-k scores by this factor (with --moe-router-pre-softmax or "
                  "sigmoid scores)."),
        Flag("--moe-router-num-groups", GROUP, check=positive_int,
             help="Group-limited routing: the experts in this many equal groups, a token's "
                  "experts taken from its --moe-router-group-topk best groups."),
        Flag("--moe-router-group-topk", GROUP, check=positive_int,
             help="Group-limited routing: the groups each token may use."),
        Flag("--moe-router-enable-expert-bias", GROUP,
             help="Aux-loss-free balancing: a per-expert bias in the top-k choice, updated "
                  "after each step from the tokens each expert got (needs sigmoid scores)."),
        Flag("--moe-router-bias-update-rate", GROUP, check=positive_number,
             help="With --moe-router-enable-expert-bias: the bias update per step."),
        Flag("--moe-router-dtype", GROUP,
             help="The router's logits and scores in this precision (default: the model's)."),
        Flag("--moe-z-loss-coeff", GROUP, check=positive_number,
             help="Weight of the router z-loss (off without it)."),
        Flag("--moe-input-jitter-eps", GROUP, check=_jitter,
             help="Multiply the router's input by uniform noise in [1 - eps, 1 + eps] in "
                  "training."),
        Flag("--moe-router-force-load-balancing", GROUP,
             help="Route by random logits instead of the router's (benchmarks: balanced load)."),
        Flag("--moe-token-drop-policy", GROUP,
             help="With --moe-expert-capacity-factor: an expert over capacity keeps its tokens "
                  "of highest probability (probs) or its first ones (position)."),
        Flag("--moe-apply-probs-on-input", GROUP,
             help="With --moe-router-topk 1: scale each token by its routing probability before "
                  "the expert instead of after."),
    ]


def _jitter(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{flag} must be a number in (0, 1), got {value!r}")
