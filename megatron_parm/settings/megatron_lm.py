"""Megatron-LM's training flags as facts: names, kind, type, default, nargs and choices of every
option of its parser at core_v0.16.1 (the tag of the Megatron-Core this project pins), kept in
megatron_lm_0_16_1.tsv (the file's header says its columns).

    OPTIONS            primary name -> Option, in Megatron-LM's order
    option(name)       the Option one of its names (an alias included) belongs to, or None
    resolve(flag)      a declaration with the fields it leaves UNSET filled from its Option
    differences(flag)  the fields a declaration sets to something else than Megatron-LM's

Torch-free: read by the launcher before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_parm.settings.flag import UNSET, Flag, int_tuple, layer_pattern, true_or_false

VERSION = "core_v0.16.1"
FACTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_0_16_1.tsv")

# The facts' type names and what reads a value of each.
TYPES: Dict[str, Optional[Callable]] = {
    "-": None, "int": int, "float": float, "str": str, "bool": true_or_false, "enum": str,
    "layer-pattern": layer_pattern, "int-tuple": int_tuple}
# The facts' kinds as a Flag's (kind, inverted).
KINDS = {"value": ("value", False), "true": ("switch", False), "false": ("switch", True),
         "both": ("toggle", False)}


@dataclass(frozen=True)
class Option:
    """One option of Megatron-LM's parser, as its facts file says it."""

    names: Tuple[str, ...]
    dest: str
    kind: str  # "value", "switch", "toggle"
    inverted: bool
    type_name: str
    default: Any
    nargs: Optional[str]
    choices: Optional[Tuple[str, ...]]
    group: str

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def type(self) -> Optional[Callable]:
        return TYPES[self.type_name]


def _read(path: str) -> Dict[str, Option]:
    options: Dict[str, Option] = {}
    with open(path, encoding="utf-8") as handle:
        rows = [line.rstrip("\n").split("\t") for line in handle if not line.startswith("#")]
    header, rows = rows[0], rows[1:]
    for row in rows:
        cells = dict(zip(header, row))
        kind, inverted = KINDS[cells["kind"]]
        nargs = None if cells["nargs"] == "-" else cells["nargs"]
        if nargs is not None and nargs.isdigit():
            nargs = int(nargs)
        choices = None if cells["choices"] == "-" else tuple(json.loads(cells["choices"]))
        if choices is not None and cells["type"] in ("int", "float"):
            # stored as strings; argparse compares them with the converted value (range(0, 3))
            choices = tuple(TYPES[cells["type"]](choice) for choice in choices)
        names = tuple(cells["names"].split())
        options[names[0]] = Option(names, cells["dest"], kind, inverted, cells["type"],
                                   json.loads(cells["default"]), nargs, choices, cells["group"])
    return options


OPTIONS: Dict[str, Option] = _read(FACTS_FILE)
_BY_NAME: Dict[str, Option] = {name: o for o in OPTIONS.values() for name in o.names}


def option(name: str) -> Optional[Option]:
    return _BY_NAME.get(name)


def _facts(opt: Optional[Option]) -> Dict[str, Any]:
    """A Flag's fields as an Option says them (the plain ones where there is no Option)."""
    if opt is None:
        return dict(type=None, default=None, kind="value", inverted=False, nargs=None,
                    choices=None, aliases=())
    default = list(opt.default) if isinstance(opt.default, list) else opt.default
    return dict(type=opt.type, default=default, kind=opt.kind, inverted=opt.inverted,
                nargs=opt.nargs, choices=opt.choices, aliases=opt.names[1:])


def resolve(flag: Flag) -> Flag:
    """The declaration with its UNSET fields filled from Megatron-LM's facts (plain defaults for
    a flag of this project's own)."""
    facts = _facts(option(flag.name))
    filled = {field: value for field, value in facts.items()
              if getattr(flag, field) is UNSET}
    opt = option(flag.name)
    if flag.dest is None and opt is not None:
        filled["dest"] = opt.dest
    return dataclasses.replace(flag, **filled)


def differences(flag: Flag) -> List[str]:
    """The fields a declaration sets explicitly to something other than Megatron-LM's (empty for
    a flag Megatron-LM does not have)."""
    opt = option(flag.name)
    if opt is None:
        return []
    facts = _facts(opt)
    found = []
    for field, fact in facts.items():
        value = getattr(flag, field)
        if value is UNSET:
            continue
        if field == "choices" and value is not None and not callable(value):
            value = tuple(value)
        if field == "aliases":
            value = tuple(value)
            if not set(fact) <= set(value):
                found.append(field)
            continue
        if value != fact:
            found.append(field)
    return found


def from_option(opt: Option, group: str, help: str) -> Flag:
    """A Flag for an option this project declares nothing of (no effect here, or refused)."""
    return resolve(Flag(opt.name, group, help=help))
