"""What the checkpoint flags ask of a save and of a load, read once from a run's args.

    SaveOptions.from_args(args)   --ckpt-format, --no-ckpt-fully-parallel-save,
                                  --ckpt-assume-constant-structure, --no-save-optim,
                                  --no-save-rng, --save-retain-interval
    LoadOptions.from_args(args)   --ckpt-format, --auto-detect-ckpt-format,
                                  --dist-ckpt-strictness, --ckpt-fully-parallel-load,
                                  --no-load-optim, --no-load-rng, --finetune

A tool that saves or loads without a run's flags (the converters, None args) gets Megatron-LM's
defaults. A checkpoint found through --pretrained-checkpoint is loaded as with --finetune
(LoadOptions.finetuning()).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_parm.checkpointing.formats import TORCH_DIST

STRICTNESS_DEFAULT = "assume_ok_unexpected"  # Megatron-LM's --dist-ckpt-strictness default


def _flag(args, key: str, default):
    value = getattr(args, key, None)
    return default if value is None else value


@dataclass(frozen=True)
class SaveOptions:
    ckpt_format: str = TORCH_DIST
    fully_parallel: bool = True  # Megatron-LM's default
    constant_structure: bool = False
    save_optim: bool = True
    save_rng: bool = True
    retain_interval: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "SaveOptions":
        return cls(ckpt_format=_flag(args, "ckpt_format", TORCH_DIST),
                   fully_parallel=_flag(args, "ckpt_fully_parallel_save", True),
                   constant_structure=_flag(args, "ckpt_assume_constant_structure", False),
                   save_optim=not _flag(args, "no_save_optim", False),
                   save_rng=not _flag(args, "no_save_rng", False),
                   retain_interval=getattr(args, "save_retain_interval", None))


@dataclass(frozen=True)
class LoadOptions:
    ckpt_format: str = TORCH_DIST
    auto_detect: bool = False
    strictness: str = STRICTNESS_DEFAULT
    fully_parallel: bool = False
    load_optim: bool = True  # the optimizer's state and the learning-rate schedule
    load_rng: bool = True
    finetune: bool = False  # weights only: iteration 0, the data from its start

    @classmethod
    def from_args(cls, args) -> "LoadOptions":
        finetune = bool(_flag(args, "finetune", False))
        return cls(ckpt_format=_flag(args, "ckpt_format", TORCH_DIST),
                   auto_detect=_flag(args, "auto_detect_ckpt_format", False),
                   strictness=_flag(args, "dist_ckpt_strictness", STRICTNESS_DEFAULT),
                   fully_parallel=_flag(args, "ckpt_fully_parallel_load", False),
                   load_optim=not (finetune or _flag(args, "no_load_optim", False)),
                   load_rng=not (finetune or _flag(args, "no_load_rng", False)),
                   finetune=finetune)

    def finetuning(self) -> "LoadOptions":
        """These options as --finetune sets them (Megatron-LM's --pretrained-checkpoint)."""
        return dataclasses.replace(self, load_optim=False, load_rng=False, finetune=True)
