"""tools/check_deepseek_v3.py without a launch: the runs each layout makes, how a run is judged,
and its refusals. The launches themselves are the tool's (docs/pretraining.md records a run);
tests/e2e/test_modern_models.py trains DeepSeek-like models with context parallelism."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch import REPO, load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("check_deepseek_v3")


def test_each_layout_fits_its_ranks_and_cp_gets_its_cp1_reference(tool):
    for (tp, cp, ep, etp, pp), ranks in tool.LAYOUTS.items():
        dp = ranks // (tp * cp * pp)
        assert tp * cp * pp * dp == ranks and (tp * cp * dp) % (ep * etp) == 0
    runs = tool.runs_of((1, 2, 2, 1, 1), ["alltoall", "parm_s2"])
    assert list(runs) == ["alltoall", "parm_s2", "alltoall cp=1"]
    assert runs["parm_s2"][runs["parm_s2"].index("--cp-comm-type") + 1] == "all_gather"
    flags = dict(zip(runs["alltoall cp=1"], runs["alltoall cp=1"][1:]))
    assert flags["--context-parallel-size"] == "1" and "--cp-comm-type" not in flags
    assert flags["--moe-token-dispatcher-type"] == "alltoall"
    pipelined = tool.runs_of((1, 1, 4, 1, 2), ["parm"])["parm"]
    assert pipelined[pipelined.index("--pipeline-model-parallel-layout") + 1] == "Et|ttmL"
    assert "--sequence-parallel" in tool.runs_of((2, 1, 2, 1, 1), ["parm"])["parm"]


def test_a_run_is_judged_against_alltoall_iteration_by_iteration(tool):
    losses = {"alltoall": [9.0, 8.5, 8.0], "parm": [9.0, 8.50005, 8.0],
              "parm_s2": [9.0, 8.6, 8.0], "short": [9.0, 8.5]}
    rows = {row["run"]: row for row in tool.rows_of((2, 1, 2, 1, 1), losses, 1e-4)}
    assert set(rows) == {"parm", "parm_s2", "short"}
    assert rows["parm"]["ok"] and rows["parm"]["worst_gap"] == pytest.approx(5e-5)
    assert not rows["parm_s2"]["ok"] and not rows["short"]["ok"]
    table = tool.table(list(rows.values()), 1e-4)
    assert "| (2,1,2,1,1) | parm_s2 | 3 | 9.000000 -> 8.000000 | 1.00e-01 | NO |" in table


@pytest.mark.parametrize("flags, message", [
    (["--layouts", "1,1,1,1,1"], "--layouts: 1,1,1,1,1 is not one of"),
    (["--dispatchers", "alltoall,nccl"], "--dispatchers: unknown dispatcher 'nccl'"),
])
def test_a_bad_flag_is_one_line_and_status_2(flags, message):
    proc = subprocess.run([sys.executable, "tools/check_deepseek_v3.py", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr
