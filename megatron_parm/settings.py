"""Every flag of the training scripts and tools, declared once, and the one reader of argv and
config files.

    FLAGS                          name -> Flag: type, default, help, choices, check
    group(title)                   the names of one group of flags, in declaration order
    add_flags(parser, names, ...)  put flags on an argparse parser (or group); a tool may give
                                   its own defaults and required flags
    Parser                         argparse.ArgumentParser whose unknown-flag error suggests the
                                   closest valid flag ("did you mean --hidden-size?")
    read(parser, argv)             argv over the --config file (YAML or JSON) over the defaults,
                                   then every declared check: the one reader of settings
    read_config_file(path)         the mapping a config file holds (ValueError naming it)
    require(args, names)           ValueError for the first required flag without a value
    given(parser, argv)            the dests set on the command line
    unknown_flags(argv, parser)    one line for misspelled flags of an argv (None if none)

A flag is declared here with Megatron-LM's name (or a --parm- name), once; training
(training/arguments.py) and the tools take the flags they need by name, so a flag's type,
default, help and check are the same everywhere. A config file holds flag names with
underscores as keys (`num_layers: 12`). Cross-flag rules (divisibility, layouts, chunk counts)
are not here: they live in layout_rules.py and schedules.py, which every caller asks.

Torch-free and light: the launcher checks a training script's flags with it before any rank
starts (megatron_parm.launch). Imports only the catalog, tuning's defaults and the rank
accounting check, never training/ or the tools.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from megatron_parm import schedules, tuning
from megatron_parm.comm.accounting import check_ranks_per_node
from megatron_parm.perf_model.recompute import GRANULARITIES, METHODS, RECOMPUTE_MODULES

# Values of flags whose implementation modules import torch or Megatron-Core (they import
# these from here).
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "BertWordPieceLowerCase",
                   "BertWordPieceCase", "HuggingFaceTokenizer")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
DEFAULT_TIMEOUT_MINUTES = 10
# Megatron-LM's defaults for dynamic loss scaling (training/mixed_precision.py fills them).
DYNAMIC_DEFAULTS = {"initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0,
                    "loss_scale_window": 1000, "hysteresis": 2}

POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
Check = Callable[[str, Any], None]  # (flag, value) -> None; ValueError naming the flag
_DECLARED = object()  # add_flags: no default of the tool's own, the declared one


# ---------------------------------------------------------------------------------------------
# checks of one flag's value (cross-flag rules: layout_rules.py, schedules.py)
# ---------------------------------------------------------------------------------------------


def positive_int(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def non_negative_int(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{flag} must be an integer >= 0, got {value!r}")


def positive_number(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{flag} must be a positive number, got {value!r}")


def fraction(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{flag} must be a number in (0, 1], got {value!r}")


def moe_layer_freq(text):
    """--moe-layer-freq's value: an int, or a list of 0/1 per layer from Megatron-LM's list
    expression ('[0]*3+[1]*9', '([1]*2+[0])*4', '[1,0,1]'; read, never evaluated as code)."""
    import ast

    if isinstance(text, (int, list)):
        return text
    text = str(text).strip()
    if "[" not in text:
        return int(text)

    def value(node):
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"not a list expression of integers: {text!r}")

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError) as error:
        raise ValueError(f"not a list expression of integers: {text!r}") from error
    if not isinstance(result, list):
        raise ValueError(f"not a list expression of integers: {text!r}")
    return result


def _moe_layer_freq(flag: str, value) -> None:
    if isinstance(value, list):
        if not value or any(type(item) is not int or item not in (0, 1) for item in value):
            raise ValueError(f"{flag}: a list holds 1 (MoE layer) or 0 (dense layer) per "
                             f"layer, got {value!r}")
    else:
        positive_int(flag, value)


def _chunks(flag: str, value) -> None:
    schedules.check_num_chunks(value, flag)


def _ranks_per_node(flag: str, value) -> None:
    check_ranks_per_node(value)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: how argparse reads it and how its value is checked.

    kind: "value" (takes an argument), "switch" (store_true; store_false with ``inverted``),
    or "toggle" (--x / --no-x, None when absent)."""

    name: str  # "--num-layers"
    group: str
    type: Optional[Callable] = None
    default: Any = None
    help: Any = None  # a str, or a function giving it (read when a parser is built)
    choices: Any = None  # a sequence, or a function giving it (the catalog grows at run time)
    kind: str = "value"
    inverted: bool = False  # a switch that stores False (--bert-no-binary-head)
    dest: Optional[str] = None  # default: the name without dashes, "_" for "-"
    nargs: Optional[str] = None
    metavar: Optional[str] = None
    check: Optional[Check] = None

    @property
    def key(self) -> str:
        """The argparse dest and config-file key."""
        return self.dest or self.name[2:].replace("-", "_")

    def values(self) -> Optional[Sequence]:
        return self.choices() if callable(self.choices) else self.choices

    def add_to(self, parser, default=None, required: bool = False, help: Optional[str] = None,
               aliases: Sequence[str] = ()) -> None:
        default = self.default if default is _DECLARED else default
        help = help if help is not None else self.help() if callable(self.help) else self.help
        options: Dict[str, Any] = {"help": help}
        if self.dest is not None:
            options["dest"] = self.dest
        if self.kind == "switch":
            options.update(action="store_false" if self.inverted else "store_true")
        elif self.kind == "toggle":
            options.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            options.update(type=self.type, default=default, choices=self.values(),
                           nargs=self.nargs, metavar=self.metavar, required=required)
        if aliases:
            options.setdefault("dest", self.key)
        parser.add_argument(self.name, *aliases, **options)


def _dispatcher_help() -> str:
    return "; ".join(f"{s.name}: {s.summary}" for s in map(schedules.get, schedules.names()))


def _chunks_help() -> str:
    return ("Forward pipeline chunks of the chunked schedules (1 = one chunk); default: "
            + ", ".join(f"{s.name} {s.default_chunks}" for s in map(schedules.get,
                                                                      schedules.names())
                        if s.chunked))


def _chunk_candidates_help() -> str:
    return ("comma-separated chunk counts to consider for the chunked schedules, forward and "
            "backward (every pair) (default: each one's own, "
            + "; ".join(f"{s.name} {','.join(map(str, s.chunk_candidates))}"
                        for s in schedules.candidates() if s.chunked) + ")")


def _model_flags() -> List[Flag]:
    """The config file and the model flags."""
    model = "model"
    return [
        Flag("--config", "config", str, help="YAML (or JSON) file of flag values (keys: flag "
             "names with underscores); command-line flags override it."),
        Flag("--num-layers", model, int, check=positive_int),
        Flag("--hidden-size", model, int, check=positive_int),
        Flag("--ffn-hidden-size", model, int, help="Default: 4 x --hidden-size.",
             check=positive_int),
        Flag("--num-attention-heads", model, int, check=positive_int),
        Flag("--seq-length", model, int, check=positive_int),
        Flag("--max-position-embeddings", model, int, help="Default: --seq-length.",
             check=positive_int),
        Flag("--vocab-size", model, int, help="Vocabulary size (the planners; training reads "
             "it from the tokenizer).", check=positive_int),
        Flag("--hidden-dropout", model, float, 0.1),
        Flag("--attention-dropout", model, float, 0.1),
        Flag("--disable-bias-linear", model, kind="switch",
             help="No bias in linear layers (with MoE, biases need "
                  "--expert-tensor-parallel-size 1 on Megatron-Core 0.16.1)."),
        Flag("--add-qkv-bias", model, kind="switch",
             help="A bias on the query, key and value projections only (as Qwen2), also with "
                  "--disable-bias-linear."),
        Flag("--openai-gelu", model, kind="switch",
             help="GELU's tanh approximation, as GPT-2 (Hugging Face 'gelu_new')."),
        Flag("--swiglu", model, kind="switch", help="SwiGLU MLPs, dense and experts (SiLU-"
             "gated fc1 of 2 x the FFN width); default --ffn-hidden-size then 8/3 x "
             "--hidden-size rounded down to a multiple of 64, as Megatron-LM."),
        Flag("--position-embedding-type", model, str, "learned_absolute",
             choices=POSITION_EMBEDDINGS,
             help="GPT: learned absolute positions (GPT-2), rotary (rope: Llama, Mixtral, Qwen, "
                  "DeepSeek) or none."),
        Flag("--no-position-embedding", model, kind="switch", inverted=True,
             dest="add_position_embedding",
             help="No position embedding (Megatron-LM's older spelling of "
                  "--position-embedding-type none)."),
        Flag("--rotary-base", model, int, 10000, check=positive_int,
             help="With rope: the base of the rotary frequencies (theta)."),
        Flag("--rotary-percent", model, float, 1.0, check=fraction,
             help="With rope: the share of each head's channels that rotate."),
        Flag("--normalization", model, str, "LayerNorm", choices=NORMALIZATIONS),
        Flag("--norm-epsilon", model, float, 1e-5, help="Epsilon of every LayerNorm / RMSNorm."),
        Flag("--group-query-attention", model, kind="switch",
             help="Grouped-query attention: --num-query-groups key/value heads."),
        Flag("--num-query-groups", model, int, 1, check=positive_int,
             help="With --group-query-attention: the key/value heads (default %(default)s)."),
        Flag("--kv-channels", model, int, check=positive_int,
             help="Channels per attention head (default: --hidden-size / "
                  "--num-attention-heads)."),
        Flag("--qk-layernorm", model, kind="switch",
             help="Normalize queries and keys per head (--normalization's kind), as Qwen3."),
        Flag("--multi-latent-attention", model, kind="switch",
             help="DeepSeek's multi-latent attention (refused here: see the error's line)."),
        Flag("--untie-embeddings-and-output-weights", model, kind="switch"),
        Flag("--init-method-std", model, float, 0.02),
        Flag("--transformer-impl", model, str, "local", choices=TRANSFORMER_IMPLS,
             help="Layer modules: Megatron-Core's own (local, the default here) or Transformer "
                  "Engine's (needs transformer-engine and a GPU)."),
    ]


def _moe_flags() -> List[Flag]:
    """The mixture of experts flags."""
    moe = "mixture of experts"
    return [
        Flag("--num-experts", moe, int, check=positive_int),
        Flag("--moe-ffn-hidden-size", moe, int, help="Default: --ffn-hidden-size.",
             check=positive_int),
        Flag("--moe-router-topk", moe, int, 2, check=positive_int),
        Flag("--moe-layer-freq", moe, moe_layer_freq, 1, check=_moe_layer_freq,
             help="Which layers are MoE layers: every N-th (an integer), or Megatron-LM's list "
                  "expression of 1 (MoE) and 0 (dense) per layer, e.g. '[0]*1+[1]*3' for a "
                  "dense first layer."),
        Flag("--moe-shared-expert-intermediate-size", moe, int, check=positive_int,
             help="Shared experts: the FFN width of all of them together (every token goes "
                  "through them besides its routed experts; needs --disable-bias-linear)."),
        Flag("--moe-shared-expert-gate", moe, kind="switch",
             help="Scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)."),
        Flag("--moe-shared-expert-overlap", moe, kind="switch",
             help="Run the shared experts while the dispatcher's collectives are in flight "
                  "(on a GPU in a stream of their own, as Megatron's alltoall does)."),
        Flag("--overlap-moe-expert-parallel-comm", moe, kind="switch",
             help="Megatron-Core's combined 1F1B schedule: one micro-batch's dispatch and "
                  "combine communication runs while another micro-batch computes (needs "
                  "--bf16 or --fp16 and expert parallelism; with pipelines, virtual stages)."),
        Flag("--delay-wgrad-compute", moe, kind="switch",
             help="With --overlap-moe-expert-parallel-comm: compute the experts' weight "
                  "gradients after the layer's backward communication has started."),
        *_router_flags(moe),
        Flag("--moe-aux-loss-coeff", moe, float, 1e-2),
        Flag("--moe-router-load-balancing-type", moe, str, "aux_loss",
             choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")),
        Flag("--moe-expert-capacity-factor", moe, float,
             help="Default: no capacity limit (dropless).", check=positive_number),
        Flag("--moe-pad-expert-input-to-capacity", moe, kind="switch"),
        Flag("--moe-token-dispatcher-type", moe, str, "alltoall", choices=schedules.names,
             help=_dispatcher_help),
        Flag("--parm-num-chunks", moe, int, help=_chunks_help, check=_chunks),
        Flag("--parm-bwd-num-chunks", moe, int, check=_chunks,
             help="Backward pipeline chunks of the chunked schedules; default: the forward "
                  "count (--parm-num-chunks, or the schedule's default)"),
        Flag("--parm-profile", moe, str,
             help="Performance-model profile for the automatic dispatcher: a YAML file, or the "
                  "name of a shipped one (e.g. nvlink_ib_estimate)."),
        Flag("--parm-chunk-candidates", moe, str, help=_chunk_candidates_help),
        Flag("--parm-ranks-per-node", moe, int, check=_ranks_per_node,
             help="Ranks per node, for parm_hier's node groups and the performance model; "
                  "default: LOCAL_WORLD_SIZE (set by torchrun)."),
        Flag("--parm-tune", moe, kind="toggle",
             help="parm: time the model's best candidates on the real layer in the first steps "
                  "and keep the fastest (--no-parm-tune: the model alone). Default: on without "
                  "--parm-profile, off with it."),
        Flag("--parm-tune-steps", moe, int, tuning.DEFAULT_STEPS, check=positive_int,
             help=f"Timed calls per candidate, after one warm-up call (default "
                  f"{tuning.DEFAULT_STEPS})."),
        Flag("--parm-tune-margin", moe, float, tuning.DEFAULT_MARGIN,
             help=f"Candidates predicted within (1 + margin) x the model's first are timed "
                  f"(default {tuning.DEFAULT_MARGIN})."),
        Flag("--parm-tune-candidates", moe, int, tuning.DEFAULT_MAX_CANDIDATES,
             check=positive_int, help=f"At most this many candidates are timed (default "
                                      f"{tuning.DEFAULT_MAX_CANDIDATES}), and S1 besides "
                                      f"them where they leave it out."),
        Flag("--parm-tune-cache", moe, str,
             help=f"JSON file of measured choices, read before tuning and written after "
                  f"(default: {tuning.CACHE_NAME} in --save; none without --save)."),
        Flag("--moe-grouped-gemm", moe, kind="switch",
             help="Run a layer's local experts as grouped GEMMs: TEGroupedMLP with "
                  "--transformer-impl transformer_engine, GroupedMLP with the grouped_gemm "
                  "package on a GPU in --bf16 (Megatron-LM's meaning), else TorchGroupedMLP "
                  "(PyTorch's grouped_mm, no extra package; the start-up line names it)."),
    ]


def _router_flags(moe: str) -> List[Flag]:
    """The router's flags beyond top-k and its losses (today's models)."""
    return [
        Flag("--moe-router-score-function", moe, str, "softmax", choices=("softmax", "sigmoid"),
             help="The router's scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."),
        Flag("--moe-router-pre-softmax", moe, kind="switch",
             help="Softmax over all experts before the top-k (default: after it; always "
                  "before with --moe-router-topk 1)."),
        Flag("--moe-router-topk-scaling-factor", moe, float, check=positive_number,
             help="Scale the top-k scores by this factor (with --moe-router-pre-softmax or "
                  "sigmoid scores)."),
        Flag("--moe-router-num-groups", moe, int, check=positive_int,
             help="Group-limited routing: the experts in this many equal groups, a token's "
                  "experts taken from its --moe-router-group-topk best groups."),
        Flag("--moe-router-group-topk", moe, int, check=positive_int,
             help="Group-limited routing: the groups each token may use."),
        Flag("--moe-router-enable-expert-bias", moe, kind="switch",
             help="Aux-loss-free balancing: a per-expert bias in the top-k choice, updated "
                  "after each step from the tokens each expert got (needs sigmoid scores)."),
        Flag("--moe-router-bias-update-rate", moe, float, 1e-3, check=positive_number,
             help="With --moe-router-enable-expert-bias: the bias update per step."),
        Flag("--moe-router-dtype", moe, str, choices=("fp32", "fp64"),
             help="The router's logits and scores in this precision (default: the model's)."),
        Flag("--moe-z-loss-coeff", moe, float, check=positive_number,
             help="Weight of the router z-loss (off without it)."),
    ]


def _parallel_flags() -> List[Flag]:
    """The parallelism flags."""
    par = "parallelism"
    return [
        Flag("--tensor-model-parallel-size", par, int, 1, check=positive_int),
        Flag("--expert-model-parallel-size", par, int, 1, check=positive_int),
        Flag("--expert-tensor-parallel-size", par, int, help="Default: "
             "--tensor-model-parallel-size.", check=positive_int),
        Flag("--sequence-parallel", par, kind="switch"),
        Flag("--pipeline-model-parallel-size", par, int, 1, check=positive_int,
             help="Pipeline stages: consecutive layers on consecutive groups of ranks, run by "
                  "Megatron-Core's 1F1B schedule."),
        Flag("--virtual-pipeline-model-parallel-size", par, int,
             help="Interleaved schedule: model chunks (virtual stages) per pipeline rank."),
        Flag("--num-layers-per-virtual-pipeline-stage", par, int,
             help="Interleaved schedule, by the layers of one virtual stage (instead of "
                  "--virtual-pipeline-model-parallel-size)."),
        Flag("--decoder-first-pipeline-num-layers", par, int,
             help="Transformer layers of the first pipeline stage (the others share the rest "
                  "evenly)."),
        Flag("--decoder-last-pipeline-num-layers", par, int,
             help="Transformer layers of the last pipeline stage."),
        Flag("--account-for-embedding-in-pipeline-split", par, kind="switch",
             help="Count the embedding as a layer of the first stage when splitting."),
        Flag("--account-for-loss-in-pipeline-split", par, kind="switch",
             help="Count the output layer and loss as a layer of the last stage."),
        Flag("--distributed-timeout-minutes", par, float, DEFAULT_TIMEOUT_MINUTES,
             check=positive_number,
             help="Timeout of every process group's collectives, as in Megatron-LM: a rank that "
                  "waits longer on a hung or vanished peer fails and the job ends (default: "
                  "%(default)s)."),
    ]


def _cluster_flags() -> List[Flag]:
    """The cluster flags (the planners and the emulator)."""
    cluster = "cluster"
    return [
        Flag("--nnodes", cluster, int, 1, check=positive_int),
        Flag("--nproc-per-node", cluster, int, check=positive_int),
        Flag("--gpu-memory-gb", cluster, float, 80.0, check=positive_number,
             help="memory per rank the plan may use, GiB (default 80)"),
    ]


def _training_flags() -> List[Flag]:
    """The training flags."""
    train = "training"
    return [
        Flag("--micro-batch-size", train, int, check=positive_int),
        Flag("--global-batch-size", train, int, help="Default: micro-batch size x "
             "data-parallel size.", check=positive_int),
        Flag("--train-iters", train, int, check=positive_int),
        Flag("--lr", train, float),
        Flag("--min-lr", train, float, 0.0),
        Flag("--lr-decay-style", train, str, "cosine",
             choices=("constant", "linear", "cosine", "inverse-square-root")),
        Flag("--lr-warmup-iters", train, int, 0, check=non_negative_int),
        Flag("--lr-decay-iters", train, int, help="Default: --train-iters.",
             check=positive_int),
        Flag("--clip-grad", train, float, 1.0),
        Flag("--weight-decay", train, float, 0.01),
        Flag("--adam-beta1", train, float, 0.9),
        Flag("--adam-beta2", train, float, 0.999),
        Flag("--adam-eps", train, float, 1e-8),
        Flag("--use-distributed-optimizer", train, kind="switch",
             help="Shard the optimizer state and fp32 main parameters over the data-parallel "
                  "ranks (Megatron-Core's DistributedOptimizer)."),
        Flag("--overlap-grad-reduce", train, kind="switch",
             help="Reduce each gradient bucket during backward, as soon as it is complete "
                  "(Megatron-LM's flag)."),
        Flag("--overlap-param-gather", train, kind="switch",
             help="With --use-distributed-optimizer and --overlap-grad-reduce: all-gather the "
                  "updated parameters during the next forward."),
        Flag("--ddp-bucket-size", train, int, check=positive_int,
             help="Parameters per gradient bucket with --overlap-grad-reduce (default: "
                  "Megatron-Core's, max(40M, 1M x data-parallel size))."),
        Flag("--ddp-average-in-collective", train, kind="switch",
             help="Average gradients in the collective (ReduceOp.AVG; NCCL only) instead of "
                  "dividing by the data-parallel size before summing."),
        Flag("--seed", train, int, 1234),
        *_recompute_flags(train),
    ]


def _recompute_flags(train: str) -> List[Flag]:
    """Activation recompute, as Megatron-LM spells it (its rules: training.arguments)."""
    return [
        Flag("--recompute-granularity", train, str, choices=GRANULARITIES,
             help="Recompute activations in the backward pass instead of keeping them: 'full' "
                  "the whole transformer layer (with --recompute-method and "
                  "--recompute-num-layers), 'selective' the modules of --recompute-modules."),
        Flag("--recompute-method", train, str, choices=METHODS,
             help="With --recompute-granularity full: 'uniform' recomputes every chunk of "
                  "--recompute-num-layers layers, 'block' the first --recompute-num-layers "
                  "layers of each pipeline stage."),
        Flag("--recompute-num-layers", train, int, check=positive_int,
             help="With --recompute-granularity full: layers per recompute unit (uniform) or "
                  "recomputed layers per pipeline stage (block)."),
        Flag("--recompute-modules", train, str, nargs="+", choices=RECOMPUTE_MODULES,
             help="With --recompute-granularity selective: the submodules to recompute "
                  "(default: core_attn). moe: the whole MoE layer, its dispatcher's "
                  "collectives included; moe_act needs --moe-grouped-gemm."),
    ]


def _checkpoint_flags() -> List[Flag]:
    """The checkpoints and logging flags."""
    ckpt = "checkpoints and logging"
    return [
        Flag("--save", ckpt, str, help="Checkpoint folder (torch_dist format)."),
        Flag("--load", ckpt, str, help="Checkpoint folder to start from."),
        Flag("--save-interval", ckpt, int, check=positive_int,
             help="Also save every this many iterations (always at the end)."),
        Flag("--exit-interval", ckpt, int, check=positive_int,
             help="Stop (after saving, with --save) once the iteration is a multiple of this."),
        Flag("--exit-signal-handler", ckpt, kind="switch",
             help="On SIGTERM (Slurm's time limit or preemption), finish the iteration, save "
                  "(with --save) and stop."),
        Flag("--override-opt_param-scheduler", ckpt, kind="switch",
             help="On resume, take the learning-rate schedule (--lr, --min-lr, "
                  "--lr-warmup-iters, --lr-decay-iters, --lr-decay-style, --weight-decay, "
                  "--train-iters) from the command line, not the checkpoint. Without this or "
                  "the next flag a difference is an error."),
        Flag("--use-checkpoint-opt_param-scheduler", ckpt, kind="switch",
             help="On resume, keep the checkpoint's learning-rate schedule."),
        Flag("--dist-ckpt-optim-fully-reshardable", ckpt, kind="switch",
             help="With --use-distributed-optimizer: save its state gathered into model-space "
                  "tensors (Megatron-Core's 'fully_reshardable' format), which load in any "
                  "(tp, pp, ep, etp) layout and without the distributed optimizer. Default: "
                  "each rank's shard as it is ('dp_reshardable'), which loads only at the same "
                  "tp, pp, ep and etp (any data-parallel size)."),
        Flag("--distrib-optim-fully-reshardable-mem-efficient", ckpt, kind="switch",
             help="With --dist-ckpt-optim-fully-reshardable: gather the state on the first "
                  "data-parallel rank over gloo, which alone writes it, instead of on every "
                  "rank over NCCL (less memory; always so without a GPU)."),
        Flag("--skip-train", ckpt, kind="switch",
             help="Load --load, evaluate (--eval-iters batches) and stop."),
        Flag("--eval-interval", ckpt, int, 1000, check=positive_int),
        Flag("--eval-iters", ckpt, int, 10, check=non_negative_int),
        Flag("--log-interval", ckpt, int, 100, check=positive_int),
        Flag("--tensorboard-dir", ckpt, str),
        Flag("--parm-timing-breakdown", ckpt, kind="switch",
             help="Time each step's parts (MoE dispatch, experts, combine; attention and dense "
                  "MLP; TP/SP collectives; DP gradient reduction; optimizer; rest) and print "
                  "their means per logged iteration, with the share of the host's cores busy "
                  "(synchronises the device at every boundary; "
                  "megatron_parm/training/timing.py)."),
        Flag("--parm-timing-file", ckpt, str,
             help="Also append the breakdown as JSON lines to this file (rank 0); implies "
                  "--parm-timing-breakdown."),
    ]


def _precision_flags() -> List[Flag]:
    """The mixed precision flags."""
    mp = "mixed precision"
    return [
        Flag("--bf16", mp, kind="switch",
             help="Run the model in bfloat16 (fp32 main parameters in the optimizer)."),
        Flag("--fp16", mp, kind="switch",
             help="Run the model in float16 with loss scaling (fp32 main parameters)."),
        Flag("--loss-scale", mp, float,
             help="Static loss scale (a positive power of 2 helps fp16); without it --fp16 "
                  "scales dynamically."),
        Flag("--initial-loss-scale", mp, float,
             help=f"Dynamic loss scaling: the first scale (default "
                  f"{DYNAMIC_DEFAULTS['initial_loss_scale']:.0f}, 2^32)."),
        Flag("--min-loss-scale", mp, float,
             help=f"Dynamic loss scaling: the smallest scale (default "
                  f"{DYNAMIC_DEFAULTS['min_loss_scale']})."),
        Flag("--loss-scale-window", mp, int,
             help=f"Dynamic loss scaling: clean iterations before the scale doubles (default "
                  f"{DYNAMIC_DEFAULTS['loss_scale_window']})."),
        Flag("--hysteresis", mp, int,
             help=f"Dynamic loss scaling: overflows tolerated before the scale halves (default "
                  f"{DYNAMIC_DEFAULTS['hysteresis']})."),
        Flag("--accumulate-allreduce-grads-in-fp32", mp, kind="switch",
             help="Accumulate and all-reduce gradients in fp32 (always so with --bf16 and in "
                  "fp32 runs; with --fp16 they are fp16 without it)."),
    ]


def _data_flags() -> List[Flag]:
    """The data flags."""
    data = "data"
    return [
        Flag("--data-path", data, str, nargs="*",
             help="Indexed dataset prefix, or 'weight prefix weight prefix ...'."),
        Flag("--split", data, str, "969,30,1", help="Comma-separated train,valid,test weights."),
        Flag("--data-cache-path", data, str,
             help="Where to store dataset index caches (default: next to the data)."),
        Flag("--num-workers", data, int, 0, help="DataLoader workers.", check=non_negative_int),
        Flag("--reset-position-ids", data, kind="switch",
             help="GPT: restart position ids after each end-of-document token."),
        Flag("--reset-attention-mask", data, kind="switch",
             help="GPT: do not attend across end-of-document tokens."),
        Flag("--eod-mask-loss", data, kind="switch", help="GPT: no loss on end-of-document "
             "tokens."),
        Flag("--mask-prob", data, float, 0.15, help="BERT: probability of masking a token."),
        Flag("--short-seq-prob", data, float, 0.1,
             help="BERT: probability of a shorter-than-maximum sample."),
        Flag("--bert-no-binary-head", data, kind="switch", inverted=True,
             dest="bert_binary_head", help="BERT: no next-sentence-prediction pairs."),
    ]


def _tokenizer_flags() -> List[Flag]:
    """The tokenizer flags."""
    tok = "tokenizer"
    return [
        Flag("--tokenizer-type", tok, str, choices=TOKENIZER_TYPES),
        Flag("--tokenizer-model", tok, str,
             help="SentencePiece .model file (SentencePieceTokenizer) or a Hugging Face "
                  "tokenizer directory with tokenizer.json (HuggingFaceTokenizer)."),
        Flag("--vocab-file", tok, str,
             help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)."),
        Flag("--merge-file", tok, str, help="merges.txt (GPT2BPETokenizer)."),
    ]


def _declare() -> List[Flag]:
    """Every flag, by group (the order of --help)."""
    return [*_model_flags(), *_moe_flags(), *_parallel_flags(),
            *_cluster_flags(), *_training_flags(), *_checkpoint_flags(),
            *_precision_flags(), *_data_flags(), *_tokenizer_flags()]


FLAGS: Dict[str, Flag] = {flag.name: flag for flag in _declare()}
_BY_KEY: Dict[str, Flag] = {flag.key: flag for flag in FLAGS.values()}

# The pretraining entry points (pretrain_scripts/): the launcher checks their flags' names
# against training_parser() before it starts any rank.
TRAINING_SCRIPTS = ("pretrain_gpt2_moe.py", "pretrain_bert_moe.py")
# The groups of training's parser, in --help order.
TRAINING_GROUPS = ("model", "mixture of experts", "parallelism", "training",
                   "checkpoints and logging", "mixed precision", "data", "tokenizer")
# Flags of a group that training does not take (the planners' own).
PLANNER_ONLY = ("--vocab-size", "--parm-chunk-candidates")


# One MoE layer and its layout, as the performance model takes them (tools/plan_schedule.py,
# perf_model.layer_plan.layer_model), with that tool's defaults and config-file aliases.
LAYER_MODEL_FLAGS = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size",
    "--num-experts", "--moe-router-topk", "--seq-length", "--micro-batch-size",
    "--tensor-model-parallel-size", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--nnodes", "--nproc-per-node", "--moe-layer-freq",
    "--moe-expert-capacity-factor", "--sequence-parallel", "--moe-pad-expert-input-to-capacity",
    "--bf16", "--fp16", "--swiglu")
LAYER_MODEL_DEFAULTS = {"num_layers": 1, "micro_batch_size": 1}
LAYER_MODEL_ALIASES = {"tp": "tensor_model_parallel_size", "ep": "expert_model_parallel_size",
                       "etp": "expert_tensor_parallel_size", "nodes": "nnodes",
                       "ranks_per_node": "nproc_per_node"}


def layer_model_values(path: str, **overrides) -> argparse.Namespace:
    """The LAYER_MODEL_FLAGS of a config file, with overrides (by key), as plan_schedule reads
    them, without a command line (tools/bench_report.py)."""
    parser = Parser()
    add_flags(parser, ["--config"] + list(LAYER_MODEL_FLAGS), defaults=LAYER_MODEL_DEFAULTS)
    values, _ = config_values(path, parser, LAYER_MODEL_ALIASES, strict=False)
    parser.set_defaults(**{**values, **overrides})
    args = parser.parse_args([])
    check(args)
    return args


def group(title: str, exclude: Iterable[str] = ()) -> List[str]:
    """The flag names of one group, in declaration order."""
    skip = set(exclude)
    return [name for name, flag in FLAGS.items() if flag.group == title and name not in skip]


def training_parser(description: Optional[str] = None) -> "Parser":
    """The parser of the pretraining flags (training/arguments.py validates what it reads)."""
    parser = Parser(description=description)
    add_flags(parser, ["--config"])
    for title in TRAINING_GROUPS:
        add_flags(parser.add_argument_group(title), group(title, exclude=PLANNER_ONLY))
    return parser


def flag_of(key: str) -> str:
    """The flag of a dest / config key ("num_layers" -> "--num-layers")."""
    return _BY_KEY[key].name if key in _BY_KEY else f"--{key.replace('_', '-')}"


def add_flags(parser, names: Iterable[str], defaults: Optional[Dict[str, Any]] = None,
              required: Iterable[str] = (), helps: Optional[Dict[str, str]] = None,
              aliases: Optional[Dict[str, Sequence[str]]] = None) -> None:
    """Put the named flags on an argparse parser or argument group. A tool may give, by key,
    ``defaults`` of its own (None included) and the ``helps`` that say what its defaults
    mean; ``required`` names flags argparse must see, ``aliases`` (by name) older spellings
    a tool still takes."""
    defaults, helps, aliases = defaults or {}, helps or {}, aliases or {}
    must = set(required)
    for name in names:
        flag = FLAGS[name]
        flag.add_to(parser, defaults.get(flag.key, _DECLARED), required=name in must,
                    help=helps.get(flag.key), aliases=aliases.get(name, ()))


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations, whose unknown-flag error names the closest valid flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        args_list = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(args_list, namespace)
        if extras:
            self.error(unrecognized(extras, self))
        return parsed


def option_strings(parser: argparse.ArgumentParser) -> List[str]:
    return [option for action in parser._actions for option in action.option_strings
            if option.startswith("--")]


def suggest(word: str, valid: Iterable[str]) -> Optional[str]:
    """The closest valid name to a misspelled one, or None where nothing is close."""
    matches = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unrecognized(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message for unknown arguments, with a suggestion for each unknown flag."""
    valid = option_strings(parser)
    flags = [extra.split("=", 1)[0] for extra in extras if extra.startswith("--")]
    hints = []
    for name in flags:
        close = suggest(name, valid)
        if close:
            hints.append(f"did you mean {close} for {name}?" if len(flags) > 1 else
                         f"did you mean {close}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})"
                                                             if hints else "")


def unknown_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> Optional[str]:
    """One line naming the flags of argv that the parser does not know (with the closest valid
    ones), or None: for the launcher, which checks a script's argv before starting ranks."""
    valid = set(option_strings(parser)) | {"-h", "--help"}
    unknown = [arg for arg in argv if arg.startswith("--") and arg.split("=", 1)[0] not in valid]
    return unrecognized(unknown, parser) if unknown else None


# ---------------------------------------------------------------------------------------------
# the reader: defaults < --config < command line
# ---------------------------------------------------------------------------------------------


def read_config_file(path: str, flag: str = "--config") -> dict:
    """The mapping of a config file (JSON by its suffix, else YAML) that ``flag`` names;
    ValueError naming both. Every config file of the project is read here (training's and the
    planners' --config, the benchmarks' --config and --grid)."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: file not found: {path}")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        if path.lower().endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as error:  # json.JSONDecodeError or yaml.YAMLError (imported lazily)
        raise ValueError(f"{flag}: {path} is not valid YAML/JSON: "
                         f"{' '.join(str(error).split())}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: {path} must hold a mapping of names to values")
    return data


def _config_value(flag: Flag, value):
    """A config file's value for a flag, as the command line would give it."""
    if flag.kind in ("switch", "toggle"):
        if not isinstance(value, bool) and not (flag.kind == "toggle" and value is None):
            raise ValueError(f"{flag.name} must be true or false, got {value!r}")
        return value
    choices = flag.values()
    if choices is not None and value is not None and value not in choices:
        raise ValueError(f"{flag.name}: invalid choice: {value!r} (choose from "
                         f"{', '.join(map(str, choices))})")
    if flag.nargs and isinstance(value, str):
        return value.split()
    if value is None or isinstance(value, str) or flag.type in (None, str):
        return value
    if flag.type is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{flag.name} must be an integer, got {value!r}")
    if flag.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{flag.name} must be a number, got {value!r}")
    return value


def config_values(path: str, parser: argparse.ArgumentParser,
                  aliases: Optional[Dict[str, str]] = None, strict: bool = True,
                  command_line_only: Iterable[str] = ()) -> Tuple[dict, List[str]]:
    """(values for the parser's flags, keys it does not take) of a config file.

    Keys no flag has are an error (with the closest key); with ``strict`` so are flags this
    parser does not take, else they come back as unused (a planner reads a training config),
    as do the keys of ``command_line_only``."""
    aliases = aliases or {}
    known = {action.dest for action in parser._actions} - set(command_line_only)
    values, unused, unknown = {}, [], []
    for key, value in read_config_file(path).items():
        key = aliases.get(str(key), str(key).replace("-", "_"))
        if key in known:
            values[key] = _config_value(_BY_KEY[key], value) if key in _BY_KEY else value
        elif key in _BY_KEY and not strict:
            unused.append(key)
        else:
            unknown.append(key)
    if unknown:
        hints = [f"{key} -> {close}" for key in unknown
                 for close in [suggest(key, known - {"help", "config"})] if close]
        raise ValueError(f"--config: {path}: unknown keys {', '.join(sorted(unknown))} (keys "
                         f"are flag names with underscores, e.g. num_layers"
                         + (f"; did you mean {', '.join(hints)}?" if hints else "") + ")")
    return values, unused


def read(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
         aliases: Optional[Dict[str, str]] = None, strict: bool = True,
         reader: str = "here", command_line_only: Iterable[str] = ()) -> argparse.Namespace:
    """The settings of argv: the command line over the --config file over the defaults, then
    each given flag's declared check. Keys of the config file that are flags of other entry
    points are listed in one note on stderr ("not used <reader>: ...") where ``strict`` is off
    (the planners read training configs)."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path:
        values, unused = config_values(path, parser, aliases, strict, command_line_only)
        if unused:
            print(f"note: --config {path}: not used {reader}: {', '.join(sorted(unused))}",
                  file=sys.stderr)
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
    check(args)
    return args


def check(args: argparse.Namespace) -> None:
    """Each flag's declared check, for every flag of args that has a value."""
    for key, value in vars(args).items():
        flag = _BY_KEY.get(key)
        if flag is not None and flag.check is not None and value is not None:
            flag.check(flag.name, value)


def require(args, keys: Iterable[str]) -> None:
    """ValueError for the first of keys without a value, naming its flag."""
    for key in keys:
        if getattr(args, key, None) is None:
            raise ValueError(f"{flag_of(key)} is required (on the command line or in --config)")


def given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Set[str]:
    """The dests set on the command line (not by a default or the config file)."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults, parser._defaults = parser._defaults, {}
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults = saved_defaults
    return set(vars(namespace))
