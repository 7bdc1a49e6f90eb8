"""Wording shared by the messages of the package and its tools (pure: no imports).

    plural(4, "rank")           -> "4 ranks"
    plural(1, "micro-batch")    -> "1 micro-batch"
    plural(2, "micro-batch")    -> "2 micro-batches"
"""

from __future__ import annotations

from typing import Optional


def plural(count: int, noun: str, plural_noun: Optional[str] = None) -> str:
    """COUNT and NOUN, the noun in the plural unless COUNT is 1.

    Args:
        count: how many.
        noun: the singular ("rank", "micro-batch").
        plural_noun: the plural where adding "s" (or "es" after s, x, ch, sh) is wrong.
    """
    if count == 1:
        return f"{count} {noun}"
    if plural_noun is None:
        plural_noun = noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{count} {plural_noun}"
