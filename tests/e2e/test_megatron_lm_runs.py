"""Runs written as Megatron-LM's own MoE scripts are (configs/megatron_lm/: the flags its
functional tests and examples carry, in its names), launched as a user launches them: through
megatron_parm.launch, 4 gloo ranks (tp=2, ep=2), dispatcher parm.

  * gpt_moe.yaml: sample-based schedule with a warm-up fraction, the distributed optimizer
    with overlapped reduction and gather, deterministic mode, manual GC, Megatron-LM's logging
    flags, torch_dist checkpoints with its strictness and load flags, and flags that pick a
    fused CUDA kernel (no effect here);
  * bert_moe.yaml: per-token loss, torch-format checkpoints, level-1 timers.

Each must train (the loss falls), print its no-effect flags once in one line, log what its
flags ask for, and save in the format it names. tools/megatron_lm_configs.py runs Megatron-LM's
own configurations the same way (a checkout of Megatron-LM needed; docs/megatron_lm_configs.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from launch import free_port  # noqa: E402

SCRIPTS = {"gpt_moe": "pretrain_scripts/pretrain_gpt2_moe.py",
           "bert_moe": "pretrain_scripts/pretrain_bert_moe.py"}
ITERATION = re.compile(r"^ iteration +(\d+)/ *(\d+) \|.*\| lm loss: ([0-9.E+-]+) \|", re.M)


def launch(name: str, run: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)  # the output a user sees
    return subprocess.run(
        [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", "4", "--master-addr",
         "127.0.0.1", "--master-port", str(free_port()), SCRIPTS[name],
         "--config", f"configs/megatron_lm/{name}.yaml", "--save", str(run / "checkpoints"),
         "--load", str(run / "load"),  # a new folder, as Megatron-LM's functional tests pass
         "--tensorboard-dir", str(run / "tensorboard")],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared_data):
    """name -> (its run folder, its output)."""
    results = {}
    for name in SCRIPTS:
        run = tmp_path_factory.mktemp(name)
        proc = launch(name, run)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:]
        results[name] = (run, output)
    return results


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_megatron_lm_style_run_trains(runs, name):
    _, output = runs[name]
    lines = ITERATION.findall(output)
    assert lines and int(lines[-1][0]) == int(lines[-1][1]) == 12, output[-4000:]
    losses = [float(loss) for _, _, loss in lines]
    assert losses[-1] < losses[0], losses
    assert "Traceback" not in output, output[-4000:]


@pytest.mark.parametrize("name, expected", [
    ("gpt_moe", ("--use-mcore-models", "--no-gradient-accumulation-fusion",
                 "--no-bias-swiglu-fusion", "--no-rope-fusion", "--moe-permute-fusion")),
    ("bert_moe", ("--use-mcore-models", "--no-gradient-accumulation-fusion",
                  "--no-bias-gelu-fusion")),
])
def test_flags_without_effect_are_said_once(runs, name, expected):
    _, output = runs[name]
    notes = [line for line in output.splitlines() if "note: no effect here:" in line]
    assert len(notes) == 1, notes
    assert all(flag in notes[0] for flag in expected), notes[0]


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_load_folder_with_nothing_yet_starts_from_scratch_with_a_warning(runs, name):
    run, output = runs[name]
    warning = (f"warning: --load {run}/load: no such directory: starting from scratch, as "
               f"Megatron-LM does (--exit-on-missing-checkpoint stops instead)")
    assert output.count(warning) == 1, output[-4000:]
    assert not (run / "load").exists()  # nothing written there: it is not --save


def test_the_logging_flags_show_in_the_iteration_lines(runs):
    _, output = runs["gpt_moe"]
    line = next(line for line in output.splitlines() if line.startswith(" iteration "))
    for field in ("throughput per GPU (TFLOP/s/GPU):", "num zeros:", "params norm:"):
        assert field in line, line
    run, _ = runs["gpt_moe"]
    assert any((run / "tensorboard").iterdir())


def test_checkpoints_are_in_the_formats_the_configs_name(runs):
    gpt, _ = runs["gpt_moe"]
    assert (gpt / "checkpoints" / "iter_0000012" / "metadata.json").is_file()  # torch_dist
    bert, _ = runs["bert_moe"]
    saved = sorted(path.name for path in (bert / "checkpoints" / "iter_0000012").iterdir())
    assert any(name.startswith("mp_rank_") for name in saved), saved  # torch: per rank
