"""Where the training loop's values are written besides the console: TensorBoard
(--tensorboard-dir) and Weights & Biases (--wandb-project), on rank 0.

    Writers(args, is_rank_0)      both, or whichever is given; every call does nothing where
                                  neither is (or on the other ranks)
      .configured                 a writer was asked for (the same on every rank: the loop's
                                  collectives for the written values run where it is True)
      .scalars(values, iteration, samples=None, wandb=True)
                                  TensorBoard: each value as its tag at ITERATION, and with
                                  SAMPLES also as '<tag> vs samples' at SAMPLES (Megatron-LM's
                                  pairs); W&B (unless wandb=False): each value at ITERATION
      .notices                    one line per writer that cannot write (package missing)
    check_args(args)              ValueError naming the flag for --wandb-* mistakes

W&B runs in offline mode: the run is written under --wandb-save-dir (default SAVE/wandb) and
`wandb sync` uploads it. It is an optional package (pip install 'megatron-parm[wandb]'); where it
is not installed the run says so once and goes on. W&B receives the values TensorBoard does
(without the 'vs samples' copies), whether or not --tensorboard-dir is given.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional


def check_args(args) -> None:
    """The --wandb-* flags: a name that is not empty, a place to write."""
    if not args.wandb_project:
        return
    if args.wandb_exp_name == "":
        raise ValueError("--wandb-exp-name: the W&B run's name must not be empty")
    if not args.wandb_save_dir and not args.save:
        raise ValueError("--wandb-project needs --wandb-save-dir or --save (W&B writes to "
                         "SAVE/wandb by default)")


class TensorBoard:
    """torch.utils.tensorboard on rank 0 when --tensorboard-dir is given and tensorboard is
    installed; otherwise every call does nothing."""

    def __init__(self, log_dir: Optional[str], is_rank_0: bool, queue_size: int = 1000):
        self.writer = None
        self.notice = None
        if log_dir is None or not is_rank_0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.notice = (f"TensorBoard: the 'tensorboard' package is not installed, so nothing "
                           f"is written to {log_dir} (pip install tensorboard to enable it)")
            return
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    """A Weights & Biases run in offline mode on rank 0 when --wandb-project is given and the
    package is installed; otherwise every call does nothing."""

    def __init__(self, args, is_rank_0: bool):
        self.module = None
        self.notice = None
        self.save_dir = None  # where the offline run is written, once it is
        if not args.wandb_project or not is_rank_0:
            return
        try:
            import wandb
        except ImportError:
            self.notice = (f"W&B: the 'wandb' package is not installed, so nothing is logged "
                           f"for --wandb-project {args.wandb_project} (pip install "
                           f"'megatron-parm[wandb]' to enable it)")
            return
        save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        options = dict(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                       config=dict(vars(args)), mode="offline")
        if args.wandb_entity:
            options["entity"] = args.wandb_entity
        wandb.init(**options)
        self.module = wandb
        self.save_dir = save_dir

    def log(self, values: Dict[str, float], step: int) -> None:
        if self.module is not None and values:
            self.module.log(values, step=step)

    def close(self) -> None:
        if self.module is not None:
            self.module.finish()
            self.module = None


class Writers:
    """TensorBoard and W&B together (see the module docstring)."""

    def __init__(self, args, is_rank_0: bool):
        self.configured = bool(args.tensorboard_dir or args.wandb_project)
        self.tensorboard = TensorBoard(args.tensorboard_dir, is_rank_0,
                                       args.tensorboard_queue_size)
        self.wandb = WandB(args, is_rank_0)

    @property
    def notices(self) -> List[str]:
        return [notice for notice in (self.tensorboard.notice, self.wandb.notice) if notice]

    def scalars(self, values: Dict[str, float], iteration: int,
                samples: Optional[int] = None, wandb: bool = True) -> None:
        self.tensorboard.scalars(values, iteration)
        if samples is not None:
            self.tensorboard.scalars({f"{name} vs samples": value
                                      for name, value in values.items()}, samples)
        if wandb:
            self.wandb.log(values, iteration)

    def close(self) -> None:
        self.tensorboard.close()
        self.wandb.close()
