"""The one reader of argv and config files.

    Parser                         argparse.ArgumentParser whose unknown-flag error suggests the
                                   closest valid flag ("did you mean --hidden-size?")
    training_parser()              the pretraining scripts' parser: Megatron-LM's whole flag
                                   surface and --parm-*
    read(parser, argv)             argv over the --config file (YAML or JSON) over the defaults,
                                   then every declared check and the refusals: the one reader of
                                   settings (a flag given on the command line also replaces the
                                   file's value of the same setting in another unit:
                                   --train-samples its train_iters)
    read_config_file(path)         the mapping a config file holds (ValueError naming it)
    config_values(path, parser)    a config file's values for a parser's flags
    require(args, names)           ValueError for the first required flag without a value
    given(parser, argv)            the dests set on the command line
    unknown_flags(argv, parser)    one line for misspelled flags of an argv (None if none)

A config file's keys are flag names with underscores (`num_layers: 12`, `no_bias_gelu_fusion:
true`, `no_parm_tune: true`): every key is a flag, and a value is what the flag would take on
the command line (true/false for a switch).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from megatron_parm.settings import registry
from megatron_parm.settings.registry import FLAGS, refusal


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


def training_parser(description: Optional[str] = None) -> Parser:
    """The parser of the pretraining flags (training/arguments.py validates what it reads):
    every flag of Megatron-LM's training parser, and this project's."""
    parser = Parser(description=description)
    registry.add_flags(parser, [registry.CONFIG.name])
    for title in registry.TRAINING_GROUPS:
        names = [name for name in registry.group(title, exclude=registry.PLANNER_ONLY)
                 if name not in registry.SURFACE]
        registry.add_flags(parser.add_argument_group(title), names)
    for title in (registry.NO_EFFECT_GROUP, registry.REFUSED_GROUP):
        names = [name for name, flag in registry.SURFACE.items() if flag.group == title]
        registry.add_flags(parser.add_argument_group(title), names, flags=registry.SURFACE)
    return parser


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
# config files: defaults < --config < command line
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


def config_key(name: str) -> str:
    """A flag's key in a config file: '--no-bias-gelu-fusion' -> 'no_bias_gelu_fusion'."""
    return name.lstrip("-").replace("-", "_")


def _keys(actions: Iterable[argparse.Action]) -> Dict[str, Tuple[argparse.Action, str]]:
    """config key -> (the action, the option string it names)."""
    keys = {}
    for action in actions:
        for option in action.option_strings:
            if option.startswith("--"):
                keys.setdefault(config_key(option), (action, option))
    return keys


def _as_list(flag: str, value) -> list:
    if isinstance(value, str):
        return value.split()
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _typed(flag: str, action: argparse.Action, value):
    """One item of a value flag, as the command line would give it."""
    if value is None:
        return None
    kind = action.type
    if isinstance(value, str) and kind is not None:
        try:
            return kind(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{flag}: invalid value {value!r}: {error}") from error
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{flag} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{flag} must be a number, got {value!r}")
    return value


def _config_value(action: argparse.Action, option: str, value):
    """(dest, value) of one config entry, as the command line would set it."""
    if action.nargs == 0:  # store_true / store_false / --x and --no-x
        if not isinstance(value, bool):
            raise ValueError(f"{option} must be true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value if not option.startswith("--no-") else not value
        return action.const if value else action.default
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = [_typed(option, action, item) for item in _as_list(option, value)]
        value = items
    else:
        value = _typed(option, action, value)
    if action.choices is not None and value is not None:
        for item in value if isinstance(value, list) else [value]:
            if item not in action.choices:
                raise ValueError(f"{option}: invalid choice: {item!r} (choose from "
                                 f"{', '.join(map(str, action.choices))})")
    return value


def config_values(path: str, parser: argparse.ArgumentParser,
                  aliases: Optional[Dict[str, str]] = None, strict: bool = True,
                  command_line_only: Iterable[str] = ()) -> Tuple[dict, List[str]]:
    """(values by dest for the parser's flags, keys it does not take) of a config file.

    Keys no flag has are an error (with the closest key); with ``strict`` so are flags this
    parser does not take, else they come back as unused (a planner reads a training config),
    as do the keys of ``command_line_only`` (dests). ``aliases``: key -> dest of a tool's own
    older keys."""
    aliases = aliases or {}
    excluded = set(command_line_only) | {"help", "config"}
    actions = [a for a in parser._actions if a.dest not in excluded]
    known = _keys(actions)
    by_dest = {action.dest: action for action in actions}
    everywhere = {config_key(name) for flag in FLAGS.values() for name in flag.names}
    values, unused, unknown = {}, [], []
    for raw_key, value in read_config_file(path).items():
        key = config_key(str(raw_key))
        if key in aliases and aliases[key] in by_dest:
            action = by_dest[aliases[key]]
            values[action.dest] = _config_value(action, action.option_strings[0], value)
        elif key in known:
            action, option = known[key]
            values[action.dest] = _config_value(action, option, value)
        elif (key in everywhere or key in set(command_line_only)) and not strict:
            unused.append(key)
        else:
            unknown.append(key)
    if unknown:
        hints = [f"{key} -> {close}" for key in unknown
                 for close in [suggest(key, known)] if close]
        raise ValueError(f"--config: {path}: unknown keys {', '.join(sorted(unknown))} (keys "
                         f"are flag names with underscores, e.g. num_layers"
                         + (f"; did you mean {', '.join(hints)}?" if hints else "") + ")")
    return values, unused


def read(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
         aliases: Optional[Dict[str, str]] = None, strict: bool = True,
         reader: str = "here", command_line_only: Iterable[str] = ()) -> argparse.Namespace:
    """The settings of argv: the command line over the --config file over the defaults, then
    each given flag's declared check, then the refusal of what does not run here (one line
    naming every such flag). Keys of the config file that are flags of other entry points are
    listed in one note on stderr ("not used <reader>: ...") where ``strict`` is off (the
    planners read training configs)."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path:
        values, unused = config_values(path, parser, aliases, strict, command_line_only)
        if unused:
            print(f"note: --config {path}: not used {reader}: {', '.join(sorted(unused))}",
                  file=sys.stderr)
        parser.set_defaults(**_replaced(values, parser, argv))
        args = parser.parse_args(argv)
    check(args)
    problem = refusal(args, [action.flag.name for action in parser._actions
                             if getattr(action, "flag", None) is not None])
    if problem:
        raise ValueError(problem)
    return args


def _replaced(values: dict, parser: argparse.ArgumentParser,
              argv: Optional[Sequence[str]]) -> dict:
    """A config file's VALUES less those the command line replaces with another unit of the
    same setting (registry.ALTERNATIVES: --train-samples replaces the file's train_iters)."""
    on_command_line = given(parser, sys.argv[1:] if argv is None else argv)
    dropped = {dest for dests in registry.ALTERNATIVES if on_command_line & set(dests)
               for dest in dests if dest not in on_command_line}
    return {dest: value for dest, value in values.items() if dest not in dropped}


def check(args: argparse.Namespace) -> None:
    """Each flag's declared check, for every flag of args that has a value."""
    for flag in FLAGS.values():
        if flag.check is not None and getattr(args, flag.key, None) is not None:
            flag.check(flag.name, getattr(args, flag.key))


def flag_of(key: str) -> str:
    """The flag of a dest ("num_layers" -> "--num-layers")."""
    for flag in FLAGS.values():
        if flag.key == key:
            return flag.name
    return f"--{key.replace('_', '-')}"


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
