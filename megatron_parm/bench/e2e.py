"""The end-to-end benchmark: real pretraining iterations of GPT-2 MoE, BERT MoE and today's
Mixtral-, Qwen3- and DeepSeek-like MoE models per dispatcher, on the emulated cluster's
presets and layouts (tools/bench_e2e.py runs it).

    MODELS                       name -> Model: the shipped config scaled to fit a CPU machine
    load_config(path)            a benchmark config, checked (ValueError naming the file and
                                 field); its training_flags are added to every run, each
                                 variant's flags to its runs
    cells(config)                (pass, model, preset, layout) in run order
    run_order(config, run)       (dispatcher, variant) of one launch, in run order
    model_flags(model, layout, world_size, train_iters, micro_batches)
                                 the training flags of one model in one layout
    in_config(record, config), done_keys(records)   what an output file holds of a config
                                 (the benchmark resumes)
    summarize(records, config)   per configuration, variant and dispatcher: tokens/s, spread,
                                 ratios, time breakdown, what was busy (the host's cores, the
                                 preset's links), losses against alltoall's; the targets
    markdown(summary), plot(summary, path)

Notation: a configuration is (model, preset, layout); a layout "tp,ep,etp" on NODES x
RANKS_PER_NODE ranks in Megatron's rank order; a variant is a name and training flags that
some runs add (say Megatron-Core's combined 1F1B, --overlap-moe-expert-parallel-comm): every
dispatcher runs under every variant, and a variant's rows are compared with alltoall's of
the same variant; tokens/s = the global batch's tokens per iteration / the slowest rank's step
time (the timing breakdown's, training/timing.py); warm-up iterations (and parm's tuning
iterations, where it measures candidates) are left out.

Every run of a configuration trains in the same launch from the same seed and data, on one
learning-rate schedule fixed by iteration (--lr-decay-iters and --lr-warmup-iters given, not
derived from --train-iters): a dispatcher's loss at iteration i is comparable with every
other's of its variant, however many iterations each ran. Pure Python apart from the
breakdown's categories (training/timing.py, which imports torch) and the plot (matplotlib).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm import schedules
from megatron_parm.bench.report.bound import link_rates
from megatron_parm.layout_rules import OVERLAP_FLAG
from megatron_parm.training.timing import CATEGORIES, COMM_NODES, SHORT_NAMES
from megatron_parm.wording import plural

BASELINE = "alltoall"
DEEPSPEED = "ds_baseline"
AUTO = "parm"
# |loss - alltoall's loss| the dispatchers meet over a few iterations, per dtype of the runs
# (mixed_precision.dtype_name): in fp32 the same bound as tests/e2e/test_pretrain.py's
# 20-iteration curves; in bf16 and fp16, where the schedules' sums in another order round
# differently, tests/e2e/test_mixed_precision.py's 2e-2 relative at the benchmark models'
# first losses (about 10). The tiny GPT-2 MoE's bf16 runs of tests/e2e/test_bench.py agree to
# the bit.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 0.2, "fp16": 0.2}
BUSY = {"cpu": "CPU busy", "inter": "inter link busy", "intra": "intra link busy"}  # Row.busy
LOOPBACK = "loopback"  # no emulator: plain torchrun on this machine's loopback (no root)
# parm tunes as users run it (--parm-tune-steps' default): one call per micro-batch, so
# tuning.most_calls(candidates, steps) calls per layer over the micro-batches per iteration are
# the extra iterations it gets where no cache holds its choice yet. At 1 timed call per
# candidate, parm chose S2 in BERT MoE's (2,2,1) layers on one call 4-53% ahead of S1's, and
# its MoE layers then took 1.4-1.5x as long as S1's (docs/benchmark.md, End to end).
PARM_DISPATCHERS = schedules.names(schedules.PARM, schedules.AUTO)
MEGATRON = "megatron"  # a goal against the faster of Megatron's own dispatchers (MEGATRONS)
MEGATRONS = schedules.names(schedules.NATIVE)
# today's models' goals (issue 45): parm >= 1.4x alltoall and >= 1.1x the faster of alltoall
# and allgather
_MODERN_GOALS = (("alltoall", 1.4), (MEGATRON, 1.1))


@dataclass(frozen=True)
class Model:
    """A model of the benchmark: a shipped config with some flags overridden."""

    model_type: str  # "gpt" or "bert"
    config: str  # the shipped config file
    overrides: Dict[str, object]  # flag name (underscores) -> value
    tokens_per_rank: int  # seq_length x micro-batch / TP: the micro-batch follows the layout
    description: str = ""
    # parm's goals at pcie (2,2,2): (the dispatcher it is compared with, the least ratio of
    # tokens/s); MEGATRON stands for the faster of Megatron's alltoall and allgather there
    goals: Tuple[Tuple[str, float], ...] = (("alltoall", 1.3), ("ds_baseline", 2.0))

    @property
    def seq_length(self) -> int:
        return int(self.overrides["seq_length"])


# The benchmark's model: GPT-2 MoE scaled to 4 layers, hidden 512 (8 heads), 8 experts top-2,
# expert FFN 512 (the layer benchmark's layer: docs/benchmark.md), sequence 1024, 1024 tokens
# per rank; BERT-base MoE scaled the same way at its sequence 512.
_SCALED = {"num_layers": 4, "hidden_size": 512, "ffn_hidden_size": 512,
           "num_attention_heads": 8, "num_experts": 8, "moe_router_topk": 2,
           "hidden_dropout": 0.0, "attention_dropout": 0.0}
_TINY = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
_GPT2_SCALED = {**_SCALED, "seq_length": 1024, "max_position_embeddings": 1024}
_MODERN = {"num_layers": 4, "seq_length": 1024, "max_position_embeddings": 1024,
           "hidden_dropout": 0.0, "attention_dropout": 0.0}
MODELS: Dict[str, Model] = {
    "gpt2_moe": Model("gpt", "configs/gpt2_small_moe.yaml", _GPT2_SCALED, 1024,
                      "GPT-2-small-MoE scaled: 4 layers, hidden 512, 8 experts top-2, FFN 512, "
                      "sequence 1024"),
    # the same with the shipped config's FFN ratio (4x hidden): experts with 4x the work
    "gpt2_moe_ffn4": Model("gpt", "configs/gpt2_small_moe.yaml",
                           {**_GPT2_SCALED, "ffn_hidden_size": 2048}, 1024,
                           "GPT-2-small-MoE scaled as gpt2_moe, FFN 2048 (4x hidden, as shipped)"),
    "bert_moe": Model("bert", "configs/bert_base_moe.yaml",
                      {**_SCALED, "seq_length": 512, "max_position_embeddings": 512}, 1024,
                      "BERT-base-MoE scaled: 4 layers, hidden 512, 8 experts top-2, FFN 512, "
                      "sequence 512"),
    # Today's models (the shipped Mixtral-, Qwen3- and DeepSeek-V2-Lite-like tiny configs:
    # SwiGLU, RMSNorm, rope, GQA or shared experts, and the tests' data and tokenizer) scaled
    # like the layers above: 4 layers, sequence 1024, 1024 tokens per rank; their routing as
    # shipped (Mixtral top-2 of 8; Qwen3 top-8 of 128 small experts, its QKV twice the hidden
    # size; DeepSeek-V2-Lite a dense first layer, top-6 of 64 small experts and shared
    # experts), their widths scaled as the fine-grained layer benchmark's (hidden 2048 -> 256)
    "mixtral_moe": Model("gpt", "configs/mixtral_tiny_moe.yaml", {
        **_MODERN, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 2,
        "ffn_hidden_size": 512, "moe_ffn_hidden_size": 512, "num_experts": 8,
        "moe_router_topk": 2}, 1024,
        "Mixtral-8x7B-like scaled: 4 layers, hidden 512, 8 heads of 2 KV groups, 8 experts "
        "top-2, SwiGLU FFN 512, sequence 1024", _MODERN_GOALS),
    "qwen3_moe": Model("gpt", "configs/qwen3_tiny_moe.yaml", {
        **_MODERN, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 2,
        "kv_channels": 64, "ffn_hidden_size": 768, "moe_ffn_hidden_size": 128,
        "num_experts": 128, "moe_router_topk": 8}, 1024,
        "Qwen3-30B-A3B-like scaled: 4 layers, hidden 256, 8 heads x 64 of 2 KV groups, q/k "
        "norms, 128 experts top-8, SwiGLU FFN 128, sequence 1024", _MODERN_GOALS),
    "deepseek_moe": Model("gpt", "configs/deepseek_v2_lite_tiny_moe.yaml", {
        **_MODERN, "hidden_size": 256, "num_attention_heads": 8, "ffn_hidden_size": 1368,
        "moe_layer_freq": "[0]*1+[1]*3", "moe_ffn_hidden_size": 176,
        "moe_shared_expert_intermediate_size": 352, "num_experts": 64,
        "moe_router_topk": 6}, 1024,
        "DeepSeek-V2-Lite-like scaled: 4 layers (the first dense, FFN 1368), hidden 256, 64 "
        "experts top-6 of FFN 176 and a shared expert of 352, SwiGLU, sequence 1024",
        _MODERN_GOALS),
    "mixtral_tiny_moe": Model("gpt", "configs/mixtral_tiny_moe.yaml",
                              {**_TINY, "seq_length": 64}, 64, "the tests' tiny Mixtral-like MoE"),
    "qwen3_tiny_moe": Model("gpt", "configs/qwen3_tiny_moe.yaml",
                            {**_TINY, "seq_length": 64}, 64, "the tests' tiny Qwen3-like MoE"),
    "deepseek_tiny_moe": Model("gpt", "configs/deepseek_v2_lite_tiny_moe.yaml",
                               {**_TINY, "seq_length": 64}, 64,
                               "the tests' tiny DeepSeek-V2-Lite-like MoE"),
    "gpt2_tiny_moe": Model("gpt", "configs/gpt2_tiny_moe.yaml",
                           {**_TINY, "seq_length": 64}, 64, "the tests' tiny GPT-2 MoE"),
    "bert_tiny_moe": Model("bert", "configs/bert_tiny_moe.yaml",
                           {**_TINY, "seq_length": 64}, 64, "the tests' tiny BERT MoE"),
}

_FIELDS = {"name": str, "description": str, "models": list, "presets": list, "layouts": list,
           "dispatchers": list, "nodes": int, "ranks_per_node": int, "warmup": int,
           "iterations": int, "passes": int, "micro_batches": int, "training_flags": list,
           "variants": list}
_DEFAULTS = {"name": "e2e", "description": "", "nodes": 2, "ranks_per_node": 2, "warmup": 2,
             "iterations": 4, "passes": 2, "micro_batches": 1, "training_flags": []}
# Without a variants field: one variant, unnamed, with no flags of its own (the records of a
# config without it, and those written before variants existed, are its runs).
PLAIN = {"name": "", "flags": []}
# The flags the benchmark sets in each run itself (model_flags and the worker's), which a
# config's training_flags and variants may not set again.
RUN_FLAGS = ("--moe-token-dispatcher-type", "--parm-timing-file", "--parm-tune-steps",
             "--parm-tune-cache")


def presets() -> List[str]:
    from megatron_parm.emulator.cluster import PRESETS

    return sorted(PRESETS) + [LOOPBACK]


def parse_layout(text: str) -> Tuple[int, int, int]:
    parts = str(text).split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"layout {text!r} is not 'tp,ep,etp' (three positive integers)")
    return tuple(int(p) for p in parts)


def load_config(path: str) -> dict:
    """The benchmark config at PATH, defaults filled; ValueError naming the file and field
    for an unknown field, model, preset or dispatcher, a layout that cannot run, a bad variant,
    or flags the trainer refuses with a model, layout and dispatcher of the config."""
    from megatron_parm.settings import read_config_file

    raw = read_config_file(path)
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        message = (f"--config: {path}: unknown field {unknown[0]!r} (fields: "
                   f"{', '.join(_FIELDS)})")
        raise ValueError(message)
    config = {**_DEFAULTS, "variants": [dict(PLAIN)], **raw}
    for key, kind in _FIELDS.items():
        if key not in config:
            raise ValueError(f"--config: {path}: field {key!r} is required")
        value = config[key]
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            message = (f"--config: {path}: {key} must be "
                       f"{'a positive integer' if kind is int else 'a ' + kind.__name__}, "
                       f"got {value!r}")
            raise ValueError(message)
        if kind is list and not value and key != "training_flags":
            raise ValueError(f"--config: {path}: {key} is empty")
    for key, known in (("models", sorted(MODELS)), ("presets", presets()),
                       ("dispatchers", schedules.names())):
        unknown = [name for name in config[key] if name not in known]
        if unknown:
            message = (f"--config: {path}: unknown {key[:-1]} {unknown[0]!r} (known: "
                       f"{', '.join(known)})")
            raise ValueError(message)
    _check_layouts(path, config)
    config["training_flags"] = [str(flag) for flag in config["training_flags"]]
    config["variants"] = _checked_variants(path, config)
    _check_training_flags(path, config)
    return config


def _check_layouts(path: str, config: dict) -> None:
    """Each layout fits the world, gives each model whole sequences, and runs with each
    dispatcher; the layouts normalised ("2,2,2")."""
    world_size = config["nodes"] * config["ranks_per_node"]
    for text in config["layouts"]:
        try:
            tp, ep, etp = parse_layout(text)
        except ValueError as err:
            message = (f"--config: {path}: {err}")
            raise ValueError(message) from None
        if world_size % tp or world_size % (ep * etp):
            message = (f"--config: {path}: layout {text} does not fit "
                       f"{plural(world_size, 'rank')}")
            raise ValueError(message)
        for model_name in config["models"]:
            if (MODELS[model_name].tokens_per_rank * tp) % MODELS[model_name].seq_length:
                message = (f"--config: {path}: layout {text}: {model_name}'s "
                           f"{MODELS[model_name].tokens_per_rank} tokens per rank x TP "
                           f"{tp} is no whole number of sequences")
                raise ValueError(message)
        for name in config["dispatchers"]:
            problem = schedules.get(name).unsupported(tp, ep, etp)
            if problem:
                message = (f"--config: {path}: dispatcher {name} cannot run layout "
                           f"{text}: {problem}")
                raise ValueError(message)
    config["layouts"] = [",".join(map(str, parse_layout(t))) for t in config["layouts"]]


def _checked_variants(path: str, config: dict) -> List[dict]:
    """The config's variants as {name, flags}: each a mapping of a name (letters, digits,
    '_' or '-'; unique) and flags (a list, may be empty); a variant of the combined 1F1B
    schedule needs 2 or more micro-batches per iteration (it overlaps one micro-batch's
    communication with another's compute)."""
    def needs_micro_batches(where: str, flags: List[str]) -> None:
        if OVERLAP_FLAG in flags and config["micro_batches"] < 2:
            raise ValueError(f"{where}: {OVERLAP_FLAG} overlaps one micro-batch's communication "
                             f"with another's compute: set micro_batches to 2 or more (it is "
                             f"{config['micro_batches']})")

    needs_micro_batches(f"--config: {path}: training_flags", config["training_flags"])
    variants = []
    for index, variant in enumerate(config["variants"]):
        where = f"--config: {path}: variants[{index}]"
        if not isinstance(variant, dict) or set(variant) - {"name", "flags"} \
                or not isinstance(variant.get("name"), str) \
                or not isinstance(variant.get("flags", []), list):
            raise ValueError(f"{where} must be {{name: NAME, flags: [FLAG, ...]}}, got "
                             f"{variant!r}")
        name, flags = variant["name"], [str(flag) for flag in variant.get("flags", [])]
        if (name or len(config["variants"]) > 1) and \
                not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{where}: name {name!r} is not a word (letters, digits, '_', "
                             f"'-'){'' if name else '; variants need names'}")
        if name in [v["name"] for v in variants]:
            raise ValueError(f"{where}: name {name!r} is given twice")
        needs_micro_batches(f"{where} ({name})", flags)
        variants.append({"name": name, "flags": flags})
    return variants


def _check_training_flags(path: str, config: dict) -> None:
    """The config's training_flags (added to every run: Megatron-LM's data-parallel flags,
    say), then each variant's on top, as the trainer reads them with each model, layout and
    dispatcher: ValueError naming the flag, where it is unknown, set by the benchmark itself,
    or refused with its companions (arguments.validate; the files a run reads are checked
    when it starts, after the data is prepared)."""
    from megatron_parm import settings
    from megatron_parm.training.arguments import build_parser, validate

    world_size = config["nodes"] * config["ranks_per_node"]
    checks = [("training_flags", config["training_flags"])] + [
        (f"variant {v['name']}", config["training_flags"] + v["flags"])
        for v in config["variants"] if v["flags"]]
    for model_name in config["models"]:
        model, parser = MODELS[model_name], build_parser(MODELS[model_name].model_type)
        own = model_flags(model, config["layouts"][0], world_size, 1, config["micro_batches"])
        for field_name, flags in checks:
            for flag in (f.split("=")[0] for f in flags if f.startswith("-")):
                if flag not in parser._option_string_actions:
                    raise ValueError(f"--config: {path}: {field_name}: unknown flag {flag!r}")
                if flag in RUN_FLAGS or flag in own:
                    raise ValueError(f"--config: {path}: {field_name}: {flag} is set by the "
                                     "benchmark itself (the model, layout or run): drop it")
            for layout in config["layouts"]:
                for dispatcher in config["dispatchers"]:
                    args = settings.read(parser, model_flags(
                        model, layout, world_size, 1, config["micro_batches"]) + flags
                        + ["--moe-token-dispatcher-type", dispatcher])
                    args.model_type = model.model_type
                    try:
                        validate(args, world_size, reads_data=False)
                    except ValueError as err:
                        raise ValueError(f"--config: {path}: {field_name} with {model_name} "
                                         f"({layout}) and {dispatcher}: {err}") from None


def cells(config: dict) -> List[Tuple[int, str, str, str]]:
    """(pass, model, preset, layout) in run order: passes outermost; even passes walk the
    presets and layouts backwards, so that a drift of the machine does not favour one."""
    order = []
    for run in range(1, config["passes"] + 1):
        grid = [(model, preset, layout) for model in config["models"]
                for preset in config["presets"] for layout in config["layouts"]]
        if run % 2 == 0:
            grid.reverse()
        order += [(run, *cell) for cell in grid]
    return order


def dispatcher_order(dispatchers: Sequence[str], run: int) -> List[str]:
    """The dispatchers of one launch: as given in odd passes, reversed in even ones."""
    return list(dispatchers) if run % 2 else list(reversed(dispatchers))


def run_order(config: dict, run: int) -> List[Tuple[str, str]]:
    """(dispatcher, variant name) of one launch in run order: the dispatchers in
    dispatcher_order, each under every variant in turn, the variants as given where the
    dispatcher's place in the config and the pass are both odd or both even, else reversed:
    within a pass half the dispatchers run one variant first, and a dispatcher alternates
    from pass to pass."""
    names = [variant["name"] for variant in config["variants"]]
    order = []
    for dispatcher in dispatcher_order(config["dispatchers"], run):
        place = config["dispatchers"].index(dispatcher) + 1
        order += [(dispatcher, name) for name in (names if (place + run) % 2 == 0
                                                  else reversed(names))]
    return order


def model_flags(model: Model, layout: str, world_size: int, train_iters: int,
                micro_batches: int = 1) -> List[str]:
    """The training flags of MODEL in LAYOUT: the shipped config, its overrides, the layout
    (sequence parallel with TP), MICRO_BATCHES micro-batches per data-parallel rank per
    iteration of tokens_per_rank tokens per rank each, and a schedule fixed by iteration."""
    tp, ep, etp = parse_layout(layout)
    micro_batch = model.tokens_per_rank * tp // model.seq_length
    data_parallel = world_size // tp
    flags = ["--config", model.config]
    for key, value in model.overrides.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    flags += ["--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
              "--expert-tensor-parallel-size", str(etp),
              "--micro-batch-size", str(micro_batch),
              "--global-batch-size", str(micro_batch * data_parallel * micro_batches),
              "--train-iters", str(train_iters), "--lr-warmup-iters", "1",
              "--lr-decay-iters", "1000", "--eval-iters", "0", "--log-interval", "1"]
    if tp > 1:
        flags.append("--sequence-parallel")
    return flags


def record_key(record: dict) -> tuple:
    return (record["pass"], record["model"], record["preset"], record["layout"],
            record["dispatcher"], record.get("variant", ""))


def in_config(record: dict, config: dict) -> bool:
    """Whether RECORD is a run of CONFIG: its grid, its training flags, micro-batches per
    iteration and a variant of its with that variant's flags (records written before
    variants and micro_batches existed: the unnamed variant without flags, 1 micro-batch)."""
    variants = {variant["name"]: variant["flags"] for variant in config["variants"]}
    variant = record.get("variant", "")
    return (record["model"] in config["models"] and record["preset"] in config["presets"]
            and record["layout"] in config["layouts"]
            and record["dispatcher"] in config["dispatchers"]
            and record["pass"] <= config["passes"]
            and record.get("training_flags", []) == config["training_flags"]
            and record.get("micro_batches", 1) == config["micro_batches"]
            and variant in variants and record.get("variant_flags", []) == variants[variant])


def read_records(path: str) -> List[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def done_keys(records: Sequence[dict]) -> set:
    return {record_key(r) for r in records}


# ------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------


def timed_iterations(record: dict, warmup: int) -> List[dict]:
    """A run's iterations after its warm-up: the first WARMUP iterations, and for parm every
    iteration up to its last tuning one plus WARMUP more, are left out."""
    iterations = record["iterations"]
    last_tuning = max((it["iteration"] for it in iterations if it.get("tuning")), default=0)
    return [it for it in iterations if it["iteration"] > last_tuning + warmup]


@dataclass
class Row:
    """One dispatcher in one configuration under one variant, over every pass."""

    model: str
    preset: str
    layout: str
    dispatcher: str
    variant: str = ""
    tokens_per_s: float = 0.0  # median over the timed iterations of all passes
    pass_medians: List[float] = field(default_factory=list)
    spread: float = 0.0  # (max - min) / median of the passes' medians
    breakdown_ms: Dict[str, float] = field(default_factory=dict)  # medians per iteration
    step_ms: float = 0.0
    # the combined 1F1B's communication nodes (timing.COMM_NODES) that ran: median ms per
    # iteration on their thread (busy_ms) and the share of it hidden, 1 - waited / busy over
    # the timed iterations
    comm_stream: Dict[str, dict] = field(default_factory=dict)
    # what was busy in the timed iterations, medians, where recorded (timing's host_cpu_busy
    # and net_tx_bytes): "cpu" the share of the host's cores, "inter" and "intra" the share of
    # the step a node's inter- and intra-node links sent at their preset's rates (mean over
    # the nodes)
    busy: Dict[str, float] = field(default_factory=dict)
    dtype: str = "fp32"
    final_losses: List[float] = field(default_factory=list)  # per pass, at the common length
    max_loss_diff: Optional[float] = None  # vs alltoall, every common iteration, every pass
    choices: List[str] = field(default_factory=list)
    timed: int = 0
    vs: Dict[str, float] = field(default_factory=dict)  # tokens/s over alltoall's, ds_baseline's


def _row(key: tuple, runs: List[dict], warmup: int) -> Row:
    """The row of one (model, preset, layout, dispatcher, variant) from its runs."""
    row = Row(*key, dtype=runs[0].get("dtype", "fp32"))
    pooled, per_category, steps, timed_all = [], {c: [] for c in CATEGORIES}, [], []
    for run in sorted(runs, key=lambda r: r["pass"]):
        timed = timed_iterations(run, warmup)
        rates = [run["tokens_per_iteration"] / (it["slowest_rank_step_ms"] / 1e3)
                 for it in timed]
        if rates:
            row.pass_medians.append(statistics.median(rates))
        pooled += rates
        timed_all += timed
        for it in timed:
            steps.append(it["slowest_rank_step_ms"])
            for category in CATEGORIES:
                per_category[category].append(it["ms"].get(category, 0.0))
        row.choices += [c for c in run.get("choices", []) if c and c not in row.choices]
    row.timed = len(pooled)
    if pooled:
        row.tokens_per_s = statistics.median(pooled)
        row.step_ms = statistics.median(steps)
        row.breakdown_ms = {c: statistics.median(v) for c, v in per_category.items()}
    row.busy = _busy_shares(timed_all, link_rates(row.preset))
    if len(row.pass_medians) > 1:
        row.spread = ((max(row.pass_medians) - min(row.pass_medians))
                      / statistics.median(row.pass_medians))
    for name in COMM_NODES:
        stats = [it["comm_stream"][name] for it in timed_all
                 if (it.get("comm_stream") or {}).get(name)]
        busy = sum(s["busy_ms"] for s in stats)
        if busy > 0:
            row.comm_stream[name] = {
                "busy_ms": statistics.median(s["busy_ms"] for s in stats),
                "hidden": 1.0 - sum(s["waited_ms"] for s in stats) / busy}
    return row


def _busy_shares(iterations: List[dict], rates: Optional[Tuple[float, float]]) -> Dict[str, float]:
    """Row.busy from the iterations' records; the links only where the preset has rates
    (inter-node, intra-node bytes per second)."""
    shares: Dict[str, List[float]] = {}
    for it in iterations:
        if it.get("host_cpu_busy") is None:
            continue
        shares.setdefault("cpu", []).append(it["host_cpu_busy"])
        if rates and it.get("net_tx_bytes"):
            seconds = it["slowest_rank_step_ms"] / 1e3
            for link, counter, rate in (("inter", "network", rates[0]),
                                        ("intra", "loopback", rates[1])):
                shares.setdefault(link, []).append(it["net_tx_bytes"][counter] / rate / seconds)
    return {name: statistics.median(values) for name, values in shares.items()}


def overlap_variants(config: dict) -> List[str]:
    """The names of the config's variants that run the combined 1F1B schedule."""
    return [v["name"] for v in config["variants"]
            if OVERLAP_FLAG in config["training_flags"] + v["flags"]]


def summarize(records: Sequence[dict], config: dict) -> dict:
    """Rows per configuration, variant and dispatcher, and the targets (see
    docs/benchmark.md)."""
    warmup = config["warmup"]
    variant_place = {v["name"]: index for index, v in enumerate(config["variants"])}
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["preset"], r["layout"], r["dispatcher"],
                           r.get("variant", "")), []).append(r)
    rows = [_row(key, runs, warmup) for key, runs in sorted(
        groups.items(), key=lambda item: (item[0][:4], variant_place.get(item[0][4], 0)))]
    by_config: Dict[tuple, Dict[str, Row]] = {}
    for row in rows:
        by_config.setdefault((row.model, row.preset, row.layout, row.variant),
                             {})[row.dispatcher] = row
    loss_problems = []
    for key, table in by_config.items():
        _compare_losses(key, table, groups, loss_problems)
        for other in (BASELINE, DEEPSPEED):
            if other in table and table[other].tokens_per_s:
                for row in table.values():
                    row.vs[other] = row.tokens_per_s / table[other].tokens_per_s
    tolerances = {row.dtype: LOSS_TOLERANCE[row.dtype] for row in rows}
    return {"rows": [row.__dict__ for row in rows],
            "targets": _targets(by_config) + _overlap_targets(by_config, config),
            "losses_equal": not loss_problems, "loss_problems": loss_problems,
            "loss_tolerance": max(tolerances.values(), default=LOSS_TOLERANCE["fp32"]),
            "loss_tolerances": tolerances, "warmup": warmup,
            "passes": max((r["pass"] for r in records), default=0),
            "training_flags": config["training_flags"], "variants": config["variants"],
            "micro_batches": config["micro_batches"],
            "load": sorted({round(l, 1) for r in records for l in r.get("load", [])[:1]})}


def _compare_losses(key, table: Dict[str, Row], groups, problems: list) -> None:
    """Final loss per pass (at the iteration every dispatcher of the variant in the launch
    reached) and the largest difference from alltoall's losses (of the same variant) over
    those iterations."""
    model, preset, layout, variant = key
    runs = {name: {r["pass"]: r["losses"] for r in groups[(model, preset, layout, name, variant)]}
            for name in table}
    reference = runs.get(BASELINE, {})
    for name, row in table.items():
        diffs = []
        for run, losses in sorted(runs[name].items()):
            common = min([len(losses)] + [len(r[run]) for r in runs.values() if run in r])
            row.final_losses.append(losses[common - 1] if common else float("nan"))
            if run in reference:
                diffs += [abs(a - b) for a, b in zip(losses[:common], reference[run][:common])]
        row.max_loss_diff = max(diffs) if diffs else None
        tolerance = LOSS_TOLERANCE[row.dtype]
        if row.max_loss_diff is not None and not row.max_loss_diff <= tolerance:
            problems.append(f"{model} {preset} ({layout}) {name}{_in_variant(variant)}: "
                            f"|loss - alltoall's| up to {row.max_loss_diff:.2e} > "
                            f"{tolerance:g} ({row.dtype})")


def _in_variant(variant: str) -> str:
    return f", variant {variant}" if variant else ""


def _targets(by_config) -> List[dict]:
    """The targets of each variant: on pcie at (2,2,2) the model's goals (GPT-2 and BERT MoE:
    parm >= 1.3x alltoall and >= 2x ds_baseline; today's models: >= 1.4x alltoall and >= 1.1x
    the faster of alltoall and allgather); everywhere parm >= alltoall within the larger of
    the two's spreads."""
    targets = []
    for (model, preset, layout, variant), table in by_config.items():  # summarize's order
        parm = table.get(AUTO)
        if parm is None or not parm.tokens_per_s:
            continue
        where = {"model": model, "preset": preset, "layout": layout, "variant": variant}
        if preset == "pcie" and layout == "2,2,2":
            for other, bound in MODELS[model].goals if model in MODELS else ():
                names = MEGATRONS if other == MEGATRON else (other,)
                speeds = [table[n].tokens_per_s for n in names
                          if n in table and table[n].tokens_per_s]
                if len(speeds) == len(names):
                    value = parm.tokens_per_s / max(speeds)
                    label = "the faster of " + " and ".join(names) if other == MEGATRON else other
                    targets.append({"target": f"parm >= {bound}x {label}", **where,
                                    "value": value, "met": value >= bound})
        if BASELINE in parm.vs:
            spread = max(parm.spread, table[BASELINE].spread)
            targets.append({"target": "parm >= alltoall within the spread", **where,
                            "value": parm.vs[BASELINE], "spread": spread,
                            "met": parm.vs[BASELINE] >= 1 - spread})
    return targets


# The combined 1F1B's goals, per configuration: the fastest Parm dispatcher with it against
# alltoall without it, and against alltoall with it.
OVERLAP_GOALS = {"without": 1.3, "with": 1.15}


def _overlap_targets(by_config, config: dict) -> List[dict]:
    """Per configuration and variant with the combined 1F1B schedule: its fastest Parm
    dispatcher against alltoall of each variant without it (goal 1.3x) and of its own (goal
    1.15x). Where its runs recorded what was busy, "bound" is the most the ratio can be with
    their CPU work and bytes: its tokens/s over its busiest share (the cores or a link), over
    alltoall's (no schedule can finish a step before its busiest resource has done its part)."""
    overlap = overlap_variants(config)
    plain = [v["name"] for v in config["variants"] if v["name"] not in overlap]
    targets = []
    for (model, preset, layout, variant), table in by_config.items():  # summarize's order
        parm_rows = [table[d] for d in PARM_DISPATCHERS if d in table and table[d].tokens_per_s]
        if variant not in overlap or not parm_rows:
            continue
        best = max(parm_rows, key=lambda row: row.tokens_per_s)
        ceiling = best.tokens_per_s / max(best.busy.values()) if best.busy else None
        for other, goal in [(name, OVERLAP_GOALS["without"]) for name in plain] + [
                (variant, OVERLAP_GOALS["with"])]:
            alltoall = by_config.get((model, preset, layout, other), {}).get(BASELINE)
            if alltoall is None or not alltoall.tokens_per_s:
                continue
            value = best.tokens_per_s / alltoall.tokens_per_s
            targets.append({"target": f"best Parm [{variant}] >= {goal}x alltoall [{other}]",
                            "model": model, "preset": preset, "layout": layout,
                            "dispatcher": best.dispatcher, "value": value, "met": value >= goal,
                            "bound": ceiling / alltoall.tokens_per_s if ceiling else None})
    return targets


def markdown(summary: dict) -> str:
    """Tokens/s with ratios and losses, then the time breakdown, the combined 1F1B's
    communication nodes where they ran, per configuration (and variant, where named)."""
    rows = summary["rows"]
    named = any(r["variant"] for r in rows)
    lines = ([f"Every run with the training flags {' '.join(summary['training_flags'])}", ""]
             if summary.get("training_flags") else [])
    if summary.get("micro_batches", 1) > 1 or named:
        lines += [f"{plural(summary.get('micro_batches', 1), 'micro-batch')} per iteration"
                  + ("; variants: " + "; ".join(
                      f"{v['name']}: {' '.join(v['flags']) or 'no flags'}"
                      for v in summary["variants"]) if named else ""), ""]
    head = "| model | preset | layout | dispatcher | " + ("variant | " if named else "")
    rule = "|---|---|---|---|" + ("---|" if named else "")
    lines += [head + "tokens/s | spread | vs alltoall | vs ds_baseline | final loss | "
              "max abs loss diff vs alltoall | timed iterations |",
              rule + "---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        choices = f" ({'; '.join(r['choices'])})" if r["choices"] else ""
        diff = "-" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.1e}"
        lines.append(
            f"{_cells(r, named, choices)} {r['tokens_per_s']:.0f} "
            f"| {100 * r['spread']:.1f}% | {_ratio(r['vs'].get(BASELINE))} | "
            f"{_ratio(r['vs'].get(DEEPSPEED))} | "
            f"{' / '.join(f'{x:.5f}' for x in r['final_losses'])} | "
            f"{diff} | {r['timed']} |")
    comm_rows = [r for r in rows if r.get("comm_stream")]
    categories = [c for c in CATEGORIES if c != "moe_comm_wait" or comm_rows
                  or any(r["breakdown_ms"].get(c) for r in rows)]
    shares = [name for name in BUSY if any(name in r.get("busy", {}) for r in rows)]
    lines += ["", "Time per iteration (ms, medians over the timed iterations, mean over ranks; "
              "the step is the slowest rank's"
              + ("; busy: the share of the step the host's cores were busy, and a node's "
                 "links sent at their preset's rate" if shares else "") + "):", "",
              head + " | ".join(SHORT_NAMES[c] for c in categories) + " | step |"
              + "".join(f" {BUSY[name]} |" for name in shares),
              rule + "---:|" * (len(categories) + 1 + len(shares))]
    for r in rows:
        busy = r.get("busy", {})
        lines.append(f"{_cells(r, named)} "
                     + " | ".join(f"{r['breakdown_ms'].get(c, 0.0):.0f}" for c in categories)
                     + f" | {r['step_ms']:.0f} |"
                     + "".join(" - |" if name not in busy else f" {100 * busy[name]:.0f}% |"
                               for name in shares))
    if comm_rows:
        lines += ["", "The combined 1F1B's communication nodes on their thread (ms per "
                  "iteration they ran, medians; in brackets the share of it the other "
                  "micro-batch's work hid, 1 - waited / ran):", "",
                  head + " | ".join(COMM_NODES.values()) + " |",
                  rule + "---:|" * len(COMM_NODES)]
        for r in comm_rows:
            lines.append(f"{_cells(r, named)} " + " | ".join(
                f"{s['busy_ms']:.0f} ({100 * s['hidden']:.0f}% hidden)" if s else "-"
                for s in (r["comm_stream"].get(name) for name in COMM_NODES)) + " |")
    lines += ["", f"Losses equal to alltoall's{' of the same variant' if named else ''} within "
              f"{_tolerances(summary)}: "
              + ("yes" if summary["losses_equal"] else "NO: " + "; ".join(summary["loss_problems"]))]
    for t in summary["targets"]:
        lines.append(f"- {t['target']}, {t['model']} {t['preset']} ({t['layout']})"
                     f"{_in_variant(t.get('variant', ''))}: "
                     f"{t['dispatcher'] + ' ' if 'dispatcher' in t else ''}"
                     f"{t['value']:.2f}x: {'met' if t['met'] else 'missed'}"
                     + (f" (at most {t['bound']:.2f}x with this machine's busy shares)"
                        if t.get("bound") else ""))
    return "\n".join(lines) + "\n"


def _cells(row: dict, named: bool, choices: str = "") -> str:
    """A table line's first cells: model, preset, layout, dispatcher (its choices), variant."""
    return (f"| {row['model']} | {row['preset']} | ({row['layout']}) | {row['dispatcher']}"
            f"{choices} |" + (f" {row['variant']} |" if named else ""))


def _tolerances(summary: dict) -> str:
    """'0.0001', or per dtype where any run was not fp32: '0.0001 (fp32), 0.2 (bf16)'."""
    tolerances = summary.get("loss_tolerances") or {"fp32": summary["loss_tolerance"]}
    if list(tolerances) == ["fp32"]:
        return f"{tolerances['fp32']:g}"
    return ", ".join(f"{value:g} ({dtype})" for dtype, value in sorted(tolerances.items()))


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


PLOT_COLUMNS = 3


def plot(summary: dict, path: str) -> None:
    """Tokens/s per dispatcher (error bars: the passes' medians), one panel per
    configuration, at most PLOT_COLUMNS panels per row; with named variants a bar per
    dispatcher and variant, the variants after the first hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["model"], r["preset"], r["layout"]) for r in summary["rows"]})
    columns = min(len(configs), PLOT_COLUMNS)
    rows_of_panels = -(-len(configs) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4.2 * columns,
                                                              3.6 * rows_of_panels),
                             squeeze=False)
    for axis in axes.flat[len(configs):]:
        axis.set_visible(False)
    first_variant = summary.get("variants", [PLAIN])[0]["name"]
    for axis, key in zip(axes.flat, configs):
        rows = [r for r in summary["rows"] if (r["model"], r["preset"], r["layout"]) == key]
        values = [r["tokens_per_s"] for r in rows]
        low = [v - min(r["pass_medians"] or [v]) for v, r in zip(values, rows)]
        high = [max(r["pass_medians"] or [v]) - v for v, r in zip(values, rows)]
        bars = axis.bar(range(len(rows)), values, yerr=[low, high], capsize=3,
                        color=["tab:gray" if r["dispatcher"] in (BASELINE, DEEPSPEED)
                               else "tab:blue" for r in rows])
        for bar, row in zip(bars, rows):
            if row["variant"] != first_variant:
                bar.set_hatch("//")
        axis.set_xticks(range(len(rows)))
        axis.set_xticklabels([r["dispatcher"] + (f" [{r['variant']}]" if r["variant"] else "")
                              for r in rows], rotation=45, ha="right")
        axis.set_title(f"{key[0]}, {key[1]} ({key[2]})", fontsize=9)
        axis.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
