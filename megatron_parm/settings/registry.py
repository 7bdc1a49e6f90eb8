"""Every flag once, by name, and the parsers built from them.

    FLAGS                     name -> Flag: this project's declarations (their Megatron-LM facts
                              filled in), then every other option of Megatron-LM's parser
    status(name)              "implemented", "no effect" or "refused" (surface.py says why)
    group(title)              the names of one group of flags, in declaration order
    add_flags(parser, names)  put flags on an argparse parser (or group); a tool may give its
                              own defaults and required flags
    refusal(args)             the one line refusing what args ask for that does not run here
    no_effect_note(args)      the one start-up line naming the flags args set that change nothing
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

from megatron_parm.settings import (
    checkpoints, data, logging, megatron_lm, model, moe, mtp, optimizer, parallel, parm,
    precision, run_control, surface, training)
from megatron_parm.settings.flag import DECLARED, Flag

IMPLEMENTED, NO_EFFECT, REFUSED = "implemented", "no effect", "refused"
NO_EFFECT_GROUP = "no effect here (named once at start-up when given)"
REFUSED_GROUP = "not available here (refused when given a value other than the default)"

CONFIG = Flag("--config", "config", str, help="YAML (or JSON) file of flag values (keys: flag "
              "names with underscores); command-line flags override it.")


def _declare() -> List[Flag]:
    """This project's declarations, by concern (the order of --help)."""
    return [CONFIG, *model.flags(), *mtp.flags(), *moe.flags(), *parm.flags(), *parallel.flags(),
            *parallel.cluster_flags(), *training.flags(), *optimizer.flags(),
            *checkpoints.flags(), *run_control.flags(), *logging.flags(), *precision.flags(),
            *data.flags(), *data.tokenizer_flags()]


DECLARATIONS: List[Flag] = _declare()


def status(name: str) -> str:
    """What a flag of the training scripts does here (surface.py's tables, else declared)."""
    if name in surface.REFUSED:
        return REFUSED
    if name in surface.NO_EFFECT:
        return NO_EFFECT
    return IMPLEMENTED


def _surface_flag(opt: megatron_lm.Option) -> Flag:
    if opt.name in surface.REFUSED:
        return megatron_lm.from_option(opt, REFUSED_GROUP, f"refused here: "
                                       f"{surface.REFUSED[opt.name]}")
    return megatron_lm.from_option(opt, NO_EFFECT_GROUP,
                                   f"no effect here: {surface.NO_EFFECT[opt.name]}")


def _all_flags() -> Dict[str, Flag]:
    flags = {flag.name: megatron_lm.resolve(flag) for flag in DECLARATIONS}
    for name, opt in megatron_lm.OPTIONS.items():
        if name not in flags:
            flags[name] = _surface_flag(opt)
    return flags


FLAGS: Dict[str, Flag] = _all_flags()
# The training parser's flags that surface.py lists, built from their facts.
SURFACE: Dict[str, Flag] = {name: _surface_flag(opt) for name, opt in megatron_lm.OPTIONS.items()
                            if status(name) != IMPLEMENTED}

# The pretraining entry points (pretrain_scripts/) and the model each trains: the launcher
# checks their flags against training_parser() before it starts any rank.
TRAINING_SCRIPTS = {"pretrain_gpt2_moe.py": "gpt", "pretrain_bert_moe.py": "bert"}
# The groups of training's parser, in --help order.
TRAINING_GROUPS = (model.GROUP, mtp.GROUP, moe.GROUP, parm.GROUP, parallel.GROUP, training.GROUP,
                   optimizer.GROUP, checkpoints.GROUP, run_control.GROUP, logging.GROUP,
                   precision.GROUP, data.GROUP, data.TOKENIZER)
# Dests that say one setting in different units: given on the command line, one replaces the
# others' config-file values (training.ALTERNATIVES).
ALTERNATIVES = training.ALTERNATIVES
# Flags of a group that training does not take (the planners' own).
PLANNER_ONLY = ("--parm-chunk-candidates",)


def group(title: str, exclude: Iterable[str] = ()) -> List[str]:
    """The flag names of one group, in declaration order."""
    skip = set(exclude)
    return [name for name, flag in FLAGS.items() if flag.group == title and name not in skip]


def add_flags(parser, names: Iterable[str], defaults: Optional[Dict[str, Any]] = None,
              required: Iterable[str] = (), helps: Optional[Dict[str, str]] = None,
              aliases: Optional[Dict[str, Sequence[str]]] = None,
              flags: Optional[Dict[str, Flag]] = None) -> None:
    """Put the named flags on an argparse parser or argument group. A tool may give, by key,
    ``defaults`` of its own (None included) and the ``helps`` that say what its defaults
    mean; ``required`` names flags argparse must see, ``aliases`` (by name) older spellings
    a tool still takes."""
    defaults, helps, aliases = defaults or {}, helps or {}, aliases or {}
    flags = FLAGS if flags is None else flags
    must = set(required)
    for name in names:
        flag = flags[name]
        flag.add_to(parser, defaults.get(flag.key, DECLARED), required=name in must,
                    help=helps.get(flag.key), aliases=aliases.get(name, ()))


# ---------------------------------------------------------------------------------------------
# what a run asks for that does not run here, or changes nothing
# ---------------------------------------------------------------------------------------------


def _set_by(args, names: Iterable[str]) -> List[str]:
    """The names among ``names`` (of Megatron-LM's options) whose value in args is not
    Megatron-LM's default; of options that share a destination, the first one's default counts
    (argparse's rule)."""
    found, first_default = [], {}
    for opt in megatron_lm.OPTIONS.values():
        first_default.setdefault(opt.dest, opt.default)
    for name in names:
        opt = megatron_lm.option(name)
        if hasattr(args, opt.dest) and getattr(args, opt.dest) != first_default[opt.dest]:
            found.append(name)
    return found


def _shown(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "" if isinstance(value, bool) else str(value)


def refusal(args, names: Optional[Iterable[str]] = None) -> Optional[str]:
    """One line naming each flag args set that is refused here, with its value and why; None
    where there is none. ``names``: the flags of the parser that read args (a tool's own flag
    may share a refused flag's name: tools/bench_moe_layer.py's --warmup); default all."""
    names = set(FLAGS if names is None else names)
    problems = []
    for name in _set_by(args, [name for name in surface.REFUSED if name in names]):
        value = _shown(getattr(args, megatron_lm.option(name).dest))
        problems.append(f"{name}{' ' + value if value else ''}: {surface.REFUSED[name]}")
    for flag in FLAGS.values():
        if flag.name not in names or not hasattr(args, flag.key) or \
                getattr(args, flag.key) is None:
            continue
        value = getattr(args, flag.key)
        supported = flag.supported() if callable(flag.supported) else flag.supported
        why = flag.unsupported if supported is not None and value not in supported else \
            flag.unavailable(value) if flag.unavailable is not None else None
        if why:
            problems.append(f"{flag.name} {value}: {why}")
    if not problems:
        return None
    return "not available here: " + "; ".join(problems)


def no_effect_note(args) -> Optional[str]:
    """One line naming each flag args set that has no effect here, grouped by reason; None where
    there is none."""
    by_reason: Dict[str, List[str]] = {}
    for name in _set_by(args, surface.NO_EFFECT):
        by_reason.setdefault(surface.NO_EFFECT[name], []).append(name)
    if not by_reason:
        return None
    return "note: no effect here: " + "; ".join(f"{', '.join(names)}: {reason}"
                                                for reason, names in by_reason.items())


def check_declarations() -> List[str]:
    """The declarations that change a fact of Megatron-LM's without saying why (``differs``),
    or say why without changing one."""
    problems = []
    for flag in DECLARATIONS:
        changed = megatron_lm.differences(flag)
        if changed and not flag.differs:
            problems.append(f"{flag.name}: {', '.join(changed)} differ from Megatron-LM's")
        if flag.differs and not changed:
            problems.append(f"{flag.name}: says it differs but matches Megatron-LM")
    return problems

