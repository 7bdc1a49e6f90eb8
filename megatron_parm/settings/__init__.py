"""Every flag of the training scripts and tools, declared once, and the one reader of argv and
config files. The training scripts take Megatron-LM's whole flag surface (core_v0.16.1): each
of its flags is implemented, has no effect here (named once at start-up), or is refused in one
line before any rank starts (docs/flags.md lists them all, with why).

    flag.py          Flag (a declaration) and the checks of one value
    megatron_lm.py   Megatron-LM's flags as facts (names, kind, type, default, nargs, choices),
                     from megatron_lm_0_16_1.tsv
    model.py, moe.py, parm.py, parallel.py, training.py, optimizer.py, checkpoints.py,
    logging.py, precision.py, data.py
                     the flags of one concern each: what this project implements
    surface.py       the flags it does not implement: no effect here, or refused, and why
    registry.py      FLAGS (every flag by name), the parsers, the refusal and the start-up note
    reader.py        the reader: defaults < --config < command line, then checks and refusals

A flag is declared with Megatron-LM's name (or a --parm- name), once; training
(training/arguments.py) and the tools take the flags they need by name, so a flag's type,
default, help and check are the same everywhere. Cross-flag rules (divisibility, layouts, chunk
counts) are not here: they live in layout_rules.py and schedules.py, which every caller asks.
A flag's implementation lives with its concern (model, data, checkpoints, logging), not here.

Torch-free and light: the launcher checks a training script's flags with it before any rank
starts (megatron_parm.launch). Imports only the catalog, tuning's defaults and the rank
accounting check, never training/ or the tools.
"""

from __future__ import annotations

import argparse

from megatron_parm.settings.data import TOKENIZER_TYPES
from megatron_parm.settings.flag import (
    Flag, fraction, layer_pattern, non_negative_int, positive_int, positive_number)
from megatron_parm.settings.model import TRANSFORMER_IMPLS
from megatron_parm.settings.parallel import DEFAULT_TIMEOUT_MINUTES
from megatron_parm.settings.precision import DYNAMIC_DEFAULTS
from megatron_parm.settings.reader import (
    Parser, check, config_values, flag_of, given, read, read_config_file, require, suggest,
    training_parser, unknown_flags, unrecognized)
from megatron_parm.settings.registry import (
    FLAGS, PLANNER_ONLY, TRAINING_GROUPS, TRAINING_SCRIPTS, add_flags, group, no_effect_note,
    refusal, status)

moe_layer_freq = layer_pattern  # --moe-layer-freq's value type

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


__all__ = [
    "DEFAULT_TIMEOUT_MINUTES", "DYNAMIC_DEFAULTS", "FLAGS", "Flag", "LAYER_MODEL_ALIASES",
    "LAYER_MODEL_DEFAULTS", "LAYER_MODEL_FLAGS", "PLANNER_ONLY", "Parser", "TOKENIZER_TYPES",
    "TRAINING_GROUPS", "TRAINING_SCRIPTS", "TRANSFORMER_IMPLS", "add_flags", "check",
    "config_values", "flag_of", "fraction", "given", "group", "layer_model_values",
    "layer_pattern", "moe_layer_freq", "no_effect_note", "non_negative_int", "positive_int",
    "positive_number", "read", "read_config_file", "refusal", "require", "status", "suggest",
    "training_parser", "unknown_flags", "unrecognized"]
