"""Which checkpoint --load means, and atomic publishing (pure file-system logic, no ranks)."""

from __future__ import annotations

import os

import pytest

from megatron_parm.checkpointing.paths import (
    CheckpointError,
    REQUIRED_FILES,
    TRACKER_FILE,
    checkpoint_dir,
    partial_dir,
    publish,
    resolve_load,
)


def fake_checkpoint(path):
    os.makedirs(path, exist_ok=True)
    for name in REQUIRED_FILES:
        open(os.path.join(path, name), "w").close()


def test_a_load_with_nothing_yet_is_a_fresh_start_as_in_megatron_lm(tmp_path):
    from megatron_parm.checkpointing.save_load import fresh_start_line

    # A training run's --load (may_be_empty): missing or empty means starting from scratch.
    for folder in (tmp_path / "nowhere", tmp_path):
        assert resolve_load(str(folder), may_be_empty=True) is None
    # Where a checkpoint must be there (a tool's input, --pretrained-checkpoint): an error.
    with pytest.raises(CheckpointError, match="nowhere: no such directory"):
        resolve_load(str(tmp_path / "nowhere"), flag="--pretrained-checkpoint")
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        resolve_load(str(tmp_path))
    # What the run says: the auto-resume case (--load is --save) is the expected first start.
    assert fresh_start_line(str(tmp_path), str(tmp_path)).startswith(
        f"> no checkpoint in {tmp_path} yet (it is also --save): starting from scratch")
    assert fresh_start_line(str(tmp_path / "nowhere"), None) == (
        f"warning: --load {tmp_path}/nowhere: no such directory: starting from scratch, as "
        f"Megatron-LM does (--exit-on-missing-checkpoint stops instead)")
    assert ": no checkpoint there yet: " in fresh_start_line(str(tmp_path), str(tmp_path / "s"))


def test_tracker_names_the_checkpoint(tmp_path):
    fake_checkpoint(checkpoint_dir(str(tmp_path), 5))
    fake_checkpoint(checkpoint_dir(str(tmp_path), 10))
    (tmp_path / TRACKER_FILE).write_text("5\n")
    assert resolve_load(str(tmp_path)) == (checkpoint_dir(str(tmp_path), 5), 5)
    assert resolve_load(checkpoint_dir(str(tmp_path), 10)) == (checkpoint_dir(str(tmp_path), 10), 10)


def test_corrupted_tracker_or_missing_folder_is_an_error(tmp_path):
    (tmp_path / TRACKER_FILE).write_text("garbage")
    with pytest.raises(CheckpointError, match="corrupted tracker"):
        resolve_load(str(tmp_path), may_be_empty=True)
    (tmp_path / TRACKER_FILE).write_text("7")
    with pytest.raises(CheckpointError, match="iter_0000007 does not exist"):
        resolve_load(str(tmp_path), may_be_empty=True)


def test_partial_saves_are_never_loaded(tmp_path):
    fake_checkpoint(partial_dir(str(tmp_path), 4))
    # Only an unfinished save: a training run starts fresh, a tool's input is an error naming it.
    assert resolve_load(str(tmp_path), may_be_empty=True) is None
    with pytest.raises(CheckpointError, match=r"iter_0000004\.partial"):
        resolve_load(str(tmp_path))
    # A folder without its index files is incomplete: an error, even for a training run.
    os.makedirs(checkpoint_dir(str(tmp_path), 2))
    with pytest.raises(CheckpointError, match="incomplete checkpoint folders: iter_0000002"):
        resolve_load(str(tmp_path), may_be_empty=True)


def test_published_checkpoint_without_tracker_is_found(tmp_path):
    # A kill between the rename and the tracker write.
    fake_checkpoint(checkpoint_dir(str(tmp_path), 2))
    fake_checkpoint(checkpoint_dir(str(tmp_path), 4))
    assert resolve_load(str(tmp_path)) == (checkpoint_dir(str(tmp_path), 4), 4)


def test_publish_renames_then_writes_the_tracker(tmp_path):
    root = str(tmp_path)
    fake_checkpoint(checkpoint_dir(root, 3))
    (tmp_path / TRACKER_FILE).write_text("3")
    fake_checkpoint(partial_dir(root, 3))
    (tmp_path / "iter_0000003.partial" / "new").write_text("x")
    publish(root, 3)  # replaces the older iter_0000003
    assert (tmp_path / "iter_0000003" / "new").exists()
    assert not os.path.exists(partial_dir(root, 3))
    fake_checkpoint(partial_dir(root, 6))
    fake_checkpoint(partial_dir(root, 4))  # a save killed earlier
    publish(root, 6)
    assert (tmp_path / TRACKER_FILE).read_text() == "6"
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000006", TRACKER_FILE]


# ---------------------------------------------------------------------------------------------
# the checkpoint flags' pure logic: formats, --ckpt-step, retention, which checkpoint, options
# ---------------------------------------------------------------------------------------------


def fake_torch_checkpoint(path, name="mp_rank_00_000"):
    os.makedirs(os.path.join(path, name), exist_ok=True)
    open(os.path.join(path, name, "model_optim_rng.pt"), "w").close()


def test_format_told_by_the_files_as_megatron_lm_does(tmp_path):
    from megatron_parm.checkpointing.formats import detect_format, rank_zero_file

    fake_checkpoint(tmp_path / "dist")
    fake_torch_checkpoint(tmp_path / "torch", "mp_rank_00_000_001")  # tp 0, pp 0, ep 1: not first
    fake_torch_checkpoint(tmp_path / "torch", "mp_rank_00_000_000")
    os.makedirs(tmp_path / "empty")
    assert detect_format(str(tmp_path / "dist")) == "torch_dist"
    assert detect_format(str(tmp_path / "torch")) == "torch"
    assert detect_format(str(tmp_path / "empty")) is None
    assert rank_zero_file(str(tmp_path / "torch")).endswith("mp_rank_00_000_000/model_optim_rng.pt")
    # a torch folder is a published checkpoint resolve_load finds, as a torch_dist one
    root = str(tmp_path / "root")
    fake_torch_checkpoint(checkpoint_dir(root, 6), "mp_rank_01")  # not the first rank's
    os.makedirs(os.path.join(checkpoint_dir(root, 6), "mp_rank_00"))
    with pytest.raises(CheckpointError, match="incomplete checkpoint folders: iter_0000006"):
        resolve_load(root)
    fake_torch_checkpoint(checkpoint_dir(root, 6), "mp_rank_00")
    assert resolve_load(root) == (checkpoint_dir(root, 6), 6)


def test_rank_file_names_are_megatron_lms():
    from megatron_parm.checkpointing.formats import rank_dir_name

    assert rank_dir_name(0, 0, 0, False, False) == "mp_rank_00"
    assert rank_dir_name(3, 1, 2, True, False) == "mp_rank_03_001"
    assert rank_dir_name(1, 0, 5, False, True) == "mp_rank_01_005"
    assert rank_dir_name(1, 2, 5, True, True) == "mp_rank_01_002_005"


def test_loading_format_follows_ckpt_format_and_auto_detect():
    from megatron_parm.checkpointing.formats import loading_format

    # --ckpt-format torch_dist (the default) loads either; torch needs --auto-detect-ckpt-format
    # for a torch_dist folder (Megatron-LM refuses it too)
    assert loading_format("torch", "torch_dist", False, "X") == "torch"
    assert loading_format("torch_dist", "torch_dist", False, "X") == "torch_dist"
    assert loading_format("torch", "torch", False, "X") == "torch"
    assert loading_format("torch_dist", "torch", True, "X") == "torch_dist"
    with pytest.raises(CheckpointError, match="--ckpt-format torch: X holds a torch_dist "
                                              "checkpoint; give --auto-detect-ckpt-format"):
        loading_format("torch_dist", "torch", False, "X")
    with pytest.raises(CheckpointError, match="X holds no checkpoint of either format"):
        loading_format(None, "torch_dist", True, "X")


def test_ckpt_step_loads_that_iteration_or_names_what_there_is(tmp_path):
    root = str(tmp_path)
    for iteration in (5, 10):
        fake_checkpoint(checkpoint_dir(root, iteration))
    (tmp_path / TRACKER_FILE).write_text("10")
    assert resolve_load(root, step=5) == (checkpoint_dir(root, 5), 5)
    with pytest.raises(CheckpointError, match=r"--ckpt-step 7: .*iter_0000007 does not exist "
                                              r"\(complete iterations in .*: 5, 10\)"):
        resolve_load(root, step=7)
    with pytest.raises(CheckpointError, match="--ckpt-step 5: --load .* names one checkpoint"):
        resolve_load(checkpoint_dir(root, 10), step=5)
    with pytest.raises(CheckpointError, match="no such directory"):  # not a fresh start
        resolve_load(str(tmp_path / "run"), step=5, may_be_empty=True)


def test_retention_keeps_every_nth_and_the_latest():
    from megatron_parm.checkpointing.paths import retention_victim

    # --save-interval 2 --save-retain-interval 4: saves 2..10 leave 4, 8 and 10
    kept, previous = [], None
    for saved in (2, 4, 6, 8, 10):
        kept.append(saved)
        victim = retention_victim(previous, saved, 4)
        if victim is not None:
            kept.remove(victim)
        previous = saved
    assert kept == [4, 8, 10]
    assert retention_victim(6, 8, None) is None  # no --save-retain-interval: keep all
    assert retention_victim(10, 6, 4) is None  # never a newer save (a --ckpt-step resume)
    assert retention_victim(6, 6, 4) is None  # the same iteration saved again


def test_remove_checkpoint_spares_links(tmp_path):
    from megatron_parm.checkpointing.paths import remove_checkpoint

    root = str(tmp_path)
    fake_checkpoint(checkpoint_dir(root, 2))
    fake_checkpoint(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", checkpoint_dir(root, 4))
    assert remove_checkpoint(root, 2) and not os.path.exists(checkpoint_dir(root, 2))
    assert not remove_checkpoint(root, 4) and (tmp_path / "elsewhere" / "common.pt").exists()


def test_which_checkpoint_pretrained_non_persistent_and_missing(tmp_path):
    from megatron_parm.checkpointing.save_load import find_checkpoint

    run, base, fresh = str(tmp_path / "run"), str(tmp_path / "base"), str(tmp_path / "fresh")
    fake_checkpoint(checkpoint_dir(base, 8))
    # --pretrained-checkpoint: used while --load holds nothing (missing or empty), as finetuning
    assert find_checkpoint(run, pretrained=base) == (checkpoint_dir(base, 8), 8, True)
    assert find_checkpoint(None, pretrained=base).pretrained
    fake_checkpoint(checkpoint_dir(run, 2))
    assert find_checkpoint(run, pretrained=base) == (checkpoint_dir(run, 2), 2, False)
    with pytest.raises(CheckpointError, match="--pretrained-checkpoint .*nowhere: no such"):
        find_checkpoint(fresh, pretrained=str(tmp_path / "nowhere"))
    # --exit-on-missing-checkpoint: the fresh start becomes an error
    assert find_checkpoint(fresh) is None
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint: --load .*fresh "
                                              "holds no checkpoint yet"):
        find_checkpoint(fresh, exit_on_missing=True)
    # a non-persistent folder's latest wins when it is at least as new (not with --ckpt-step)
    spare = os.path.join(run, "non_persistent")
    fake_checkpoint(checkpoint_dir(spare, 3))
    (tmp_path / "run" / "non_persistent" / TRACKER_FILE).write_text("3")
    assert find_checkpoint(run, non_persistent=spare) == (checkpoint_dir(spare, 3), 3, False)
    assert find_checkpoint(run, step=2, non_persistent=spare)[1] == 2
    fake_checkpoint(checkpoint_dir(run, 4))
    assert find_checkpoint(run, non_persistent=spare)[1] == 4
    assert find_checkpoint(fresh, non_persistent=spare)[1] == 3


def test_save_intervals_and_the_non_persistent_folder():
    from argparse import Namespace

    from megatron_parm.checkpointing.intervals import non_persistent_root, save_due

    args = Namespace(save="S", train_iters=10, save_interval=4, non_persistent_ckpt_type="global",
                     non_persistent_save_interval=3, non_persistent_global_ckpt_dir=None)
    assert [save_due(it, args) for it in range(1, 11)] == [
        None, None, "non-persistent", "persistent", None, "non-persistent", None, "persistent",
        "non-persistent", None]  # at 10 the end's save: the trainer's own
    assert non_persistent_root(args, "S") == os.path.join("S", "non_persistent")
    args.non_persistent_global_ckpt_dir = "NP"
    assert non_persistent_root(args, "S") == "NP"
    args.non_persistent_ckpt_type = None
    assert non_persistent_root(args, "S") is None and save_due(3, args) is None


def test_options_from_flags_as_megatron_lm_reads_them():
    from argparse import Namespace

    from megatron_parm.checkpointing.options import LoadOptions, SaveOptions

    assert SaveOptions.from_args(None) == SaveOptions()  # a tool: Megatron-LM's defaults
    assert SaveOptions().fully_parallel and LoadOptions().load_optim
    save = SaveOptions.from_args(Namespace(no_save_optim=True, no_save_rng=None,
                                           ckpt_fully_parallel_save=False, ckpt_format="torch"))
    assert (save.save_optim, save.save_rng, save.fully_parallel, save.ckpt_format) == \
        (False, True, False, "torch")
    # --finetune: no optimizer state, schedule or RNG states; --pretrained-checkpoint the same
    finetune = LoadOptions.from_args(Namespace(finetune=True))
    assert (finetune.load_optim, finetune.load_rng, finetune.finetune) == (False, False, True)
    assert LoadOptions().finetuning() == finetune
    no_rng = LoadOptions.from_args(Namespace(no_load_rng=True))
    assert (no_rng.load_optim, no_rng.load_rng, no_rng.finetune) == (True, False, False)


def test_strictness_outcomes():
    from megatron_parm.checkpointing.strategies import mcore_strictness, strictness_outcome

    assert mcore_strictness("assume_ok_unexpected") == "assume_ok_unexpected"
    assert mcore_strictness("log_unexpected") == mcore_strictness("raise_unexpected") == \
        "return_unexpected"
    assert mcore_strictness("raise_all") == mcore_strictness("log_all") == "return_all"
    missing, unexpected = {"extra.weight"}, {"decoder.final_layernorm.bias"}
    error, notes = strictness_outcome("raise_all", missing, unexpected)
    assert error.startswith("--dist-ckpt-strictness raise_all: ") and notes == []
    assert "decoder.final_layernorm.bias" in error and "extra.weight" in error
    error, notes = strictness_outcome("log_all", missing, unexpected)
    assert error is None and len(notes) == 2 and "extra.weight" in notes[1]
    assert strictness_outcome("ignore_all", missing, unexpected) == (None, [])
    assert strictness_outcome("raise_unexpected", set(), set()) == (None, [])


def test_torch_format_writers_must_hold_what_their_readers_need():
    from megatron_parm.checkpointing.torch_format import _writers_problem

    ranks = lambda tp, ep, etp: {"tensor": tp, "pipeline": 0, "expert": ep, "expert_tensor": etp}
    # tp=2 ep=2 etp=2 on 4 ranks: each rank writes its own file
    fine = [(f"mp_rank_{tp:02d}_{ep:03d}", ranks(tp, ep, tp), True) for ep in (0, 1) for tp in (0, 1)]
    assert _writers_problem(fine) == ""
    # tp=1 ep=2 etp=2: two writers of one name (their expert shards differ)
    clash = [("mp_rank_00_000", ranks(0, 0, 0), True), ("mp_rank_00_000", ranks(0, 0, 1), True)]
    assert _writers_problem(clash) == "ranks 0 and 1 would both write mp_rank_00_000"
    # a reader whose writer holds other shards
    other = [("mp_rank_00_000", ranks(0, 0, 0), True), ("mp_rank_00_000", ranks(0, 0, 1), False)]
    assert "rank 1 would read mp_rank_00_000" in _writers_problem(other)


def test_checkpoint_args_taken_by_megatron_lms_rules():
    from argparse import Namespace

    from megatron_parm.checkpointing.checkpoint_args import taken_args

    saved = {"num_layers": 4, "hidden_size": 128, "num_experts": 8, "moe_router_topk": 2,
             "disable_bias_linear": False, "swiglu": True, "tokenizer_model": "ckpt.model",
             "tokenizer_type": "SentencePieceTokenizer", "tensor_model_parallel_size": 2,
             "moe_ffn_hidden_size": 96, "moe_token_dispatcher_type": "alltoall"}
    args = Namespace(num_layers=None, hidden_size=64, num_experts=4, moe_router_topk=2,
                     disable_bias_linear=True, swiglu=False, tokenizer_model="mine.model",
                     tokenizer_type="SentencePieceTokenizer", tensor_model_parallel_size=1,
                     moe_ffn_hidden_size=None, moe_token_dispatcher_type="parm", ckpt_format="torch_dist")
    # forced ones win; others only where the command line left them unset (None)
    assert taken_args(saved, args, mp_args=False, tokenizer=True) == {
        "num_layers": 4, "disable_bias_linear": False, "swiglu": True, "num_experts": 8,
        "moe_ffn_hidden_size": 96, "tokenizer_model": "ckpt.model"}
    taken = taken_args(saved, args, mp_args=True, tokenizer=False)
    assert "tokenizer_model" not in taken and taken["tensor_model_parallel_size"] == 2
    # no experts in the checkpoint: no expert width either (Megatron-LM)
    args.moe_ffn_hidden_size, args.num_layers = 32, 4
    assert taken_args({"num_layers": 4}, args, False, True) == {"moe_ffn_hidden_size": None}
