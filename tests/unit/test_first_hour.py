"""A user's first hour, in one process: one clean line per mistake, safe loading, corrupt data
named, the resumed schedule checked, declarative benchmark grids, checksums that diff.

The 4-rank launches (each mistake printed once under torchrun, SIGTERM) are in
tests/e2e/test_user_errors.py; the documented commands in tests/e2e/test_docs.py.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launch import load_tool  # noqa: E402
from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402
from megatron_parm.checkpointing import CheckpointError, read_checkpoint_info  # noqa: E402
from megatron_parm.checkpointing.full import (  # noqa: E402
    FullCheckpoint,
    load_single_file,
    read_full,
    save_single_file,
    write_full,
)
from megatron_parm.checkpointing.paths import resolve_load  # noqa: E402
from megatron_parm.checkpointing.safe_load import load_torch_file, read_sharded_objects  # noqa: E402
from megatron_parm.checkpointing.verify import read_metadata, tensor_checksums  # noqa: E402


# ---------------------------------------------------------------------------------------------
# One clean line per mistake (cli.call is what cli.run does before it exits)
# ---------------------------------------------------------------------------------------------

def _parser_main(argv):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--kind", choices=("a", "b"), default="a")
    parser.add_argument("--count", type=int, default=1)
    args = parser.parse_args(argv)
    if args.count < 1:
        raise ValueError(f"--count must be >= 1, got {args.count}")
    if args.count == 7:
        first, second = [args.count]  # a bug: Python's own ValueError, not a user's mistake
    if args.count == 8:
        raise RuntimeError("a bug")
    if args.count == 9:
        sys.exit("tool: refused")
    return 0


@pytest.mark.parametrize("argv,status,line", [
    (["--kind", "c"], 2, "error: argument --kind: invalid choice: 'c' (choose from 'a', 'b')"),
    (["--count", "x"], 2, "error: argument --count: invalid int value: 'x'"),
    (["--no-such-flag"], 2, "error: unrecognized arguments: --no-such-flag"),
    (["--count", "0"], 2, "error: --count must be >= 1, got 0"),
    (["--count", "9"], 2, "error: tool: refused"),
    (["--count", "2"], 0, None),
])
def test_user_mistake_is_one_line_with_status_2(argv, status, line, capsys):
    assert cli.call(_parser_main, argv) == status
    captured = capsys.readouterr()
    if line is None:
        assert captured.err == ""
    else:
        assert captured.err.splitlines() == [line]
        assert "usage:" not in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("count,last_line", [(7, "ValueError: not enough values to unpack"),
                                             (8, "RuntimeError: a bug")])
def test_bugs_keep_their_traceback(count, last_line, capsys):
    assert cli.call(_parser_main, ["--count", str(count)]) == cli.BUG
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.strip().splitlines()[-1].startswith(last_line)


def test_help_still_exits_0(capsys):
    assert cli.call(_parser_main, ["--help"]) == 0
    assert "usage: tool" in capsys.readouterr().out


def test_library_value_errors_are_bugs():
    try:
        numpy.frombuffer(b"abc", dtype=numpy.int64)
    except ValueError as err:
        assert not cli.is_user_error(err)
    try:
        raise CheckpointError("ours")
    except ValueError as err:
        assert cli.is_user_error(err)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**run_env, **env}, timeout=120)


# Warnings as Megatron-Core and torch raise them (the message, from the module), and others.
FROM_MEGATRON = (
    "import warnings; "
    "warnings.warn_explicit('Apex is not installed. Falling back to Torch Norm', UserWarning, "
    "'backends.py', 21, module='megatron.core.models.backends'); "
    "warnings.warn_explicit('Transformer Engine and Apex are not installed. Falling back to "
    "Torch optimizers.', UserWarning, '__init__.py', 24, module='megatron.core.optimizer'); "
    "warnings.warn_explicit('The .grad attribute of a Tensor that is not a leaf Tensor is being "
    "accessed.', UserWarning, 'optimizer.py', 66, module='megatron.core.optimizer.optimizer'); "
    "warnings.warn_explicit('moe_ffn_hidden_size is not set, using ffn_hidden_size instead.', "
    "UserWarning, 'transformer_config.py', 1056, "
    "module='megatron.core.transformer.transformer_config'); "
    "warnings.warn('The .grad attribute of a Tensor that is not a leaf Tensor is being accessed "
    "(yours)'); ")
WARN = ("from megatron_parm import cli; cli.setup_warnings(); " + FROM_MEGATRON +
        "warnings.warn('something\\n  worth   knowing'); "
        "warnings.warn('something\\n  worth   knowing')")


def test_warnings_once_on_rank_0_in_one_line():
    """Hidden where they arise: the same message from another module (the user's) is shown."""
    rank0 = _python(WARN, RANK="0")
    assert rank0.stderr.splitlines() == [
        "warning: The .grad attribute of a Tensor that is not a leaf Tensor is being accessed "
        "(yours) [UserWarning, <string>:1]",
        "warning: something worth knowing [UserWarning, <string>:1]"], rank0.stderr
    assert _python(WARN, RANK="3").stderr == ""
    note = cli.optional_packages_note()
    assert note is None or note.startswith("optional packages not installed: ")


def test_library_users_opt_in_to_hiding_megatron_cores_own_warnings():
    """megatron_parm.hide_library_warnings(): Megatron-Core's and torch's warnings about their
    own internals hidden where they arise, what a library user can act on kept (the MoE FFN
    size is theirs to give), the missing packages said once on rank 0; importing megatron_parm
    alone changes no filter."""
    code = ("import warnings; before = list(warnings.filters); import megatron_parm; "
            "assert warnings.filters == before; megatron_parm.hide_library_warnings(); "
            + FROM_MEGATRON)
    shown = [line for line in _python(code, RANK="0").stderr.splitlines()
             if "Warning: " in line]
    note = cli.optional_packages_note()
    assert [line.split("Warning: ", 1)[1] for line in shown] == (
        [note] if note else []) + [
        "moe_ffn_hidden_size is not set, using ffn_hidden_size instead.",
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed (yours)"]
    assert not [line for line in _python(code, RANK="1").stderr.splitlines()
                if "optional packages" in line]


@pytest.mark.parametrize("target", ["demo", "layer-demo"])
def test_the_makefiles_multi_rank_targets_take_a_master_port(target, tmp_path):
    """A second job on the machine must not collide with the first: MASTER_PORT given, the
    launch uses it; not given, torchrun's --standalone picks a free port (make -n: the
    commands, not run; run_local.sh's rendezvous lines are run alone)."""
    def commands(*variables):
        proc = subprocess.run(["make", "-n", "--always-make", target, *variables], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    if target == "layer-demo":
        assert "--master-port 29613" in commands("MASTER_PORT=29613")
        assert "--standalone" in commands() and "--master-port" not in commands()
        return
    assert "MASTER_PORT=29613 pretrain_scripts/run_local.sh" in commands("MASTER_PORT=29613")
    script = (REPO / "pretrain_scripts/run_local.sh").read_text()
    rendezvous = script[script.index("RENDEZVOUS=(--standalone)"):script.index("# tee ignores")]
    for port, expected in (("29613", "--master-addr 127.0.0.1 --master-port 29613"),
                           ("", "--standalone")):
        shown = subprocess.run(["bash", "-c", f'MASTER_PORT={port}\n{rendezvous}'
                                f'echo "${{RENDEZVOUS[@]}}"'], capture_output=True, text=True)
        assert shown.stdout.strip() == expected, (port, shown.stdout, shown.stderr)


def test_counts_say_1_rank_not_1_ranks():
    assert [plural(n, "rank") for n in (0, 1, 4)] == ["0 ranks", "1 rank", "4 ranks"]
    assert [plural(n, "micro-batch") for n in (1, 2)] == ["1 micro-batch", "2 micro-batches"]
    assert plural(3, "process") == "3 processes" and plural(2, "index", "indices") == "2 indices"


# ---------------------------------------------------------------------------------------------
# Corrupt data named
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for length in (5, 7, 3):
        builder.add_document(numpy.arange(length), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def test_whole_dataset_passes_and_damage_is_named(dataset):
    from megatron_parm.data.datasets import parse_data_path

    assert parse_data_path([dataset]) == ([dataset], None)
    idx, bin_ = Path(dataset + ".idx"), Path(dataset + ".bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    cases = [
        (lambda: os.truncate(idx, len(good_idx) - 8),
         f"{idx}: {len(good_idx) - 8} bytes, expected {len(good_idx)} for the 3 sequences"),
        (lambda: os.truncate(idx, 20), f"{idx}: 20 bytes, shorter than the 34-byte header"),
        (lambda: idx.write_bytes(b"NOTANIDX!" + good_idx[9:]), f"{idx}: starts with b'NOTANIDX!'"),
        (lambda: os.truncate(bin_, len(good_bin) - 2),
         f"{bin_}: {len(good_bin) - 2} bytes, expected {len(good_bin)} (15 tokens of 2 bytes) "
         f"as tiny_text_document.idx says (truncated)"),
        (lambda: bin_.write_bytes(good_bin + b"xx"), "not the data of this index"),
    ]
    for damage, message in cases:
        idx.write_bytes(good_idx)
        bin_.write_bytes(good_bin)
        damage()
        with pytest.raises(ValueError) as info:
            parse_data_path([dataset])
        assert message in str(info.value) and "rebuild the dataset with tools/preprocess_data.py" \
            in str(info.value), str(info.value)
        assert str(info.value).startswith("--data-path: ")


# ---------------------------------------------------------------------------------------------
# Benchmark grids: declarative exclusions, nothing evaluated
# ---------------------------------------------------------------------------------------------

def test_grid_exclusions_are_declarative(tmp_path):
    bench = load_tool("bench_moe_layer")
    configs = bench.load_grid(str(REPO / "configs/bench/small.yaml"))
    capped = [c for c in configs if c["capacity_factor"] is not None]
    assert len(configs) == 10 and len(capped) == 2
    assert all(c["seq_length"] == 1024 and c["num_experts"] == 4 for c in capped)
    assert len(bench.load_grid(str(REPO / "configs/bench/full.yaml"))) == 1296

    grid = tmp_path / "grid.yaml"
    marker = tmp_path / "ran"
    grid.write_text(f"grid: {{tp: [1, 2]}}\nexclude_if: \"__import__('os').mkdir('{marker}')\"\n")
    with pytest.raises(ValueError, match="exclude_if must be a list of rules"):
        bench.load_grid(str(grid))
    assert not marker.exists()
    grid.write_text("grid: {tp: [1, 2, 4], ep: [1, 2]}\n"
                    "exclude_if: [{tp: {ge: 2}, ep: 1}, {tp: {in: [4]}}]\n")
    assert bench.load_grid(str(grid)) == [{"tp": 1, "ep": 1}, {"tp": 1, "ep": 2},
                                          {"tp": 2, "ep": 2}]
    grid.write_text("grid: {tp: [1, 2]}\nexclude_if: [{tp: {between: [1, 2]}}]\n")
    with pytest.raises(ValueError, match="tp: .* is not one of eq, ne, lt"):
        bench.load_grid(str(grid))


def test_checkpoint_flags_of_an_earlier_version_get_todays_defaults():
    """tools/convert_checkpoint.py builds the target layout's model from the saved flags: those
    of a checkpoint saved before today's architecture flags existed still build."""
    convert = load_tool("convert_checkpoint")
    flags = convert.saved_flags({"num_layers": 2, "layernorm_epsilon": 1e-6, "swiglu": False})
    assert flags["norm_epsilon"] == 1e-6 and "layernorm_epsilon" not in flags
    assert (flags["normalization"], flags["position_embedding_type"], flags["moe_layer_freq"],
            flags["num_layers"]) == ("LayerNorm", "learned_absolute", 1, 2)


_TINY_SAVED = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256,
               "num_attention_heads": 4, "seq_length": 64, "max_position_embeddings": 64,
               "num_experts": 4, "moe_router_topk": 2, "disable_bias_linear": True}


@pytest.mark.parametrize("common,layout,world,words", [
    # a distributed optimizer's dp-reshardable state: refused whatever the target layout
    ({"optimizer_step": 40, "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}},
     (1, 4, 1, 1), 4, ["--load", "dp-reshardable", "--dist-ckpt-optim-fully-reshardable"]),
    # the padded vocabulary is fixed at save time: 8192 does not split over 3 TP ranks
    ({"args": {**_TINY_SAVED, "num_attention_heads": 6, "hidden_size": 96, "seq_length": 96,
               "max_position_embeddings": 96}},
     (3, 1, 1, 1), 3, ["--target-tensor-parallel-size 3", "padded vocabulary (8192"]),
    # each expert's FFN (256) over 3 expert-tensor ranks
    ({}, (1, 1, 3, 1), 3, ["--target-expert-tensor-parallel-size"]),
    ({}, (1, 1, 1, 3), 3, ["--target-pipeline-parallel-size"]),
])
def test_conversion_refusals_come_before_any_process_and_name_the_tools_flags(
        common, layout, world, words):
    """tools/convert_checkpoint.py checks everything the target layout's ranks would refuse
    before it starts them (relayout_problem), in this tool's flags (--target-*, --load), not
    training's (--tensor-model-parallel-size, --use-distributed-optimizer alone)."""
    convert = load_tool("convert_checkpoint")
    plain = {"args": _TINY_SAVED, "optimizer_step": 40,
             "layout": {"world_size": 4, "tensor_model_parallel_size": 2,
                        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2},
             "model_info": {"padded_vocab_size": 8192, "vocab_size": 8000}}
    problem = convert.relayout_problem("SAVE/iter_0000040", {**plain, **common}, layout, world)
    assert problem is not None and all(word in problem for word in words), problem
    assert "--tensor-model-parallel-size" not in problem, problem
    assert convert.relayout_problem("SAVE/iter_0000040", plain, (1, 4, 1, 1), 4) is None


def test_every_shipped_grid_loads():
    """Each grid a doc or tool names (configs/bench/*.yaml with a `grid`) reads as the layer
    benchmark reads it (an old expression-style exclude_if is refused there)."""
    import yaml

    bench = load_tool("bench_moe_layer")
    for path in sorted((REPO / "configs/bench").glob("*.yaml")):
        if "grid" in (yaml.safe_load(path.read_text()) or {}):
            assert bench.load_grid(str(path)), path


# ---------------------------------------------------------------------------------------------
# The resumed learning-rate schedule (Megatron-LM's rules)
# ---------------------------------------------------------------------------------------------

def _scheduler(train_iters=5, lr=3e-3, override=False, use_checkpoint=False, batch=16):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=3e-4, lr_warmup_steps=batch,
        lr_decay_steps=train_iters * batch, lr_decay_style="cosine", start_wd=0.01,
        end_wd=0.01, wd_incr_steps=train_iters * batch, wd_incr_style="constant",
        override_opt_param_scheduler=override, use_checkpoint_opt_param_scheduler=use_checkpoint)


def test_a_different_schedule_needs_one_of_the_two_flags():
    from megatron_parm.checkpointing.scheduler import check_schedule

    saved = _scheduler(train_iters=5).state_dict()
    check_schedule("ckpt", saved, _scheduler(train_iters=5), 16, 16)  # same schedule: fine
    with pytest.raises(CheckpointError) as info:
        check_schedule("ckpt", saved, _scheduler(train_iters=10, lr=2e-3), 16, 16)
    message = str(info.value)
    assert "--lr: 0.003 in the checkpoint, 0.002 on the command line" in message
    assert ("--lr-decay-iters (default: --train-iters): 5 iterations (80 samples) in the "
            "checkpoint, 10 iterations (160 samples) on the command line") in message
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message
    check_schedule("ckpt", saved, _scheduler(train_iters=10, override=True), 16, 16)
    check_schedule("ckpt", saved, _scheduler(train_iters=10, use_checkpoint=True), 16, 16)

    longer = _scheduler(train_iters=10, override=True)
    longer.load_state_dict(saved)
    assert longer.lr_decay_steps == 160  # the command line's
    kept = _scheduler(train_iters=10, use_checkpoint=True)
    kept.load_state_dict(saved)
    assert kept.lr_decay_steps == 80  # the checkpoint's


def test_the_two_flags_exclude_each_other(prepared_data, monkeypatch):
    from megatron_parm.training.arguments import parse_args

    monkeypatch.chdir(REPO)  # the config names the data relative to the repository
    argv = ["--config", "configs/gpt2_tiny_moe.yaml"]
    args = parse_args(argv + ["--override-opt_param-scheduler"], world_size=1)
    assert args.override_opt_param_scheduler and not args.use_checkpoint_opt_param_scheduler
    with pytest.raises(ValueError, match="exclude each other"):
        parse_args(argv + ["--override-opt_param-scheduler",
                           "--use-checkpoint-opt_param-scheduler"], world_size=1)
    bad = Path(prepared_data[0]).parent / "broken.yaml"
    bad.write_text("num_layers: [2\n")
    with pytest.raises(ValueError, match=f"--config: {bad} is not valid YAML"):
        parse_args(["--config", str(bad)], world_size=1)


# ---------------------------------------------------------------------------------------------
# Safe loading: a malicious pickle in each loading path is refused before it runs
# ---------------------------------------------------------------------------------------------

class Payload:
    """Unpickling this calls os.mkdir(path): the test checks the folder never appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _tiny_full(objects=None, common_extra=None) -> FullCheckpoint:
    generator = torch.Generator().manual_seed(0)
    tensors = {"decoder.final_layernorm.weight": torch.randn(4, generator=generator),
               "decoder.layers.mlp.experts.experts.linear_fc1.weight":
                   torch.randn(2, 3, 4, 4, generator=generator)}
    common = {"iteration": 3, "consumed_samples": 48, "args": {"num_layers": 2},
              "layout": {"world_size": 1}, "rng_state": {"per_rank": [
                  {"numpy": numpy.random.RandomState(0).get_state()}]}}
    common.update(common_extra or {})
    return FullCheckpoint(tensors, objects if objects is not None else
                          {"decoder.layers.self_attention.linear_proj._extra_state/shard_0_1": [None]},
                          common)


@pytest.fixture
def checkpoint(tmp_path):
    return write_full(str(tmp_path / "ckpt"), 3, _tiny_full())


def test_a_tool_whose_reader_went_away_stops_quietly(checkpoint):
    """`tools/inspect_checkpoint.py SAVE | head -30`: once head has its lines, the tool ends
    with SIGPIPE's status and without a BrokenPipeError traceback (stdout unbuffered here, so
    that the first print meets the closed pipe)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.Popen([sys.executable, "-u", "tools/inspect_checkpoint.py", checkpoint],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == cli.BROKEN_PIPE, err
    assert err == "", err


def test_a_broken_pipe_elsewhere_is_still_a_bug(capsys):
    """Only a closed standard output is quiet: a BrokenPipeError from anything else (a socket
    to a peer) keeps its traceback."""
    def main():
        raise BrokenPipeError(32, "Broken pipe")

    assert cli.call(main) == cli.BUG
    assert "BrokenPipeError" in capsys.readouterr().err


def test_checkpoints_of_this_project_load_safely(checkpoint, tmp_path):
    info = read_checkpoint_info(checkpoint)
    assert info["iteration"] == 3 and isinstance(info["rng_state"]["per_rank"][0]["numpy"][1],
                                                 numpy.ndarray)
    full = read_full(checkpoint)
    assert list(full.objects.values()) == [[None]]
    save_single_file(full, str(tmp_path / "one.pt"))
    assert torch.equal(load_single_file(str(tmp_path / "one.pt")).tensors[
        "decoder.final_layernorm.weight"], full.tensors["decoder.final_layernorm.weight"])


def _refused(load, marker: Path, named: str):
    with pytest.raises(CheckpointError) as info:
        load()
    assert "refused: it holds a reference to posix.mkdir" in str(info.value), str(info.value)
    assert named in str(info.value)
    assert not marker.exists(), "the payload ran"


def test_malicious_common_pt_is_refused_in_every_path(checkpoint, tmp_path):
    marker = tmp_path / "payload-ran"
    common = load_torch_file(os.path.join(checkpoint, "common.pt"))
    common["note"] = Payload(marker)
    torch.save(common, os.path.join(checkpoint, "common.pt"))
    common_pt = os.path.join(checkpoint, "common.pt")
    _refused(lambda: read_checkpoint_info(checkpoint), marker, common_pt)   # --load, tools
    _refused(lambda: read_full(checkpoint), marker, common_pt)              # conversions
    renamed = tmp_path / "mine"  # --load naming a checkpoint folder not called iter_N
    shutil.copytree(checkpoint, renamed)
    _refused(lambda: resolve_load(str(renamed)), marker, str(renamed / "common.pt"))


def test_malicious_dcp_metadata_is_refused(checkpoint, tmp_path):
    marker = tmp_path / "payload-ran"
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump({"index": Payload(marker)}, f)
    _refused(lambda: read_metadata(checkpoint), marker, ".metadata")
    _refused(lambda: read_checkpoint_info(checkpoint), marker, ".metadata")
    _refused(lambda: read_full(checkpoint), marker, ".metadata")


def test_malicious_sharded_object_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    key = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_1"
    path = write_full(str(tmp_path / "ckpt"), 3, _tiny_full(objects={key: Payload(marker)}))
    # what load_checkpoint reads before Megatron-Core's own (unrestricted) loader
    _refused(lambda: read_sharded_objects(path, read_metadata(path)), marker, f"object {key}")
    _refused(lambda: read_full(path), marker, f"object {key}")


def test_malicious_single_file_is_refused(checkpoint, tmp_path):
    marker = tmp_path / "payload-ran"
    full = read_full(checkpoint)
    full.common["note"] = Payload(marker)
    file_path = tmp_path / "one.pt"
    torch.save({"format": "megatron-parm single-file checkpoint", "tensors": full.tensors,
                "common": full.common}, file_path)
    _refused(lambda: load_single_file(str(file_path)), marker, f"--from-single-file {file_path}")


def test_malicious_hugging_face_weights_are_refused(tmp_path):
    from megatron_parm.checkpointing.hf_gpt2 import hf_gpt2_to_full

    marker = tmp_path / "payload-ran"
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    torch.save({"wte.weight": torch.zeros(2, 2), "x": Payload(marker)},
               tmp_path / "pytorch_model.bin")
    _refused(lambda: hf_gpt2_to_full(str(tmp_path)), marker, "pytorch_model.bin")


def test_the_payload_would_run_without_the_allow_list(tmp_path):
    """The planted file is a working exploit: a plain torch.load runs it."""
    marker = tmp_path / "payload-ran"
    torch.save({"x": Payload(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------------------------------
# Checksums that diff, progress hooks
# ---------------------------------------------------------------------------------------------

def test_verify_checksums_diff_to_the_changed_expert(tmp_path):
    inspect = load_tool("inspect_checkpoint")
    full = _tiny_full()
    before = list(inspect.checksum_lines(tensor_checksums(full.tensors)))
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    full.tensors[key][1, 2] += 1.0
    seen = []
    after = list(inspect.checksum_lines(tensor_checksums(full.tensors, on_tensor=seen.append)))
    assert seen == [1, 2]
    assert len(before) == len(after) == 2 + 2 * 3
    changed = [line.split(" ", 2)[2] for line in after if line not in before]
    assert changed == [f"{key} float32(2, 3, 4, 4)", f"{key}[layer 1, expert 2]"]
    assert all(line.startswith("crc32 ") for line in after)


def test_preprocessing_reports_each_document(tmp_path):
    from megatron_parm.data.preprocess import preprocess_jsonl

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(f'{{"text": "document number {i}."}}\n' for i in range(5)))
    done = []
    preprocess_jsonl(str(jsonl), str(tmp_path / "out"), {
        "tokenizer_type": "SentencePieceTokenizer",
        "tokenizer_model": str(REPO / "data/tokenizer/spm_8k.model")}, on_document=done.append)
    assert done == [1, 2, 3, 4, 5]
