"""When a run saves, and where its global non-persistent checkpoints live (Megatron-LM's
checkpoint_and_decide_exit: a save at --save-interval, else a non-persistent one at
--non-persistent-save-interval; the end's save is the trainer's own).

    save_due(iteration, args)            'persistent', 'non-persistent' or None
    non_persistent_root(args, base)      --non-persistent-global-ckpt-dir, or BASE/non_persistent
                                         (BASE: --save when saving, --load when loading); None
                                         without --non-persistent-ckpt-type global

A non-persistent folder is an ordinary checkpoint folder that keeps only its latest save
(save_load: non_persistent=True); a resume loads it when it is at least as new as --load's.
"""

from __future__ import annotations

import os
from typing import Optional

PERSISTENT, NON_PERSISTENT = "persistent", "non-persistent"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's name


def save_due(iteration: int, args) -> Optional[str]:
    if not args.save or iteration >= args.train_iters:
        return None
    if args.save_interval and iteration % args.save_interval == 0:
        return PERSISTENT
    if args.non_persistent_ckpt_type == "global" and args.non_persistent_save_interval \
            and iteration % args.non_persistent_save_interval == 0:
        return NON_PERSISTENT
    return None


def non_persistent_root(args, base: Optional[str]) -> Optional[str]:
    if args.non_persistent_ckpt_type != "global":
        return None
    if args.non_persistent_global_ckpt_dir:
        return args.non_persistent_global_ckpt_dir
    return os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None
