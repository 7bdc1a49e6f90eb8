"""A user's mistakes and stops on 4 gloo ranks: one line, printed once, nothing changed.

One torchrun launch of 4 ranks (this file run as a script) trains a tiny checkpoint, then runs
every bad input below through the pretraining script's entry point (cli.call, what cli.run does
before it exits), in the same 4 processes one after the other, each rank recording its exit
status and output; then resumes the checkpoint with a longer run under each scheduler flag.
The tests check, per bad input: status 2 on every rank, the message exactly once over all
ranks, no traceback, the files it could have touched unchanged (and a planted payload not run).

Separate launches check what a process sees end to end: megatron_parm.launch with 4 ranks for a
mistake found before any process group exists and one found after (exit status 2, one line,
no torchrun report; stdout and stderr in one stream, as in a Slurm log: the error is the last
line, below the start-up banner or alone; no torchrun banner about OMP_NUM_THREADS), a
conversion to an impossible layout, and SIGTERM during a run (the checkpoint published, exit
status 0, no process left, the ranks on one OpenMP thread each).

Every tool in tools/ gets one typical mistake (TOOL_MISTAKES, one subprocess each): exit
status 2, one line on stderr, no traceback; tools/preprocess_data.py also each of
HF_TOKENIZER_MISTAKES.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from launch import free_port, pids_with_marker, process_environ, torchrun  # noqa: E402

TINY = ["--config", "configs/gpt2_tiny_moe.yaml", "--tensor-model-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr-warmup-iters", "1", "--eval-iters", "0",
        "--log-interval", "1"]
DATA = "data/cache/gpt_text_document"


def bad_inputs(run: Path) -> dict:
    """name -> (flags added to TINY, a piece of the expected one-line message)."""
    ckpt = str(run / "ckpt")
    return {
        "unknown dispatcher": (["--moe-token-dispatcher-type", "foo"],
                               "error: argument --moe-token-dispatcher-type: invalid choice: 'foo'"),
        "chunks 0": (["--parm-num-chunks", "0"], "error: --parm-num-chunks must be an integer >= 1, got 0"),
        "tuning steps 0": (["--parm-tune-steps", "0"],
                           "error: --parm-tune-steps must be a positive integer, got 0"),
        "tuning margin negative": (["--parm-tune-margin", "-0.1"],
                                   "error: --parm-tune-margin must be a positive number, got -0.1"),
        "layout that does not divide": (
            ["--tensor-model-parallel-size", "3"],
            "error: --tensor-model-parallel-size (3) must divide the world size (4)"),
        "ds_baseline with ETP not dividing TP": (
            ["--moe-token-dispatcher-type", "ds_baseline", "--expert-model-parallel-size", "1",
             "--expert-tensor-parallel-size", "4"],
            "needs --expert-tensor-parallel-size (4) to divide --tensor-model-parallel-size (2)"),
        "missing data path": (["--data-path", str(run / "nowhere_text_document")],
                              "error: --data-path: no such indexed dataset"),
        "truncated .idx": (["--data-path", str(run / "short_idx")],
                           f"error: --data-path: {run}/short_idx.idx: "),
        "truncated .bin": (["--data-path", str(run / "short_bin")],
                           f"error: --data-path: {run}/short_bin.bin: "),
        # today's MoE architectures (layout_rules.architecture_problem, then Megatron-Core)
        "router groups that do not divide the experts": (
            ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
            "error: --moe-router-num-groups (3) must divide --num-experts (4) into equal groups"),
        "what Megatron-Core's TransformerConfig refuses": (
            ["--moe-pad-expert-input-to-capacity"],
            "error: Megatron-Core 0.16.1 refuses these flags: moe_expert_capacity_factor must be "
            "set to use moe_pad_expert_input_to_capacity"),
        # the combined 1F1B schedule's rules (layout_rules.moe_overlap_problem)
        "overlap in fp32": (["--overlap-moe-expert-parallel-comm"],
                            "error: --overlap-moe-expert-parallel-comm needs --bf16 or --fp16"),
        "overlap without expert parallelism": (
            ["--overlap-moe-expert-parallel-comm", "--bf16", "--expert-model-parallel-size", "1"],
            "error: --overlap-moe-expert-parallel-comm needs expert parallelism "
            "(--expert-model-parallel-size > 1)"),
        "overlap with pipelines but no virtual stages": (
            ["--overlap-moe-expert-parallel-comm", "--bf16", "--tensor-model-parallel-size", "1",
             "--pipeline-model-parallel-size", "2"],
            "with --pipeline-model-parallel-size 2 needs virtual pipeline stages"),
        "overlap with full recompute": (
            ["--overlap-moe-expert-parallel-comm", "--bf16", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "1"],
            "cannot run with --recompute-granularity full"),
        "overlap with shared-expert overlap": (
            ["--overlap-moe-expert-parallel-comm", "--bf16", "--moe-shared-expert-overlap",
             "--moe-shared-expert-intermediate-size", "64"],
            "error: --moe-shared-expert-overlap and --overlap-moe-expert-parallel-comm exclude "
            "each other"),
        "delayed weight gradients without the overlap": (
            ["--delay-wgrad-compute", "--bf16"],
            "error: --delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"),
        # Megatron-LM's data-parallel flags that cannot run here (training/ddp.py)
        "param gather without the distributed optimizer": (
            ["--overlap-grad-reduce", "--overlap-param-gather"],
            "error: --overlap-param-gather needs --use-distributed-optimizer"),
        "average in collective on gloo": (
            ["--ddp-average-in-collective"],
            "error: --ddp-average-in-collective needs NCCL: gloo (this machine has no GPU) has "
            "no ReduceOp.AVG"),
        "unknown YAML key": (["--config", str(run / "typo.yaml")],
                             "unknown keys num_layer (keys are flag names"),
        # an empty --load alone is a fresh start, as in Megatron-LM; a step of it is not there
        "--ckpt-step of an empty --load": (["--load", str(run / "empty"), "--ckpt-step", "5"],
                                           "(complete iterations in " + str(run / "empty")
                                           + ": none)"),
        "mismatched model shape": (["--load", ckpt, "--save", ckpt, "--hidden-size", "128"],
                                   "it was saved with --hidden-size 64, this run has 128"),
        "another schedule": (["--load", ckpt, "--save", ckpt, "--train-iters", "4"],
                             "give --override-opt_param-scheduler to use the command line's"),
        # otherwise a valid resume: without the safe read, Megatron-Core's loader runs it
        "malicious checkpoint object": (["--load", str(run / "evil"), "--train-iters", "2"],
                                        "refused: it holds a reference to posix.mkdir"),
    }


class Payload:
    """Unpickling this calls os.mkdir(path): the test checks the folder never appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def prepare_inputs(run: Path) -> None:
    """Damaged copies of the shipped dataset, a config with a typo, an empty folder."""
    shutil.copy(REPO / f"{DATA}.idx", run / "short_idx.idx")
    shutil.copy(REPO / f"{DATA}.bin", run / "short_idx.bin")
    os.truncate(run / "short_idx.idx", os.path.getsize(run / "short_idx.idx") - 24)
    shutil.copy(REPO / f"{DATA}.idx", run / "short_bin.idx")
    shutil.copy(REPO / f"{DATA}.bin", run / "short_bin.bin")
    os.truncate(run / "short_bin.bin", os.path.getsize(run / "short_bin.bin") // 2)
    config = (REPO / "configs/gpt2_tiny_moe.yaml").read_text()
    (run / "typo.yaml").write_text(config.replace("num_layers:", "num_layer:"))
    (run / "empty").mkdir()


def fingerprint(paths) -> str:
    """A hash of every file (name, size, content) under PATHS."""
    digest = hashlib.sha256()
    for root in paths:
        for path in sorted(Path(root).rglob("*")) if Path(root).is_dir() else [Path(root)]:
            if path.is_file():
                digest.update(str(path).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def learning_rates(stdout: str) -> dict:
    return {int(it): float(lr) for it, lr in
            re.findall(r"iteration +(\d+)/ +\d+ \|.*?learning rate: ([\d.E+-]+)", stdout)}


def worker(run_dir: str) -> None:
    """Every rank: the tiny checkpoint, each bad input, the resumes; rank r writes rank_r.json."""
    sys.path.insert(0, str(REPO / "pretrain_scripts"))
    import torch

    from megatron_parm import cli
    from megatron_parm.checkpointing.full import read_full, write_full
    from megatron_parm.training.trainer import initialize_distributed
    from pretrain_gpt2_moe import main

    initialize_distributed()
    rank = torch.distributed.get_rank()
    run = Path(run_dir)
    results = {"cases": {}, "resumes": {}}

    def call(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.call(main, TINY + argv)
        torch.distributed.barrier()
        return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}

    results["train"] = call(["--train-iters", "2", "--save", str(run / "ckpt")])
    if rank == 0:
        prepare_inputs(run)
        full = read_full(str(run / "ckpt/iter_0000002"))
        full.objects[sorted(full.objects)[0]] = Payload(run / "payload-ran")
        write_full(str(run / "evil"), 2, full)
    torch.distributed.barrier()
    watched = [run / name for name in ("ckpt", "evil", "short_idx.idx", "short_idx.bin",
                                       "short_bin.idx", "short_bin.bin", "typo.yaml", "empty")]
    results["before"] = fingerprint(watched)
    for name, (flags, _) in bad_inputs(run).items():
        results["cases"][name] = call(flags)
    results["after"] = fingerprint(watched)
    results["payload_ran"] = (run / "payload-ran").exists()

    # The same checkpoint resumed for 2 more iterations under each flag, and a fresh 4-iteration
    # run: --override takes its schedule, --use-checkpoint stays at the end of the saved one.
    for name, flags in (("override", ["--override-opt_param-scheduler"]),
                        ("use checkpoint", ["--use-checkpoint-opt_param-scheduler"])):
        shutil.copytree(run / "ckpt", run / f"ckpt-{name}", dirs_exist_ok=True) if rank == 0 else None
        torch.distributed.barrier()
        results["resumes"][name] = call(["--train-iters", "4", "--load", str(run / f"ckpt-{name}"),
                                         *flags])
    results["resumes"]["fresh"] = call(["--train-iters", "4"])
    (run / f"rank_{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, prepared_data):
    run = tmp_path_factory.mktemp("user_errors")
    torchrun(str(Path(__file__).relative_to(REPO)), 4, "worker", str(run), timeout=900)
    return run, [json.loads((run / f"rank_{r}.json").read_text()) for r in range(4)]


def test_training_step_ran(ranks):
    _, results = ranks
    assert [r["train"]["status"] for r in results] == [0, 0, 0, 0]
    assert "> saved checkpoint at iteration 2" in results[0]["train"]["stdout"]


@pytest.mark.parametrize("name", list(bad_inputs(Path("RUN"))))
def test_bad_input_is_one_line_printed_once(name, ranks):
    run, results = ranks
    expected = bad_inputs(run)[name][1]
    cases = [r["cases"][name] for r in results]
    assert [c["status"] for c in cases] == [2, 2, 2, 2], cases
    errors = [line for c in cases for line in (c["stdout"] + c["stderr"]).splitlines()
              if line.startswith("error:")]
    assert len(errors) == 1, errors
    everything = "".join(c["stdout"] + c["stderr"] for c in cases)
    assert everything.count(expected) == 1, (expected, everything[-3000:])
    assert "Traceback" not in everything, everything[-3000:]


def test_bad_inputs_change_nothing_and_run_no_payload(ranks):
    _, results = ranks
    assert results[0]["before"] == results[0]["after"]
    assert not any(r["payload_ran"] for r in results)


def test_resume_follows_the_flag_that_says_which_schedule(ranks):
    _, results = ranks
    resumes = results[0]["resumes"]
    assert all(r["resumes"][name]["status"] == 0 for r in results for name in resumes)
    override, kept, fresh = (learning_rates(resumes[name]["stdout"])
                             for name in ("override", "use checkpoint", "fresh"))
    assert sorted(override) == sorted(kept) == [3, 4] and sorted(fresh) == [1, 2, 3, 4]
    assert override == {3: fresh[3], 4: fresh[4]}  # the command line's 4-iteration schedule
    assert override[3] > 3.0e-4 and kept == {3: 3.0e-4, 4: 3.0e-4}  # the saved one had ended
    assert "learning-rate schedule: the command line's" in resumes["override"]["stdout"]


# ---------------------------------------------------------------------------------------------
# End to end: separate launches
# ---------------------------------------------------------------------------------------------

def _env(marker: str = "") -> dict:
    """A user's environment: no PYTHONWARNINGS, no OMP_NUM_THREADS (the launcher sets it)."""
    env = dict(os.environ, PARM_TEST_LAUNCH=marker)
    env.pop("PYTHONWARNINGS", None)
    env.pop("OMP_NUM_THREADS", None)
    return env


def launch(*args, timeout=300, marker: str = "") -> subprocess.CompletedProcess:
    """The launch's stdout and stderr in one stream, in the order written, as in a Slurm log."""
    return subprocess.run(
        [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", "4", "--master-addr",
         "127.0.0.1", "--master-port", str(free_port()), "pretrain_scripts/pretrain_gpt2_moe.py",
         *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout, env=_env(marker))


@pytest.mark.parametrize("flags,message", [
    (["--moe-token-dispatcher-type", "foo"],                   # before any process group
     "error: argument --moe-token-dispatcher-type: invalid choice: 'foo'"),
    (["--load", "/nonexistent/checkpoints", "--exit-on-missing-checkpoint"],  # after the
     "error: --exit-on-missing-checkpoint: --load /nonexistent/checkpoints holds no "  # process
     "checkpoint yet"),                                                         # groups exist
])
def test_launch_reports_a_mistake_once_with_status_2(flags, message, prepared_data):
    proc = launch(*TINY, *flags)
    output = proc.stdout
    assert proc.returncode == 2, output[-4000:]
    assert output.count(message) == 1, output[-4000:]
    lines = output.splitlines()
    assert len([line for line in lines if line.startswith("error:")]) == 1
    # The error is the last line: below the start-up banner when there is one (ranks that find
    # the mistake start checking after rank 0 printed it), alone when the flags never parsed.
    assert lines[-1].startswith(message), output[-4000:]
    banner = [line for line in lines if line.startswith("> ")]
    if "--load" in flags:
        assert banner and banner[0].startswith("> GPT MoE pretraining: 4 ranks "), output[-4000:]
    else:
        assert lines == [lines[-1]], output[-4000:]
    assert "OMP_NUM_THREADS" not in output, output[-4000:]  # torchrun's banner
    assert "Traceback" not in output and "usage:" not in output, output[-4000:]
    assert "ChildFailedError" not in output and "exitcode" not in output, output[-4000:]


def test_conversion_to_an_impossible_layout_is_one_line(tmp_path):
    import torch

    from megatron_parm.checkpointing.full import FullCheckpoint, write_full

    write_full(str(tmp_path / "ckpt"), 3, FullCheckpoint(
        {"decoder.final_layernorm.weight": torch.ones(4)}, {},
        {"iteration": 3, "args": {"num_experts": 4, "num_attention_heads": 4}}))
    proc = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "--load", str(tmp_path / "ckpt"),
         "--save", str(tmp_path / "out"), "--target-tensor-parallel-size", "2",
         "--target-expert-parallel-size", "3"], cwd=REPO, capture_output=True, text=True,
        timeout=300, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: target layout (6 ranks, --target-world-size): --num-experts (4) must be "
        "divisible by --target-expert-parallel-size (3)"], proc.stderr
    assert not (tmp_path / "out").exists()


def test_sigterm_saves_and_every_rank_exits_0(tmp_path, prepared_data):
    """SIGTERM to the launcher and every rank at once, as Slurm sends it at a time limit."""
    marker = uuid.uuid4().hex
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", "4",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "pretrain_scripts/pretrain_gpt2_moe.py", *TINY, "--train-iters", "1000",
             "--save", str(tmp_path / "ckpt"), "--exit-signal-handler",
             # a data-loader worker per rank: the job-wide SIGTERM reaches it too, and it must
             # leave the stop to its rank (Megatron-LM's worker_init_fn)
             "--num-workers", "1"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(marker))
        try:
            deadline = time.time() + 300
            while " iteration        2/" not in log_path.read_text():
                assert launcher.poll() is None and time.time() < deadline, log_path.read_text()
                time.sleep(0.2)
            stop = time.time()
            pids = pids_with_marker(f"PARM_TEST_LAUNCH={marker}")
            # torchrun's default for 4 ranks on a node, which the launcher sets in its place
            threads = [process_environ(pid).get("OMP_NUM_THREADS") for pid in pids
                       if "LOCAL_RANK" in process_environ(pid)]
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            status = launcher.wait(timeout=120)
            took = time.time() - stop
        finally:
            for pid in pids_with_marker(f"PARM_TEST_LAUNCH={marker}"):
                os.kill(pid, signal.SIGKILL)
            launcher.wait()
    output = log_path.read_text()
    stopped = int(re.search(r"> exit signal received \(SIGTERM\): stopping after iteration "
                            r"(\d+)", output).group(1))
    assert status == 0, output[-4000:]
    assert len(threads) >= 4 and set(threads) == {"1"}, threads  # the ranks (and their helpers)
    assert "OMP_NUM_THREADS" not in output, output[-4000:]
    assert took < 30, (took, output[-4000:])  # well inside torchrun's grace period
    assert (tmp_path / "ckpt/latest_checkpointed_iteration.txt").read_text() == str(stopped)
    assert (tmp_path / f"ckpt/iter_{stopped:07d}/metadata.json").is_file()
    assert f"> saved checkpoint at iteration {stopped}" in output
    assert "Traceback" not in output, output[-4000:]
    assert "launch: SIGTERM received: passed to 4 ranks as SIGTERM" in output
    assert pids_with_marker(f"PARM_TEST_LAUNCH={marker}") == []


# ---------------------------------------------------------------------------------------------
# Every tool: one typical mistake each
# ---------------------------------------------------------------------------------------------

MISSING = "/nonexistent/parm"
# tool -> (its arguments, environment added, a piece of its one line); {tmp} is a fresh folder
TOOL_MISTAKES = {
    "bench_moe_layer.py": (["--dispatchers", "parm_s3"], {}, "--dispatchers"),
    "bench_report.py": ([f"{MISSING}.jsonl"], {}, f"{MISSING}.jsonl"),
    "bench_e2e.py": (["--config", f"{MISSING}.yaml"], {},
                     f"--config: file not found: {MISSING}.yaml"),
    "calibrate.py": ([], {}, "launch with torchrun or give --parm-ranks-per-node"),
    "convert_checkpoint.py": (["--load", MISSING, "--to-single-file", "{tmp}/ckpt.pt"], {},
                              f"--load {MISSING}: no such directory"),
    "check_deepseek_v3.py": (["--dispatchers", "parm_s3"], {},
                             "--dispatchers: unknown dispatcher 'parm_s3'"),
    "count_ops.py": (["--dispatchers", "parm_s3"], {}, "--dispatchers"),
    "emulate_cluster.py": (["--nnodes", "0", "--", "true"], {}, "--nnodes"),
    "fault_loop.py": (["--faults", "crash"], {}, "--faults"),
    "flag_table.py": (["--check", "--chek"], {}, "unrecognized arguments: --chek"),
    "gpu_check.py": (["--out", "{tmp}", "--stages", "a,x"], {}, "--stages: unknown stage 'x'"),
    "gpu_check.sh": ([], {}, "OUT_DIR is required"),
    "inspect_checkpoint.py": ([MISSING], {}, f"{MISSING}: no such directory"),
    "megatron_lm_configs.py": (["--megatron-lm", MISSING, "--show"], {},
                               f"--megatron-lm: no test cases under {MISSING}"),
    "make_corpus.py": (["--output", "{tmp}/corpus.jsonl", "--max-bytes", "-5"], {},
                       "--max-bytes"),
    "plan_layout.py": (["--config", f"{MISSING}.yaml", "--nproc-per-node", "4",
                        "--parm-profile", "nvlink_ib_estimate"], {},
                       f"--config: file not found: {MISSING}.yaml"),
    "plan_schedule.py": (["--config", f"{MISSING}.yaml", "--parm-profile",
                          "nvlink_ib_estimate"], {}, f"--config: file not found: {MISSING}.yaml"),
    "predict_e2e.py": (["--nnodes", "0"], {}, "--nnodes must be positive integers"),
    "preprocess_data.py": (["--input", f"{MISSING}.jsonl", "--output-prefix", "{tmp}/data",
                            "--tokenizer-type", "GPT2BPETokenizer"], {}, "--input"),
    "recompute_memory.py": (["--config", f"{MISSING}.yaml"], {},
                            f"--config: file not found: {MISSING}.yaml"),
    "recompute_time.py": (["--warmup", "5", "--iterations", "3"], {},
                          "--warmup (5) must be below --iterations (3)"),
    "run_benchmark.sh": (["{tmp}"], {"GRID": f"{MISSING}.yaml"}, f"GRID={MISSING}.yaml"),
    "slurm/local_slurm.sh": (["begin"], {}, "unknown command 'begin'"),
    "tiny_hf_model.py": (["mixtral", "{tmp}/hf", "--max-shard-size", "5XB"], {},
                         "--max-shard-size: '5XB'"),
    # a corpus of one line holds fewer pieces than that
    "train_tokenizer.py": (["--input", "{tmp}/one.jsonl", "--vocab-size", "500",
                            "--output-prefix", "{tmp}/spm"], {}, "--vocab-size 500"),
    "validate_planner.py": (["--configs", f"{MISSING}.yaml"], {}, "--configs"),
}


def test_every_tool_has_a_mistake_below():
    tools = {str(path.relative_to(REPO / "tools")) for path in (REPO / "tools").rglob("*")
             if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts}
    assert tools == set(TOOL_MISTAKES)


# --tokenizer-type HuggingFaceTokenizer with a --tokenizer-model that is not a tokenizer
# directory: preprocess_data.py's arguments, a piece of its one line
HF_TOKENIZER_MISTAKES = {
    "missing directory": ([f"{MISSING}/hf"], f"--tokenizer-model: not a directory: {MISSING}/hf"),
    "no tokenizer.json": (["{tmp}"], "--tokenizer-model: no tokenizer.json in {tmp}"),
}


def assert_one_line_and_status_2(tool, args, env, piece, tmp_path):
    """TOOL run on ARGS ({tmp}: TMP_PATH, which holds one.jsonl) exits 2 with one line on
    stderr holding PIECE, and no traceback."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a tiny corpus"}) + "\n")
    command = ["bash"] if tool.endswith(".sh") else [sys.executable]
    proc = subprocess.run(
        command + [f"tools/{tool}"] + [arg.format(tmp=tmp_path) for arg in args], cwd=REPO,
        capture_output=True, text=True, timeout=300, env={**_env(), **env})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    piece = piece.format(tmp=tmp_path)
    assert len(lines) == 1 and "error: " in lines[0] and piece in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "usage:" not in proc.stdout


@pytest.mark.parametrize("tool", sorted(TOOL_MISTAKES))
def test_tool_answers_a_mistake_with_one_line_and_status_2(tool, tmp_path):
    args, env, piece = TOOL_MISTAKES[tool]
    assert_one_line_and_status_2(tool, args, env, piece, tmp_path)


@pytest.mark.parametrize("mistake", sorted(HF_TOKENIZER_MISTAKES))
def test_preprocess_names_a_bad_huggingface_tokenizer_directory(mistake, tmp_path):
    model, piece = HF_TOKENIZER_MISTAKES[mistake]
    args = ["--input", "{tmp}/one.jsonl", "--output-prefix", "{tmp}/data", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", *model]
    assert_one_line_and_status_2("preprocess_data.py", args, {}, piece, tmp_path)
    assert not list(tmp_path.glob("data*"))  # nothing written


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: torchrun --nproc-per-node 4 tests/e2e/test_user_errors.py worker RUN_DIR")
    worker(sys.argv[2])
