"""The end-to-end benchmark: real pretraining iterations of GPT-2 MoE and BERT MoE per
dispatcher, on the emulated cluster's presets and layouts (tools/bench_e2e.py runs it).

    MODELS                       name -> Model: the shipped config scaled to fit a CPU machine
    load_config(path)            a benchmark config, checked (ValueError naming the field);
                                 its training_flags are added to every run
    cells(config)                (pass, model, preset, layout) in run order
    model_flags(model, layout, world_size)   the training flags of one model in one layout
    done_keys(records)           what an output file already holds (the benchmark resumes)
    summarize(records, config)   per configuration and dispatcher: tokens/s, spread, ratios,
                                 time breakdown, losses against alltoall's; the targets
    markdown(summary), plot(summary, path)

Notation: a configuration is (model, preset, layout); a layout "tp,ep,etp" on NODES x
RANKS_PER_NODE ranks in Megatron's rank order; tokens/s = the global batch's tokens per
iteration / the slowest rank's step time (the timing breakdown's, training/timing.py);
warm-up iterations (and parm's tuning iterations, where it measures candidates) are left out.

Every dispatcher of a configuration trains in the same launch from the same seed and data,
on one learning-rate schedule fixed by iteration (--lr-decay-iters and --lr-warmup-iters given,
not derived from --train-iters): a dispatcher's loss at iteration i is comparable with every
other's, however many iterations each ran. Pure Python apart from the plot (matplotlib).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm import schedules
from megatron_parm.wording import plural

BASELINE = "alltoall"
DEEPSPEED = "ds_baseline"
AUTO = "parm"
# |loss - alltoall's loss| the dispatchers meet over a few iterations in fp32 (the same bound
# as tests/e2e/test_pretrain.py's 20-iteration curves).
LOSS_TOLERANCE = 1e-4
LOOPBACK = "loopback"  # no emulator: plain torchrun on this machine's loopback (no root)
# parm tunes as users run it (--parm-tune-steps' default): one call per iteration here (one
# micro-batch), so tuning.most_calls(candidates, steps) calls per layer are the extra
# iterations it gets where no cache holds its choice yet. At 1 timed call per candidate, parm
# chose S2 in BERT MoE's (2,2,1) layers on one call 4-53% ahead of S1's, and its MoE layers
# then took 1.4-1.5x as long as S1's (docs/benchmark.md, End to end).
BREAKDOWN = ("moe_dispatch", "moe_experts", "moe_combine", "moe_dispatch_combine",
             "attention_dense", "tp_sp", "dp_grad_reduce", "optimizer", "rest")


@dataclass(frozen=True)
class Model:
    """A model of the benchmark: a shipped config with some flags overridden."""

    model_type: str  # "gpt" or "bert"
    config: str  # the shipped config file
    overrides: Dict[str, object]  # flag name (underscores) -> value
    tokens_per_rank: int  # seq_length x micro-batch / TP: the micro-batch follows the layout
    description: str = ""

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
MODELS: Dict[str, Model] = {
    "gpt2_moe": Model("gpt", "configs/gpt2_small_moe.yaml",
                      {**_SCALED, "seq_length": 1024, "max_position_embeddings": 1024}, 1024,
                      "GPT-2-small-MoE scaled: 4 layers, hidden 512, 8 experts top-2, FFN 512, "
                      "sequence 1024"),
    "bert_moe": Model("bert", "configs/bert_base_moe.yaml",
                      {**_SCALED, "seq_length": 512, "max_position_embeddings": 512}, 1024,
                      "BERT-base-MoE scaled: 4 layers, hidden 512, 8 experts top-2, FFN 512, "
                      "sequence 512"),
    "gpt2_tiny_moe": Model("gpt", "configs/gpt2_tiny_moe.yaml",
                           {**_TINY, "seq_length": 64}, 64, "the tests' tiny GPT-2 MoE"),
    "bert_tiny_moe": Model("bert", "configs/bert_tiny_moe.yaml",
                           {**_TINY, "seq_length": 64}, 64, "the tests' tiny BERT MoE"),
}

_FIELDS = {"name": str, "description": str, "models": list, "presets": list, "layouts": list,
           "dispatchers": list, "nodes": int, "ranks_per_node": int, "warmup": int,
           "iterations": int, "passes": int, "training_flags": list}
_DEFAULTS = {"name": "e2e", "description": "", "nodes": 2, "ranks_per_node": 2, "warmup": 2,
             "iterations": 4, "passes": 2, "training_flags": []}
# The flags the benchmark sets in each run itself (model_flags and the worker's), which a
# config's training_flags may not set again.
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
    for an unknown field, model, preset or dispatcher, or a layout that cannot run."""
    from megatron_parm.settings import read_config_file

    raw = read_config_file(path)
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        message = (f"--config: {path}: unknown field {unknown[0]!r} (fields: "
                   f"{', '.join(_FIELDS)})")
        raise ValueError(message)
    config = {**_DEFAULTS, **raw}
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
    _check_training_flags(path, config, world_size)
    return config


def _check_training_flags(path: str, config: dict, world_size: int) -> None:
    """The config's training_flags (added to every run: Megatron-LM's data-parallel flags,
    say) as the trainer reads them with each model: ValueError naming the flag, where it is
    unknown, set by the benchmark itself, or refused with its companions (ddp.check_args; the
    files a run reads are checked when it starts, after the data is prepared)."""
    flags = [str(flag) for flag in config["training_flags"]]
    config["training_flags"] = flags
    if not flags:
        return
    from megatron_parm import device, settings
    from megatron_parm.training import ddp
    from megatron_parm.training.arguments import build_parser

    for model_name in config["models"]:
        model, parser = MODELS[model_name], build_parser(MODELS[model_name].model_type)
        own = model_flags(model, config["layouts"][0], world_size, 1)
        for flag in (f.split("=")[0] for f in flags if f.startswith("-")):
            if flag not in parser._option_string_actions:
                raise ValueError(f"--config: {path}: training_flags: unknown flag {flag!r}")
            if flag in RUN_FLAGS or flag in own:
                raise ValueError(f"--config: {path}: training_flags: {flag} is set by the "
                                 "benchmark itself (the model, layout or run): drop it")
        try:
            ddp.check_args(settings.read(parser, own + flags), device.is_cuda())
        except ValueError as err:
            raise ValueError(f"--config: {path}: training_flags with {model_name}: "
                             f"{err}") from None


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


def model_flags(model: Model, layout: str, world_size: int, train_iters: int) -> List[str]:
    """The training flags of MODEL in LAYOUT: the shipped config, its overrides, the layout
    (sequence parallel with TP), one micro-batch per data-parallel rank per iteration of
    tokens_per_rank tokens per rank, and a schedule fixed by iteration."""
    tp, ep, etp = parse_layout(layout)
    micro_batch = model.tokens_per_rank * tp // model.seq_length
    data_parallel = world_size // tp
    flags = ["--config", model.config]
    for key, value in model.overrides.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    flags += ["--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
              "--expert-tensor-parallel-size", str(etp),
              "--micro-batch-size", str(micro_batch),
              "--global-batch-size", str(micro_batch * data_parallel),
              "--train-iters", str(train_iters), "--lr-warmup-iters", "1",
              "--lr-decay-iters", "1000", "--eval-iters", "0", "--log-interval", "1"]
    if tp > 1:
        flags.append("--sequence-parallel")
    return flags


def record_key(record: dict) -> tuple:
    return (record["pass"], record["model"], record["preset"], record["layout"],
            record["dispatcher"])


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
    """One dispatcher in one configuration, over every pass."""

    model: str
    preset: str
    layout: str
    dispatcher: str
    tokens_per_s: float = 0.0  # median over the timed iterations of all passes
    pass_medians: List[float] = field(default_factory=list)
    spread: float = 0.0  # (max - min) / median of the passes' medians
    breakdown_ms: Dict[str, float] = field(default_factory=dict)  # medians per iteration
    step_ms: float = 0.0
    final_losses: List[float] = field(default_factory=list)  # per pass, at the common length
    max_loss_diff: Optional[float] = None  # vs alltoall, every common iteration, every pass
    choices: List[str] = field(default_factory=list)
    timed: int = 0
    vs: Dict[str, float] = field(default_factory=dict)  # tokens/s over alltoall's, ds_baseline's


def summarize(records: Sequence[dict], config: dict) -> dict:
    """Rows per configuration and the targets (see docs/benchmark.md)."""
    warmup = config["warmup"]
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["preset"], r["layout"], r["dispatcher"]), []).append(r)
    rows: List[Row] = []
    for (model, preset, layout, dispatcher), runs in sorted(groups.items()):
        row = Row(model, preset, layout, dispatcher)
        pooled, per_category, steps = [], {c: [] for c in BREAKDOWN}, []
        for run in sorted(runs, key=lambda r: r["pass"]):
            timed = timed_iterations(run, warmup)
            rates = [run["tokens_per_iteration"] / (it["slowest_rank_step_ms"] / 1e3)
                     for it in timed]
            if rates:
                row.pass_medians.append(statistics.median(rates))
            pooled += rates
            for it in timed:
                steps.append(it["slowest_rank_step_ms"])
                for category in BREAKDOWN:
                    per_category[category].append(it["ms"].get(category, 0.0))
            row.choices += [c for c in run.get("choices", []) if c and c not in row.choices]
        row.timed = len(pooled)
        if pooled:
            row.tokens_per_s = statistics.median(pooled)
            row.step_ms = statistics.median(steps)
            row.breakdown_ms = {c: statistics.median(v) for c, v in per_category.items()}
        if len(row.pass_medians) > 1:
            row.spread = ((max(row.pass_medians) - min(row.pass_medians))
                          / statistics.median(row.pass_medians))
        rows.append(row)

    by_config: Dict[tuple, Dict[str, Row]] = {}
    for row in rows:
        by_config.setdefault((row.model, row.preset, row.layout), {})[row.dispatcher] = row
    loss_problems = []
    for key, table in by_config.items():
        _compare_losses(key, table, groups, loss_problems)
        for other in (BASELINE, DEEPSPEED):
            if other in table and table[other].tokens_per_s:
                for row in table.values():
                    row.vs[other] = row.tokens_per_s / table[other].tokens_per_s
    return {"rows": [row.__dict__ for row in rows],
            "targets": _targets(by_config),
            "losses_equal": not loss_problems, "loss_problems": loss_problems,
            "loss_tolerance": LOSS_TOLERANCE, "warmup": warmup,
            "passes": max((r["pass"] for r in records), default=0),
            "training_flags": config["training_flags"],
            "load": sorted({round(l, 1) for r in records for l in r.get("load", [])[:1]})}


def _compare_losses(key, table: Dict[str, Row], groups, problems: list) -> None:
    """Final loss per pass (at the iteration every dispatcher of the launch reached) and the
    largest difference from alltoall's losses over those iterations."""
    model, preset, layout = key
    runs = {name: {r["pass"]: r["losses"] for r in groups[(model, preset, layout, name)]}
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
        if row.max_loss_diff is not None and not row.max_loss_diff <= LOSS_TOLERANCE:
            problems.append(f"{model} {preset} ({layout}) {name}: |loss - alltoall's| up to "
                            f"{row.max_loss_diff:.2e} > {LOSS_TOLERANCE:g}")


def _targets(by_config) -> List[dict]:
    """The targets: on pcie at (2,2,2) parm >= 1.3x alltoall and >= 2x ds_baseline
    per model; everywhere parm >= alltoall within the larger of the two's spreads."""
    targets = []
    for (model, preset, layout), table in sorted(by_config.items()):
        parm = table.get(AUTO)
        if parm is None or not parm.tokens_per_s:
            continue
        if preset == "pcie" and layout == "2,2,2":
            for other, bound in ((BASELINE, 1.3), (DEEPSPEED, 2.0)):
                if other in parm.vs:
                    targets.append({"target": f"parm >= {bound}x {other}", "model": model,
                                    "preset": preset, "layout": layout,
                                    "value": parm.vs[other], "met": parm.vs[other] >= bound})
        if BASELINE in parm.vs:
            spread = max(parm.spread, table[BASELINE].spread)
            targets.append({"target": "parm >= alltoall within the spread", "model": model,
                            "preset": preset, "layout": layout, "value": parm.vs[BASELINE],
                            "spread": spread, "met": parm.vs[BASELINE] >= 1 - spread})
    return targets


_SHORT = {"moe_dispatch": "dispatch", "moe_experts": "experts", "moe_combine": "combine",
          "moe_dispatch_combine": "disp+comb", "attention_dense": "attn+dense",
          "tp_sp": "TP/SP", "dp_grad_reduce": "DP grad", "optimizer": "optim", "rest": "rest"}


def markdown(summary: dict) -> str:
    """Tokens/s with ratios and losses, then the time breakdown, per configuration."""
    lines = ([f"Every run with the training flags {' '.join(summary['training_flags'])}", ""]
             if summary.get("training_flags") else [])
    lines += ["| model | preset | layout | dispatcher | tokens/s | spread | vs alltoall | "
             "vs ds_baseline | final loss | max abs loss diff vs alltoall | timed iterations |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        name = r["dispatcher"] + (f" ({'; '.join(r['choices'])})" if r["choices"] else "")
        diff = "-" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.1e}"
        lines.append(
            f"| {r['model']} | {r['preset']} | ({r['layout']}) | {name} | {r['tokens_per_s']:.0f} "
            f"| {100 * r['spread']:.1f}% | {_ratio(r['vs'].get(BASELINE))} | "
            f"{_ratio(r['vs'].get(DEEPSPEED))} | "
            f"{' / '.join(f'{x:.5f}' for x in r['final_losses'])} | "
            f"{diff} | {r['timed']} |")
    lines += ["", "Time per iteration (ms, medians over the timed iterations, mean over ranks; "
              "the step is the slowest rank's):", "",
              "| model | preset | layout | dispatcher | " + " | ".join(_SHORT[c] for c in BREAKDOWN)
              + " | step |", "|---|---|---|---|" + "---:|" * (len(BREAKDOWN) + 1)]
    for r in summary["rows"]:
        lines.append(f"| {r['model']} | {r['preset']} | ({r['layout']}) | {r['dispatcher']} | "
                     + " | ".join(f"{r['breakdown_ms'].get(c, 0.0):.0f}" for c in BREAKDOWN)
                     + f" | {r['step_ms']:.0f} |")
    lines += ["", f"Losses equal to alltoall's within {summary['loss_tolerance']:g}: "
              + ("yes" if summary["losses_equal"] else "NO: " + "; ".join(summary["loss_problems"]))]
    for t in summary["targets"]:
        lines.append(f"- {t['target']}, {t['model']} {t['preset']} ({t['layout']}): "
                     f"{t['value']:.2f}x: {'met' if t['met'] else 'missed'}")
    return "\n".join(lines) + "\n"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


PLOT_COLUMNS = 3


def plot(summary: dict, path: str) -> None:
    """Tokens/s per dispatcher (error bars: the passes' medians), one panel per
    configuration, at most PLOT_COLUMNS panels per row."""
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
    for axis, key in zip(axes.flat, configs):
        rows = [r for r in summary["rows"] if (r["model"], r["preset"], r["layout"]) == key]
        values = [r["tokens_per_s"] for r in rows]
        low = [v - min(r["pass_medians"] or [v]) for v, r in zip(values, rows)]
        high = [max(r["pass_medians"] or [v]) - v for v, r in zip(values, rows)]
        axis.bar(range(len(rows)), values, yerr=[low, high], capsize=3,
                 color=["tab:gray" if r["dispatcher"] in (BASELINE, DEEPSPEED) else "tab:blue"
                        for r in rows])
        axis.set_xticks(range(len(rows)))
        axis.set_xticklabels([r["dispatcher"] for r in rows], rotation=45, ha="right")
        axis.set_title(f"{key[0]}, {key[1]} ({key[2]})", fontsize=9)
        axis.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
