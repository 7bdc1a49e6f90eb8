"""One prepared check of megatron-parm on a machine with one NVIDIA GPU.

    tools/gpu_check.sh OUT_DIR            the wrapper: installs $WHEELS, then runs this
    python tools/gpu_check.py --out OUT_DIR [--stages a,b,c,d] [--allow-cpu] [--quick]

Stages, each in processes of its own; each writes OUT_DIR/<stage>.json, and OUT_DIR/summary.json
collects them, rewritten after every stage (a run cut short keeps what finished). Console
output of every stage goes to OUT_DIR/gpu_check.log.
  a  dispatcher equivalence: tests/distributed/test_dispatchers.py -k w4, 4 ranks sharing the
     GPU over gloo (every dispatcher vs Megatron's alltoall and the plain reference, output and
     all gradients, same tolerances as on CPU; also GroupedMLP, placement and sync checks)
  b  one rank on NCCL: the tiny GPT-2 MoE in --bf16 with dispatcher parm for 30 iterations
     (loss falls), its checkpoint saved, evaluated after loading (same loss) and resumed for 5
     more iterations; then --fp16 with dynamic loss scaling for 12 iterations
  c  one MoE layer at GPT-2-small-MoE shapes (hidden 768, FFN 3072, 8 experts, top-2, sequence
     1024, micro-batch 8, bf16), world size 1, every dispatcher: forward+backward medians
     (CUDA events, the device seam's timer) and ratios to alltoall, peak memory
  d  host synchronisations per layer call of each dispatcher (forward and backward), counted
     with torch.cuda.set_sync_debug_mode("warn") through the device seam, with call sites
  e  what a chunk costs: parm_s2 at 1, 2, 4 and 8 chunks (and 4 forward / 1 backward) beside
     alltoall and parm_s1 at stage c's shapes, world size 1, where nothing is to overlap (and
     with 4 and 2 experts, the local experts of a rank at EP 2 and 4); and
     one profiled step of parm_s2@4 and of alltoall (top operators, kernel launches) in
     OUT_DIR/e_profile.txt
  f  expert implementations: stage c's layer and a larger one (hidden 2048, FFN 8192,
     8 experts, top-2, 8192 tokens, bf16), world size 1; alltoall, parm_s1 and parm_s2 at 1, 2,
     4, 8 chunks, each with SequentialMLP and TorchGroupedMLP experts (and GroupedMLP /
     TEGroupedMLP where grouped_gemm / Transformer Engine are installed), interleaved with the
     same weights: medians, each extra chunk's cost in ms and % of the one-chunk step, kernel
     launches of one forward+backward each, grouped over SequentialMLP times; the
     targets (EXPERT_TARGETS) reported as met or missed, which does not fail the stage;
     profiles of parm_s2@4 per layer and experts in OUT_DIR/f_profile.txt
  g  calibration on this one GPU: tools/calibrate.py at world size 1 with the
     collective terms of the shipped estimate (--base-profile nvlink_ib_estimate); fp32
     layers at stage c's sizes, 4 and 8 experts, SequentialMLP and TorchGroupedMLP: compute, the chunk
     cost (chunk_overhead, chunk_expert_overhead) and the framework terms fitted by
     themselves; the profile in OUT_DIR/g_profile.yaml, its fit error in g.json
  h  today's MoE models on one rank in bf16 with parm: the Qwen3-like and DeepSeek-V2-Lite-like
     tiny configs, the latter also with DeepSeek-V3's router (sigmoid, expert bias, groups) and
     with --moe-shared-expert-overlap (its shared experts in a CUDA stream of their own);
     the losses fall and the overlap keeps them (2e-2 in bf16)
  i  Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm) on 2 ranks sharing the
     GPU over gloo (EP 2), bf16, 2 micro-batches: parm, parm_s1, and parm_s1 with
     --delay-wgrad-compute and grouped experts, each with and without the flag; the losses
     agree (2e-2 in bf16)

--allow-cpu runs everything on CPU (gloo), as the tests do for a dry run; there stage d counts
nothing (nothing synchronises without CUDA) and says so. --quick shrinks shapes and iteration
counts for such dry runs. The stages keep within --budget seconds (default 440).
Exit status: 0 when every stage asked for passed, 1 otherwise, 2 for bad arguments or no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_parm import cli  # noqa: E402  (a mistake: one line, exit status 2)

STAGES = ("a", "b", "c", "d", "e", "f", "g", "h", "i")
# Seconds a stage may take at most on a GPU machine (the --budget left can cut it shorter);
# CPU dry runs get CPU_SLOWDOWN times as long.
STAGE_TIMEOUT = {"a": 240, "b": 150, "c": 120, "d": 60, "e": 90, "f": 150, "g": 150, "h": 120,
                 "i": 120}
CPU_SLOWDOWN = 4
TRAIN_ITERS = 30
RESUME_ITERS = 5
FP16_ITERS = 12


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, help="folder for the log and the JSON summary")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, from {', '.join(STAGES)} "
                             f"(default: all)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on CPU when there is no GPU (a dry run of every stage)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and few iterations (dry runs)")
    parser.add_argument("--budget", type=float, default=440.0,
                        help="seconds for the stages (default 440: with setup, under 8 minutes)")
    parser.add_argument("--pytest-args", default=None,
                        help="stage a: pytest arguments instead of the equivalence tests "
                             "(for dry runs of the stage itself)")
    from megatron_parm.bench.gpu_check import WORKERS  # torch-free until a worker runs

    parser.add_argument("--worker", choices=tuple(WORKERS), default=None,
                        help=argparse.SUPPRESS)  # the processes stages b-d start
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        parser.error(f"--stages: unknown stage {unknown[0]!r}" if unknown else
                     "--stages: no stage given")
    args.stages = stages
    if args.budget < 60:
        parser.error(f"--budget must be at least 60 seconds, got {args.budget}")
    return args


# ---------------------------------------------------------------------------------------------
# the parent: stages, summary, log
# ---------------------------------------------------------------------------------------------


def environment() -> dict:
    import torch

    from megatron_parm import device

    try:
        from megatron.core import package_info

        megatron_version = package_info.__version__
    except ImportError as err:
        megatron_version = f"not importable ({err})"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": socket.gethostname(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": device.device_name(), "device_count": device.device_count(),
            "megatron_core": megatron_version, "cpus": os.cpu_count()}


class Check:
    """The parent process: runs the stages and keeps the summary on disk."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.log_path = self.out / "gpu_check.log"
        self.deadline = time.time() + args.budget
        self.cuda = device_is_cuda()
        self.summary = {"environment": environment(), "options": {
            "stages": args.stages, "allow_cpu": args.allow_cpu, "quick": args.quick,
            "budget_s": args.budget}, "stages": {}}

    def write(self) -> None:
        staged = self.out / "summary.json.tmp"
        staged.write_text(json.dumps(self.summary, indent=2))
        os.replace(staged, self.out / "summary.json")

    def say(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log_path, "a") as log:
            log.write(line + "\n")

    def run(self, cmd, timeout: float) -> int:
        """Run cmd from the repository root, output appended to the log; its exit status,
        or 124 when it ran past timeout (then its whole process group is ended)."""
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        with open(self.log_path, "a") as log:
            log.write(f"$ {shlex.join(str(c) for c in cmd)}\n")
            log.flush()
            proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the stage's own process group
                proc.wait()
                return 124

    def torchrun(self, worker: str, timeout: float, nproc: int = 1) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "tools/gpu_check.py", "--worker", worker, "--out", self.out]
        return self.run(cmd + (["--quick"] if self.args.quick else []), timeout)

    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        env = self.summary["environment"]
        self.say(f"gpu_check: {env['date']}, {env['device']} (CUDA {env['cuda']}), torch "
                 f"{env['torch']}, Python {env['python']}, megatron-core {env['megatron_core']}; "
                 f"stages {','.join(self.args.stages)}; budget {self.args.budget:.0f} s")
        self.write()
        for stage in self.args.stages:
            left = self.deadline - time.time()
            if left < 20:
                result = {"status": "skipped", "reason": "the time budget is spent"}
            else:
                start = time.time()
                limit = STAGE_TIMEOUT[stage] * (1 if self.cuda else CPU_SLOWDOWN)
                try:
                    result = STAGE_RUNNERS[stage](self, min(limit, left))
                except Exception as err:  # a broken stage must not lose the others' results
                    result = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
                result["seconds"] = round(time.time() - start, 1)
            self.summary["stages"][stage] = result
            self.write()
            self.say(f"stage {stage}: {result['status']}"
                     + (f" ({result['reason']})" if result.get("reason") else "")
                     + (f" in {result['seconds']} s" if "seconds" in result else ""))
        passed = all(r["status"] == "passed" for r in self.summary["stages"].values())
        self.say(f"gpu_check: {'all stages passed' if passed else 'NOT all stages passed'}; "
                 f"summary {self.out / 'summary.json'}, log {self.log_path}")
        return 0 if passed else 1

    # -- stages ------------------------------------------------------------------------------

    def stage_a(self, timeout: float) -> dict:
        junit = self.out / "a_junit.xml"
        target = (shlex.split(self.args.pytest_args) if self.args.pytest_args else
                  ["tests/distributed/test_dispatchers.py", "-k", "w4"])
        status = self.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *target], timeout)
        result = {"command": "pytest " + shlex.join(target), "exit_status": status}
        if status == 124:
            return dict(result, status="failed", reason=f"timed out after {timeout:.0f} s")
        if not junit.is_file():
            return dict(result, status="error", reason="pytest wrote no report")
        counts, failed = junit_counts(junit)
        result.update(counts, failed_tests=failed[:30])
        ok = status == 0 and counts["tests"] > 0 and not failed
        return dict(result, status="passed" if ok else "failed",
                    reason=None if ok else f"{len(failed)} of {counts['tests']} tests failed")

    def _worker_stage(self, worker: str, stage: str, timeout: float, nproc: int = 1) -> dict:
        report = self.out / f"{stage}.json"
        report.unlink(missing_ok=True)
        status = self.torchrun(worker, timeout, nproc)
        if status == 124:
            return {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
        if not report.is_file():
            return {"status": "error", "reason": f"exit status {status}, no {report.name} "
                                                 f"(see the log)"}
        result = json.loads(report.read_text())
        if status != 0 and result.get("status") == "passed":
            result.update(status="error", reason=f"exit status {status}")
        return result

    def stage_b(self, timeout: float) -> dict:
        prepare_data()
        return self._worker_stage("train", "b", timeout)

    def stage_c(self, timeout: float) -> dict:
        return self._worker_stage("layer", "c", timeout)

    def stage_d(self, timeout: float) -> dict:
        return self._worker_stage("syncs", "d", timeout)

    def stage_e(self, timeout: float) -> dict:
        return self._worker_stage("chunks", "e", timeout)

    def stage_f(self, timeout: float) -> dict:
        return self._worker_stage("experts", "f", timeout)

    def stage_h(self, timeout: float) -> dict:
        prepare_data()
        return self._worker_stage("modern", "h", timeout)

    def stage_i(self, timeout: float) -> dict:
        prepare_data()
        return self._worker_stage("overlap", "i", timeout, nproc=2)

    def stage_g(self, timeout: float) -> dict:
        profile = self.out / "g_profile.yaml"
        profile.unlink(missing_ok=True)
        log = self.out / "g_calibrate.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "tools/calibrate.py", "--base-profile", CALIBRATION_BASE, "--output", str(profile),
               "--note", "tools/gpu_check.py stage g, one GPU",
               *(CALIBRATION_QUICK if self.args.quick else CALIBRATION_FLAGS)]
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        status = self.run(cmd, timeout)
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            handle.seek(start)
            output = handle.read()
        log.write_text(output)
        if status != 0 or not profile.is_file():
            return {"status": "failed", "reason": f"tools/calibrate.py exit status {status} "
                                                  f"(see {log.name})"}
        return calibration_result(profile, output)


STAGE_RUNNERS = {"a": Check.stage_a, "b": Check.stage_b, "c": Check.stage_c, "d": Check.stage_d,
                 "e": Check.stage_e, "f": Check.stage_f, "g": Check.stage_g, "h": Check.stage_h,
                 "i": Check.stage_i}

# Stage g's calibration flags (--quick: the dry run's small shapes)
CALIBRATION_BASE = "nvlink_ib_estimate"
CALIBRATION_FLAGS = ["--compute-rows", "256..8192", "--layer-tokens", "2048,8192",
                     "--layer-hidden-size", "768", "--layer-ffn-hidden-size", "3072",
                     "--layer-num-experts", "4,8", "--layer-expert-impls",
                     "SequentialMLP,TorchGroupedMLP", "--reps", "10"]
CALIBRATION_QUICK = ["--compute-rows", "16,64", "--layer-tokens", "16", "--layer-hidden-size",
                     "32", "--layer-ffn-hidden-size", "64", "--layer-num-experts", "2,4",
                     "--layer-expert-impls", "SequentialMLP,TorchGroupedMLP", "--reps", "3",
                     "--warmup", "1"]


def calibration_result(profile_path: Path, output: str) -> dict:
    """Stage g's summary: the fitted terms (loaded back with every term required) and the
    layer fit's error line from the calibration's output."""
    from megatron_parm.perf_model.profile import TERMS, load_profile

    profile = load_profile(str(profile_path), require_terms=True)
    fit = next((line.strip() for line in output.splitlines() if "layer fit: |error|" in line),
               None)
    return {"status": "passed", "reason": None, "profile": profile_path.name,
            "provenance": profile.provenance,
            "terms": {term: getattr(profile, term) for term in TERMS},
            "compute": {"alpha": profile.compute_alpha, "beta": profile.compute_beta},
            "layer_fit": fit, "log": "g_calibrate.log"}


def device_is_cuda() -> bool:
    from megatron_parm import device

    return device.is_cuda()


def junit_counts(path: Path):
    """({'tests', 'failures', 'errors', 'skipped'}, [failed test ids]) of a pytest JUnit report."""
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return counts, failed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_data() -> None:
    """The shipped corpus as indexed datasets (stage b trains on it), built if missing."""
    if not (REPO / "data/cache/gpt_text_document.idx").is_file():
        subprocess.run(["bash", str(REPO / "pretrain_scripts/prepare_data.sh")], cwd=REPO,
                       check=True, env=dict(os.environ, PYTHON=sys.executable))


def run_worker(args) -> int:
    import torch.distributed as dist

    from megatron_parm.bench.gpu_check import WORKERS

    stage, work = WORKERS[args.worker]
    out = Path(args.out)
    try:
        result = work(out, args.quick)
    except Exception as err:
        result = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
        import traceback

        traceback.print_exc()
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / f"{stage}.json").write_text(json.dumps(result, indent=2, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result.get("status") == "passed" else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if not device_is_cuda() and not args.allow_cpu:
        raise ValueError("no CUDA device here: this check is for a machine with an NVIDIA GPU "
                         "(--allow-cpu runs its stages on CPU as a dry run)")
    return Check(args).main()


if __name__ == "__main__":
    cli.run(main)
