"""The run-control flags: what a run checks while it trains (NaN and spiky losses, large
gradients, Megatron-Core's rerun engine, the parameters' hashes across data-parallel replicas,
Megatron-Core's real-time tests), how it collects garbage, whether it runs deterministically,
and which iterations it skips. Their effects: megatron_parm/training/run_control.py."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int, positive_int

GROUP = "run control"
RERUN_MODES = ("disabled", "validate_results")
REPORT_STATS = ("Megatron-LM core_v0.16.1 cannot run it either: it is no mode of Megatron-Core "
                "0.16.1's rerun engine (report_determinism_stats there), whose report of the "
                "statistics fails (its Caller has no filename)")


def non_negative_ints(flag: str, values) -> None:
    for value in values:
        non_negative_int(flag, value)


def flags() -> List[Flag]:
    return [
        Flag("--manual-gc", GROUP,
             help="Turn Python's automatic garbage collection off for the training loop and "
                  "collect at set points on every rank together: at the start, around each "
                  "evaluation (see --no-manual-gc-eval) and every --manual-gc-interval "
                  "iterations."),
        Flag("--manual-gc-interval", GROUP, check=non_negative_int,
             help="With --manual-gc: collect every this many iterations (0: never between "
                  "iterations)."),
        Flag("--no-manual-gc-eval", GROUP,
             help="With --manual-gc: no collection before and after each evaluation."),
        Flag("--no-check-for-nan-in-loss-and-grad", GROUP,
             help="Do not stop on a NaN or infinite loss or gradient (by default each rank's "
                  "loss and each gradient bucket are checked, through Megatron-Core's rerun "
                  "engine: --rerun-mode); the log's 'number of nan iterations' counts them."),
        Flag("--check-for-spiky-loss", GROUP,
             help="Flag a loss 10x above the largest of the first 100 (not fatal: with "
                  "--rerun-mode validate_results the iteration is run again, then the run goes "
                  "on)."),
        Flag("--check-for-large-grads", GROUP,
             help="Flag a gradient bucket whose norm is 10x the largest of its first 100 (not "
                  "fatal, as --check-for-spiky-loss)."),
        Flag("--rerun-mode", GROUP, supported=RERUN_MODES, unsupported=REPORT_STATS,
             help="What Megatron-Core's rerun engine does with a rejected result: "
                  "'validate_results' runs the iteration again on the same ranks and stops "
                  "(saving, with --save) with exit status 16 when the rerun reproduces it, 17 "
                  "when it does not (the second rerun, from the checkpoint on another GPU, is "
                  "not built here); 'disabled' stops at once."),
        Flag("--error-injection-rate", GROUP, check=non_negative_int,
             help="Inject a rejected result into about one in this many checks (0: never), to "
                  "exercise --rerun-mode validate_results."),
        Flag("--error-injection-type", GROUP,
             help="What an injected error looks like on the rerun: 'transient_error' does not "
                  "reproduce; 'correct_result' and 'persistent_error' do."),
        Flag("--result-rejected-tracker-filename", GROUP,
             help="Append every rejected result to this file (Megatron-LM's lines), and skip "
                  "the iterations it shows rejected twice on the same rank "
                  "(--iterations-to-skip)."),
        Flag("--iterations-to-skip", GROUP, check=non_negative_ints,
             help="Skip the step after each of these iterations (Megatron-LM's numbering: 5 "
                  "skips the step logged as iteration 6): its batches are drawn and dropped, "
                  "nothing is learnt from them."),
        Flag("--deterministic-mode", GROUP,
             help="torch.use_deterministic_algorithms(True) and Megatron-Core's deterministic "
                  "kernels: two runs with the same flags give bitwise the same losses. On a GPU "
                  "it needs CUBLAS_WORKSPACE_CONFIG (:4096:8) and, with NCCL, NCCL_ALGO "
                  "(Megatron-LM's rule) in the environment."),
        Flag("--check-weight-hash-across-dp-replicas-interval", GROUP, check=positive_int,
             help="Every this many iterations (and at the start), compare the SHA-1 hashes of "
                  "every parameter across its data-parallel replicas; a difference stops the "
                  "run, naming the parameters."),
        Flag("--test-mode", GROUP,
             help="Megatron-Core's real-time tests: with --qk-layernorm, each attention "
                  "forward checks that the query and key layer norms are equal on every "
                  "data-parallel rank."),
    ]
