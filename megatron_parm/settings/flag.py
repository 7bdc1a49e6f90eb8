"""One flag: how argparse reads it, and the checks of one value.

    Flag            a declaration: name, group, help, check; type, default, kind, nargs and
                    choices where Megatron-LM does not already say them (megatron_lm.py fills
                    them in for its flags)
    positive_int, non_negative_int, positive_number, fraction, layer_pattern,
    layer_pattern_check, int_tuple
                    checks and value types shared by the concern modules

Cross-flag rules (divisibility, layouts, chunk counts) are not here: they live in
layout_rules.py and schedules.py, which every caller asks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

Check = Callable[[str, Any], None]  # (flag, value) -> None; ValueError naming the flag


class _Unset:
    """A field a declaration leaves to Megatron-LM's facts (or to the plain default)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
DECLARED: Any = object()  # add_to: no default of the tool's own, the declared one


# ---------------------------------------------------------------------------------------------
# checks of one flag's value
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


def non_negative_number(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{flag} must be a number >= 0, got {value!r}")


def fraction(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{flag} must be a number in (0, 1], got {value!r}")


def layer_pattern(text):
    """A per-layer pattern flag's value (--moe-layer-freq): an int, or a list of integers from
    Megatron-LM's list expression ('[0]*3+[1]*9', '([1]*2+[0])*4', '[1,0,1]'; read, never
    evaluated as code)."""
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


def layer_pattern_check(meaning: str) -> Check:
    """The check of a per-layer pattern flag's value: a positive integer (every N-th layer), or
    a list of 0 and 1 per layer, ``meaning`` saying what a 1 and a 0 are."""
    def check(flag: str, value) -> None:
        if isinstance(value, list):
            if not value or any(type(item) is not int or item not in (0, 1) for item in value):
                raise ValueError(f"{flag}: a list holds {meaning} per layer, got {value!r}")
        else:
            positive_int(flag, value)
    return check


def int_tuple(text):
    """'(4, 0)' or '4,0' -> (4, 0), as Megatron-LM reads --window-size."""
    if text is None or isinstance(text, tuple):
        return text
    return tuple(int(item) for item in str(text).strip("()").split(","))


def true_or_false(text) -> bool:
    """A value flag of type bool: true/false, yes/no, 1/0."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in ("true", "yes", "1"):
        return True
    if word in ("false", "no", "0"):
        return False
    raise ValueError(f"not true or false: {text!r}")


# ---------------------------------------------------------------------------------------------
# the declaration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One command-line flag: how argparse reads it and how its value is checked.

    kind: "value" (takes an argument), "switch" (store_true; store_false with ``inverted``),
    or "toggle" (--x / --no-x). For a flag of Megatron-LM's parser, the fields left UNSET
    (type, default, kind, inverted, nargs, choices, aliases) are its facts
    (megatron_lm_0_16_1.tsv); a field set to another value must say why in ``differs``.
    ``supported``: the values of its choices that run here; any other is refused in one line
    with ``unsupported`` (why). ``unavailable``: value -> why it cannot run on this machine
    (a package not installed), or None."""

    name: str  # "--num-layers"
    group: str
    type: Optional[Callable] = UNSET
    default: Any = UNSET
    help: Any = None  # a str, or a function giving it (read when a parser is built)
    choices: Any = UNSET  # a sequence, or a function giving it (the catalog grows at run time)
    kind: str = UNSET
    inverted: bool = UNSET  # a switch that stores False (--bert-no-binary-head)
    dest: Optional[str] = None  # default: the name without dashes, "_" for "-"
    nargs: Optional[str] = UNSET
    metavar: Optional[str] = None
    check: Optional[Check] = None
    aliases: Tuple[str, ...] = UNSET
    differs: Optional[str] = None  # why a fact differs from Megatron-LM's
    supported: Optional[Sequence] = None
    unsupported: Optional[str] = None
    unavailable: Optional[Callable[[Any], Optional[str]]] = None

    @property
    def key(self) -> str:
        """The argparse dest."""
        return self.dest or self.name[2:].replace("-", "_")

    @property
    def names(self) -> Tuple[str, ...]:
        return (self.name, *self.aliases)

    def values(self) -> Optional[Sequence]:
        return self.choices() if callable(self.choices) else self.choices

    def add_to(self, parser, default=DECLARED, required: bool = False,
               help: Optional[str] = None, aliases: Sequence[str] = ()) -> None:
        default = self.default if default is DECLARED else default
        help = help if help is not None else self.help() if callable(self.help) else self.help
        options: Dict[str, Any] = {"help": help, "dest": self.key}
        if self.kind == "switch":
            options.update(action="store_false" if self.inverted else "store_true",
                           default=default)
        elif self.kind == "toggle":
            options.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            options.update(type=self.type, default=default, choices=self.values(),
                           nargs=self.nargs, metavar=self.metavar, required=required)
        names = [self.name, *(alias for alias in (*self.aliases, *aliases)
                              if not (self.kind == "toggle" and alias == self.negative))]
        action = parser.add_argument(*names, **options)
        action.flag = self  # the reader refuses only what a flag of settings sets

    @property
    def negative(self) -> str:
        """A toggle's --no- form."""
        return "--no-" + self.name[2:]
