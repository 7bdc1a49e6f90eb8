"""The logging and validation flags: what is printed and written, and how often."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int, positive_int

GROUP = "logging"


def flags() -> List[Flag]:
    return [
        Flag("--eval-interval", GROUP, check=positive_int,
             help="Evaluate every this many iterations (default: only at the end)."),
        Flag("--eval-iters", GROUP, check=non_negative_int),
        Flag("--log-interval", GROUP, check=positive_int),
        Flag("--tensorboard-dir", GROUP),
        Flag("--parm-timing-breakdown", GROUP, kind="switch",
             help="Time each step's parts (MoE dispatch, experts, combine; attention and dense "
                  "MLP; TP/SP collectives; DP gradient reduction; optimizer; rest) and print "
                  "their means per logged iteration, with the share of the host's cores busy "
                  "(synchronises the device at every boundary; "
                  "megatron_parm/training/timing.py)."),
        Flag("--parm-timing-file", GROUP, str,
             help="Also append the breakdown as JSON lines to this file (rank 0); implies "
                  "--parm-timing-breakdown."),
    ]
