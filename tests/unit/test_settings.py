"""The one settings layer: flags declared once, one reader of argv and config files, and the
suggestion for a misspelled flag (no process group, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_parm import cli, settings

REPO = Path(__file__).resolve().parents[2]


def training_parser():
    from megatron_parm.training.arguments import build_parser

    return build_parser()


def usage_error(parser, argv) -> str:
    with cli.argparse_errors_raise(), pytest.raises(cli.UsageError) as info:
        settings.read(parser, argv)
    return str(info.value)


def test_a_misspelled_flag_gets_the_closest_valid_one():
    message = usage_error(training_parser(), ["--hiden-size", "64"])
    assert message == ("unrecognized arguments: --hiden-size 64 (did you mean --hidden-size?)")
    message = usage_error(training_parser(), ["--num-expert=4", "--moe-router-top-k", "2"])
    assert "did you mean --num-experts for --num-expert?" in message
    assert "did you mean --moe-router-topk for --moe-router-top-k?" in message
    # nothing close: argparse's own words only
    assert usage_error(training_parser(), ["--zzzz"]) == "unrecognized arguments: --zzzz"


def test_unknown_flags_of_an_argv_before_any_rank_starts():
    parser = training_parser()
    assert settings.unknown_flags(["--hidden-size", "64", "--bf16", "--help"], parser) is None
    assert settings.unknown_flags(["--seq-lenght=128"], parser) == (
        "unrecognized arguments: --seq-lenght=128 (did you mean --seq-length?)")


def test_config_file_keys_are_checked_by_the_same_reader(tmp_path):
    parser = training_parser()
    config = tmp_path / "c.yaml"
    config.write_text("num_layer: 2\nhidden_size: 64\n")
    with pytest.raises(ValueError, match=r"unknown keys num_layer .*did you mean num_layer -> "
                                         r"num_layers\?"):
        settings.read(parser, ["--config", str(config)])
    config.write_text("sequence_parallel: yes please\n")
    with pytest.raises(ValueError, match="--sequence-parallel must be true or false"):
        settings.read(parser, ["--config", str(config)])
    config.write_text("moe_token_dispatcher_type: nope\n")
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type: invalid choice: 'nope'"):
        settings.read(parser, ["--config", str(config)])
    json_config = tmp_path / "c.json"
    json_config.write_text('{"hidden_size": 96, "num_layers": 3}')
    args = settings.read(training_parser(), ["--config", str(json_config), "--num-layers", "5"])
    assert (args.hidden_size, args.num_layers) == (96, 5)  # the command line over the file


def test_each_flag_runs_its_declared_check():
    with pytest.raises(ValueError, match="--train-iters must be a positive integer, got 0"):
        settings.read(training_parser(), ["--train-iters", "0"])
    with pytest.raises(ValueError, match="--parm-num-chunks must be an integer >= 1, got 0"):
        settings.read(training_parser(), ["--parm-num-chunks", "0"])
    with pytest.raises(ValueError, match="--eval-iters must be an integer >= 0, got -1"):
        settings.read(training_parser(), ["--eval-iters", "-1"])


def test_a_tool_takes_flags_by_name_with_its_own_defaults():
    parser = settings.Parser()
    settings.add_flags(parser, ["--seq-length", "--sequence-parallel"],
                       defaults={"seq_length": 256})
    args = settings.read(parser, [])
    assert (args.seq_length, args.sequence_parallel) == (256, False)
    assert settings.given(parser, ["--seq-length", "8"]) == {"seq_length"}
    assert {name for name in settings.FLAGS if settings.FLAGS[name].key == "seq_length"} == \
        {"--seq-length"}


def test_the_launcher_refuses_a_misspelled_flag_before_starting_ranks(capsys, monkeypatch,
                                                                      tmp_path):
    from megatron_parm import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("torchrun started ranks for a misspelled flag")

    monkeypatch.setattr("torch.distributed.run.main", no_ranks)
    status = launch.main(["--nproc-per-node", "4", "pretrain_scripts/pretrain_gpt2_moe.py",
                          "--config", "configs/gpt2_tiny_moe.yaml", "--moe-router-top-k", "2"])
    assert status == cli.USER_ERROR
    assert capsys.readouterr().err == ("error: unrecognized arguments: --moe-router-top-k 2 "
                                       "(did you mean --moe-router-topk?)\n")
    assert launch.script_flags_problem("pretrain_scripts/pretrain_bert_moe.py",
                                       ["--bert-no-binary-head", "--seq-length=64"]) is None
    assert launch.script_flags_problem("tools/other.py", ["--anything"]) is None
    typo = tmp_path / "typo.yaml"
    typo.write_text("num_layers: 2\nnum_layer: 1\n")
    assert "unknown keys num_layer" in launch.script_flags_problem(
        "pretrain_gpt2_moe.py", ["--config", str(typo)])


COMBINED_1F1B = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                 "--sequence-parallel", "--moe-token-dispatcher-type", "parm",
                 "--overlap-moe-expert-parallel-comm", "--bf16", "--recompute-granularity",
                 "selective", "--recompute-modules", "moe"]


@pytest.mark.parametrize("flags,message", [
    (["--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size (3) must divide the world size (4)"),
    (COMBINED_1F1B, "--overlap-moe-expert-parallel-comm cannot recompute the MoE layer"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
])
def test_the_launcher_checks_the_rules_between_flags_before_starting_ranks(
        flags, message, capsys, monkeypatch):
    """The rules of training.arguments.validate that need only the flags and the world size,
    in the launching process: one line, the one a rank would print, and no rank started."""
    from megatron_parm import launch
    from megatron_parm.training.arguments import parse_args

    def no_ranks(*args, **kwargs):
        raise AssertionError("torchrun started ranks for flags that cannot run")

    monkeypatch.setattr("torch.distributed.run.main", no_ranks)
    argv = ["--config", "configs/gpt2_tiny_moe.yaml", *flags]
    status = launch.main(["--nproc-per-node", "4", "pretrain_scripts/pretrain_gpt2_moe.py", *argv])
    assert status == cli.USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    with pytest.raises(ValueError) as rank_error:  # what each rank would say
        parse_args(argv, "gpt", world_size=4, reads_data=False)
    assert err == f"error: {rank_error.value}\n"
    # an elastic world (--nnodes MIN:MAX) has no size yet: the ranks check it
    assert launch.script_flags_problem("pretrain_gpt2_moe.py", argv, "1:2", 4) is None


def test_the_launchers_check_imports_no_megatron_core():
    """Importing Megatron-Core takes seconds (about 5 on 2 idle cores): the launcher's check of
    the flags (settings.read and training.arguments.validate without Megatron-Core's own
    checks) must not, to answer within seconds."""
    import subprocess
    import sys

    code = ("import sys; from megatron_parm import launch; "
            "problem = launch.script_flags_problem('pretrain_bert_moe.py', ['--config', "
            "'configs/bert_tiny_moe.yaml', '--tensor-model-parallel-size', '2', "
            "'--expert-model-parallel-size', '2', '--sequence-parallel'], '1', 4); "
            "assert problem is None, problem; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'megatron']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_settings_import_no_torch_or_yaml():
    """The launcher reads the flag table in its parent process, before torch starts ranks."""
    import subprocess
    import sys

    code = ("import sys, megatron_parm.settings; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'yaml')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# Flags that share a name with a declared one but mean something else in one place: (file,
# flag) -> why. plan_layout's --moe-token-dispatcher-type restricts its search to a list.
OTHER_MEANING = {("megatron_parm/planner_inputs.py", "--moe-token-dispatcher-type"):
                 "a comma-separated list of dispatchers to search"}
DECLARING = ["tools/plan_layout.py", "tools/plan_schedule.py", "tools/bench_moe_layer.py",
             "tools/calibrate.py", "tools/convert_checkpoint.py", "tools/count_ops.py"]


def test_training_and_the_tools_take_their_flags_from_settings():
    import ast
    from pathlib import Path

    from megatron_parm.settings.registry import DECLARATIONS

    repo = Path(__file__).resolve().parents[2]
    declared = {flag.name for flag in DECLARATIONS}
    paths = DECLARING + [str(p.relative_to(repo)) for p in (repo / "megatron_parm").rglob("*.py")
                         if "settings" not in p.relative_to(repo).parts]
    redeclared = []
    for path in paths:
        for node in ast.walk(ast.parse((repo / path).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                redeclared += [(path, name) for name in names
                               if name in declared and (path, name) not in OTHER_MEANING]
    assert not redeclared


def test_no_tool_imports_another_tool():
    import ast
    from pathlib import Path

    tools = Path(__file__).resolve().parents[2] / "tools"
    names = {path.stem for path in tools.glob("*.py")}
    imports = []
    for path in tools.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imports += [(path.name, a.name) for a in node.names if a.name in names]
            elif isinstance(node, ast.ImportFrom) and node.module in names:
                imports.append((path.name, node.module))
    assert not imports
