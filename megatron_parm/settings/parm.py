"""Parm's own flags (--parm-*): chunks, the automatic dispatcher's model and tuning, nodes."""

from __future__ import annotations

from typing import List

from megatron_parm import schedules, tuning
from megatron_parm.comm.accounting import check_ranks_per_node
from megatron_parm.settings.flag import Flag, positive_int

GROUP = "parm"


def _chunks(flag: str, value) -> None:
    schedules.check_num_chunks(value, flag)


def _ranks_per_node(flag: str, value) -> None:
    check_ranks_per_node(value)


def _chunks_help() -> str:
    return ("Forward pipeline chunks of the chunked schedules (1 = one chunk); default: "
            + ", ".join(f"{s.name} {s.default_chunks}" for s in map(schedules.get,
                                                                      schedules.names())
                        if s.chunked))


def _chunk_candidates_help() -> str:
    return ("comma-separated chunk counts to consider for the chunked schedules, forward and "
            "backward (every pair) (default: each one's own, "
            + "; ".join(f"{s.name} {','.join(map(str, s.chunk_candidates))}"
                        for s in schedules.candidates() if s.chunked) + ")")


def flags() -> List[Flag]:
    return [
        Flag("--parm-num-chunks", GROUP, int, help=_chunks_help, check=_chunks),
        Flag("--parm-bwd-num-chunks", GROUP, int, check=_chunks,
             help="Backward pipeline chunks of the chunked schedules; default: the forward "
                  "count (--parm-num-chunks, or the schedule's default)"),
        Flag("--parm-profile", GROUP, str,
             help="Performance-model profile for the automatic dispatcher: a YAML file, or the "
                  "name of a shipped one (e.g. nvlink_ib_estimate)."),
        Flag("--parm-chunk-candidates", GROUP, str, help=_chunk_candidates_help),
        Flag("--parm-ranks-per-node", GROUP, int, check=_ranks_per_node,
             help="Ranks per node, for parm_hier's node groups and the performance model; "
                  "default: LOCAL_WORLD_SIZE (set by torchrun)."),
        Flag("--parm-tune", GROUP, kind="toggle",
             help="parm: time the model's best candidates on the real layer in the first steps "
                  "and keep the fastest (--no-parm-tune: the model alone). Default: on without "
                  "--parm-profile, off with it."),
        Flag("--parm-tune-steps", GROUP, int, tuning.DEFAULT_STEPS, check=positive_int,
             help=f"Timed calls per candidate, after one warm-up call (default "
                  f"{tuning.DEFAULT_STEPS})."),
        Flag("--parm-tune-margin", GROUP, float, tuning.DEFAULT_MARGIN,
             help=f"Candidates predicted within (1 + margin) x the model's first are timed "
                  f"(default {tuning.DEFAULT_MARGIN})."),
        Flag("--parm-tune-candidates", GROUP, int, tuning.DEFAULT_MAX_CANDIDATES,
             check=positive_int, help=f"At most this many candidates are timed (default "
                                      f"{tuning.DEFAULT_MAX_CANDIDATES}): each distinct "
                                      f"schedule's best variant first, then other chunk "
                                      f"counts; and S1 besides them where they leave it out."),
        Flag("--parm-tune-cache", GROUP, str,
             help=f"JSON file of measured choices, read before tuning and written after "
                  f"(default: {tuning.CACHE_NAME} in --save; none without --save)."),
    ]
