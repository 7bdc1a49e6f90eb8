"""A fault-injection test's hook into a save: tests/e2e/test_checkpoint.py and test_faults.py
kill a rank at a named stage of save_checkpoint to check that the previous checkpoint survives.

    set_fault_hook(hook)            hook(stage, iteration) runs at each stage of a save; None: off
    fault_point(stage, iteration)   where save_checkpoint calls it: 'staged' (folder created),
                                    'written' (all tensors written, not yet published)

Training never sets a hook: fault_point then does nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

_fault_hook: Optional[Callable[[str, int], None]] = None


def set_fault_hook(hook: Optional[Callable[[str, int], None]]) -> None:
    """Call hook(stage, iteration) at each stage of a save ('staged': folder created,
    'written': all tensors written but not published). For fault-injection tests only."""
    global _fault_hook
    _fault_hook = hook


def fault_point(stage: str, iteration: int) -> None:
    if _fault_hook is not None:
        _fault_hook(stage, iteration)
