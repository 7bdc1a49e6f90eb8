"""Megatron-Core's strategies for writing and reading a torch_dist checkpoint, as the flags choose
them (Megatron-LM's save_checkpoint and _load_global_dist_base_checkpoint), and what a load does
with tensors the model and the checkpoint do not share (--dist-ckpt-strictness).

    CheckpointingContext               what the saves of one run share (Megatron-LM's
                                       checkpointing_context): the save strategy
    save_strategy(options, context)    -> (strategy, validate_access_integrity)
    load_strategy(path, options)       Megatron-Core's default, fully parallel with
                                       --ckpt-fully-parallel-load
    mcore_strictness(strictness)       what Megatron-Core's load is asked for
    strictness_outcome(strictness, missing, unexpected) -> (error or None, notes)

Saving: Megatron-Core's TorchDistSaveShardedStrategy, wrapped (Megatron-LM's default, off with
--no-ckpt-fully-parallel-save) in its FullyParallelSaveStrategyWrapper over the data-parallel
group, which spreads the writing of replicated tensors over the ranks that hold them. With
--ckpt-assume-constant-structure the strategy is kept for the run's next saves and told to
cache the checkpoint's structure: once two saves agree, later ones reuse the plan and metadata.

Strictness: 'unexpected' tensors are ones the model asks for that the checkpoint lacks,
'missing' ones are in the checkpoint and asked for by no rank (Megatron-Core's StrictHandling).
assume_ok_unexpected: the load checks what is asked for first (verify.check_request: an error
naming the tensor). Every other value: Megatron-Core's load leaves the unexpected ones out and
returns both sets; the model keeps its own values of what was left out; every rank gets every
rank's sets, so that all raise (raise_*) or note them (log_*, return_*: the notes name them
once) alike; ignore_all says nothing.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_parm.checkpointing.options import STRICTNESS_DEFAULT

_SHOWN = 8


class CheckpointingContext:
    """What the saves of one run share: the save strategy (kept with
    --ckpt-assume-constant-structure, whose cache lives in it)."""

    def __init__(self):
        self.save_strategy = None

    def structure_reused(self) -> bool:
        """Whether the next save reuses the cached structure (two saves before it agreed)."""
        strategy = getattr(self.save_strategy, "base_strategy", self.save_strategy)
        return bool(getattr(strategy, "validated_cache_reuse", False))


def save_strategy(options, context: Optional[CheckpointingContext]):
    """(the strategy a torch_dist save writes with, whether dist_checkpointing.save checks that
    every tensor is written exactly once); a strategy kept in CONTEXT is reused, as Megatron-LM
    does, and was checked on its first save with --ckpt-assume-constant-structure."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    if context is not None and context.save_strategy is not None:
        return context.save_strategy, not options.constant_structure
    strategy = get_default_save_sharded_strategy("torch_dist")
    if options.constant_structure:
        strategy.use_cached_ckpt_structure = True
    if options.fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
            options.constant_structure)
    if context is not None and options.constant_structure:
        context.save_strategy = strategy
    return strategy, True


def load_strategy(path: str, options):
    """Megatron-Core's load strategy for PATH, fully parallel over the data-parallel group with
    --ckpt-fully-parallel-load (on CPU, mcore_compat's fully_parallel_load keeps its exchange
    buffers on the host)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    strategy = get_default_load_sharded_strategy(path)
    if options.fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return strategy


def mcore_strictness(strictness: str) -> str:
    """The StrictHandling value Megatron-Core's load gets: the default as it is; the others as
    the return_* value that finds the same keys, which strictness_outcome then treats."""
    if strictness == STRICTNESS_DEFAULT or strictness == "ignore_all":
        return strictness
    return "return_all" if strictness.endswith("_all") else "return_unexpected"


def strictness_outcome(strictness: str, missing, unexpected) -> Tuple[Optional[str], List[str]]:
    """(the error every rank raises, or None; the notes) for the keys every rank's load found:
    MISSING in the checkpoint and asked for by no rank, UNEXPECTED asked for and not in it."""
    if strictness in (STRICTNESS_DEFAULT, "ignore_all") or not (missing or unexpected):
        return None, []
    lacking = f"not in the checkpoint: {_keys(unexpected)}" if unexpected else ""
    extra = f"in the checkpoint, not in this model: {_keys(missing)}" if missing else ""
    if strictness.startswith("raise_"):
        return f"--dist-ckpt-strictness {strictness}: " + "; ".join(
            part for part in (lacking, extra) if part), []
    notes = [lacking + " (they keep this run's initial values)" if lacking else "",
             extra + " (not loaded)" if extra else ""]
    return None, [f"--dist-ckpt-strictness {strictness}: {note}" for note in notes if note]


def _keys(keys) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more
