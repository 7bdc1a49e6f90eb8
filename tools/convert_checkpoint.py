"""Convert checkpoints offline: another (tp, ep, etp, pp) layout, one file and back, upcycling.

Another layout (runs the target layout's ranks as local gloo processes, CPU only):
    python tools/convert_checkpoint.py --load runs/x/checkpoints --save runs/x/ckpt_tp1_ep4 \
        --target-tensor-parallel-size 1 --target-expert-parallel-size 4 \
        --target-expert-tensor-parallel-size 1 [--target-pipeline-parallel-size 2]

One unsharded PyTorch file (for inspection or other frameworks), and back:
    python tools/convert_checkpoint.py --load runs/x/checkpoints --to-single-file x.pt
    python tools/convert_checkpoint.py --from-single-file x.pt --save runs/x/from_file

Upcycle a dense GPT checkpoint (this trainer without --num-experts) to MoE:
    python tools/convert_checkpoint.py --upcycle --load runs/dense/checkpoints \
        --save runs/moe/checkpoints --num-experts 8 --moe-router-topk 2

From and to Hugging Face (a local directory: config.json and model.safetensors, its shards
with model.safetensors.index.json, or pytorch_model.bin; nothing is downloaded). --from-hf
imports Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3 (its MTP layers with
--mtp-num-layers), dense Llama or GPT-2 (in the --target-* layout when given) and writes the
model's flags as CKPT/config.yaml, for training with --config; --to-hf exports a Mixtral-,
Qwen2-MoE-, Qwen3-MoE- or DeepSeek-shaped checkpoint (saved in any layout):
    python tools/convert_checkpoint.py --from-hf ~/models/Qwen3-30B-A3B --save runs/q3/ckpt
    python tools/convert_checkpoint.py --to-hf runs/q3/hf --load runs/q3/ckpt
--load also takes a dense Hugging Face directory (GPT-2, Llama) in place of a checkpoint for
--upcycle:
    python tools/convert_checkpoint.py --upcycle --load ~/models/gpt2 \
        --save runs/gpt2_moe/checkpoints --num-experts 8 --moe-router-topk 2
GPT-2 has biases: train the result with the flags it was saved with (--openai-gelu, no
--disable-bias-linear) and, for MoE, --expert-tensor-parallel-size 1.

--load takes a checkpoint root (its latest checkpoint) or one iter_NNNNNNN folder. Every
conversion reads the result back and compares every tensor with the source by CRC32 (each
expert of each layer separately) and exits non-zero naming the tensor when one did not make
it across. torch_dist checkpoints already load in any layout; converting to the target layout
rewrites them in the target's shards (and runs the very loader training uses).
"""

from __future__ import annotations

import argparse
import os
import sys
from argparse import Namespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli, settings  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.checkpointing.hf_files import has_weights  # noqa: E402
from megatron_parm.checkpointing.paths import CheckpointError  # noqa: E402


# The layout flags of training, as this tool names them for the target layout.
TARGET_FLAGS = {"--tensor-model-parallel-size": "--target-tensor-parallel-size",
                "--expert-model-parallel-size": "--target-expert-parallel-size",
                "--expert-tensor-parallel-size": "--target-expert-tensor-parallel-size",
                "--pipeline-model-parallel-size": "--target-pipeline-parallel-size"}


def build_parser() -> argparse.ArgumentParser:
    parser = settings.Parser(description=__doc__.split("\n\n")[0],
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    settings.add_flags(parser, ["--load", "--save"], helps={
        "load": "Source checkpoint root or iter_NNNNNNN folder.",
        "save": "Target checkpoint root."})
    parser.add_argument("--target-tensor-parallel-size", type=int)
    parser.add_argument("--target-expert-parallel-size", type=int)
    parser.add_argument("--target-expert-tensor-parallel-size", type=int)
    parser.add_argument("--target-pipeline-parallel-size", type=int,
                        help="Pipeline stages of the target layout (default: the checkpoint's; "
                             "the layers split evenly, without interleaving).")
    parser.add_argument("--target-world-size", type=int, default=None,
                        help="Ranks of the target layout (default: the smallest that fits it).")
    parser.add_argument("--to-single-file", metavar="FILE")
    parser.add_argument("--from-single-file", metavar="FILE")
    parser.add_argument("--from-hf", metavar="DIR",
                        help="Import a Hugging Face model directory (Mixtral, Qwen2-MoE, "
                             "Qwen3-MoE, DeepSeek-V2, DeepSeek-V3, Llama, GPT-2).")
    parser.add_argument("--to-hf", metavar="DIR",
                        help="Export --load as a Hugging Face directory (Mixtral, Qwen2-MoE, "
                             "Qwen3-MoE, DeepSeek-V2, DeepSeek-V3).")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="With --to-hf: the largest safetensors shard (default %(default)s).")
    parser.add_argument("--upcycle", action="store_true")
    settings.add_flags(parser, ["--num-experts", "--moe-router-topk"],
                       helps={"num_experts": "With --upcycle.", "moe_router_topk": "With --upcycle."})
    parser.add_argument("--router-init-std", type=float, default=0.01,
                        help="With --upcycle: std of the random router (0: all-zero router).")
    settings.add_flags(parser, ["--seed"])
    settings.add_flags(parser, ["--mtp-num-layers"], helps={
        "mtp_num_layers": "With --from-hf of DeepSeek-V3: import this many of its MTP layers "
                          "(default: none, left out)."})
    settings.add_flags(parser, ["--make-vocab-size-divisible-by"], helps={
        "make_vocab_size_divisible_by": "With --from-hf: pad the vocabulary to a multiple of "
                                        "this (default %(default)s, Megatron-LM's)."})
    return parser


def main(argv=None) -> int:
    args = settings.read(build_parser(), argv)  # each flag's declared check
    targets = (args.target_tensor_parallel_size, args.target_expert_parallel_size,
               args.target_expert_tensor_parallel_size, args.target_pipeline_parallel_size)
    relayout_too = any(t is not None for t in targets)
    modes = [name for name, on in (("--to-single-file", args.to_single_file),
                                   ("--from-single-file", args.from_single_file),
                                   ("--from-hf", args.from_hf), ("--to-hf", args.to_hf),
                                   ("--upcycle", args.upcycle),
                                   ("--target-*-size", relayout_too and not args.from_hf)) if on]
    if len(modes) != 1:
        raise ValueError(f"give exactly one of --to-single-file, --from-single-file, --from-hf, "
                         f"--to-hf, --upcycle, --target-*-size (got {', '.join(modes) or 'none'})")
    if args.mtp_num_layers and not args.from_hf:
        raise ValueError("--mtp-num-layers goes with --from-hf (a DeepSeek-V3 model's MTP layers)")
    if args.to_single_file:
        return to_single_file(resolve_source(args.load), args.to_single_file)
    if args.to_hf:
        return to_hf(resolve_source(args.load), args)
    if not args.save:
        raise ValueError("--save is required")
    if args.from_single_file:
        return from_single_file(args)
    if args.from_hf:
        return from_hf(args, relayout_too)
    if args.upcycle:
        return upcycle(args)
    return relayout(resolve_source(args.load), args)


def resolve_source(load):
    from megatron_parm.checkpointing.paths import resolve_load

    if not load:
        raise ValueError("--load is required")
    return resolve_load(load)  # (folder, iteration); raises CheckpointError


def _summary(sums) -> str:
    from megatron_parm.checkpointing.verify import count_experts

    experts = [key for key, info in sums.items() if "experts" in info]
    return (f"{len(sums)} tensors, {len(experts)} expert tensors holding "
            f"{count_experts(sums)} [layer, expert] slices, all checksums equal")


def checksums(tensors, what: str):
    """Every tensor's checksums (verify.tensor_checksums), as a stage with a progress bar."""
    from megatron_parm.checkpointing.verify import tensor_checksums
    from megatron_parm.training.log import Progress, stage

    with stage(f"checksums of {len(tensors)} tensors ({what})"):
        bar = Progress(len(tensors), unit="tensors")
        sums = tensor_checksums(tensors, on_tensor=bar.update)
        bar.clear()
    return sums


def read_checkpoint(path: str):
    from megatron_parm.checkpointing.full import read_full
    from megatron_parm.training.log import stage

    with stage(f"reading {path}"):
        return read_full(path)


def to_single_file(source, file_path) -> int:
    from megatron_parm.checkpointing.full import load_single_file, save_single_file
    from megatron_parm.training.log import stage

    full = read_checkpoint(source[0])
    expected = checksums(full.tensors, "the source")
    with stage(f"writing {file_path}"):
        save_single_file(full, file_path, expected)
    with stage(f"reading {file_path} back and comparing every checksum"):
        load_single_file(file_path)
    print(f"wrote {file_path} from {source[0]}: {_summary(expected)}")
    return 0


def write_verified(full, save: str, iteration: int, what: str, description: str,
                   expected=None) -> int:
    """Write FULL as SAVE/iter_N, read it back and compare every tensor's checksum."""
    from megatron_parm.checkpointing.full import verify_against, write_full
    from megatron_parm.checkpointing.paths import checkpoint_dir
    from megatron_parm.training.log import stage

    expected = expected or checksums(full.tensors, "to write")
    with stage(f"writing {checkpoint_dir(save, iteration)}"):
        path = write_full(save, iteration, full)
    with stage(f"reading {path} back and comparing every checksum"):
        verify_against(path, expected, what)
    print(f"wrote {path} {description}: {_summary(expected)}")
    return 0


def from_single_file(args) -> int:
    from megatron_parm.checkpointing.full import load_single_file
    from megatron_parm.training.log import stage

    with stage(f"reading {args.from_single_file} and checking its checksums"):
        full = load_single_file(args.from_single_file)
    return write_verified(full, args.save, int(full.common.get("iteration", 0)),
                          "--from-single-file", f"from {args.from_single_file}")


def read_hf(path: str, make_vocab_size_divisible_by: int, mtp_num_layers=None):
    """(FullCheckpoint, description) of the Hugging Face directory PATH: GPT-2, a Llama-style
    or a DeepSeek family (checkpointing.hf_llama.FAMILIES; DeepSeek's with its first
    MTP_NUM_LAYERS MTP layers), its vocabulary padded to a multiple of
    MAKE_VOCAB_SIZE_DIVISIBLE_BY."""
    from functools import partial

    from megatron_parm.checkpointing import hf_deepseek, hf_llama
    from megatron_parm.checkpointing.hf_files import read_config
    from megatron_parm.checkpointing.hf_gpt2 import hf_gpt2_to_full
    from megatron_parm.training.log import stage

    config = read_config(path)
    if config.get("model_type") == "gpt2":
        convert, name, mla = hf_gpt2_to_full, "GPT-2", False
    else:
        family = hf_llama.family_of(config, path)
        name, mla = family.architecture, family.mla
        convert = partial(hf_deepseek.hf_to_full, mtp_num_layers=mtp_num_layers) if mla \
            else hf_llama.hf_to_full
    if mtp_num_layers and not mla:
        raise ValueError(f"--mtp-num-layers: {name} has no MTP layers to import (DeepSeek-V3 "
                         f"has)")
    with stage(f"reading Hugging Face {name} {path}"):
        full = convert(path, make_vocab_size_divisible_by)
    left_out = full.common["converted_from"].get("mtp_layers_left_out")
    if left_out:
        print(f"note: {path} has {plural(left_out, 'MTP layer')}, left out: import "
              f"{'it' if left_out == 1 else 'them'} with --mtp-num-layers")
    return full, f"Hugging Face {name} {path}"


def from_hf(args, relayout_too: bool) -> int:
    import tempfile

    full, origin = read_hf(args.from_hf, args.make_vocab_size_divisible_by, args.mtp_num_layers)
    if not relayout_too:
        code = write_verified(full, args.save, 0, "--from-hf", f"from {origin}")
    else:  # written whole, then resharded as the target layout's ranks save it
        with tempfile.TemporaryDirectory(prefix="from_hf_") as staged:
            write_verified(full, staged, 0, "--from-hf", f"from {origin} (staged)")
            code = relayout(resolve_source(staged), args)
    write_flags(full.common["args"], args.save)
    return code


def write_flags(flags: dict, save: str) -> None:
    """SAVE/config.yaml: the flags of a model from Hugging Face, for training with --config."""
    import yaml

    path = os.path.join(save, "config.yaml")
    with open(path + ".tmp", "w") as handle:
        handle.write("# The flags of the model written by tools/convert_checkpoint.py;"
                     "\n# train it with --config this file --load this folder.\n")
        known = vars(settings.training_parser().parse_args([]))  # model_type is the script's
        yaml.safe_dump({key: value for key, value in flags.items()
                        if value is not None and key in known}, handle, sort_keys=False)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: train with --config {path} --load {save}")


def to_hf(source, args) -> int:
    import shutil

    from megatron_parm.checkpointing import hf_deepseek, hf_llama
    from megatron_parm.checkpointing.hf_files import parse_size, read_weights
    from megatron_parm.checkpointing.verify import compare_checksums, tensor_checksums
    from megatron_parm.training.log import stage

    max_shard = parse_size(args.max_shard_size)
    full = read_checkpoint(source[0])
    flags = saved_flags(full.common.get("args") or {})
    convert = hf_deepseek if flags.get("multi_latent_attention") else hf_llama
    with stage(f"writing {args.to_hf}"):
        config, tensors = convert.full_to_hf(full, flags, args.to_hf, max_shard)
    tokenizer = flags.get("tokenizer_model")
    if flags.get("tokenizer_type") == "HuggingFaceTokenizer" and tokenizer:
        for name in hf_llama.TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copy(os.path.join(tokenizer, name), os.path.join(args.to_hf, name))
    with stage(f"reading {args.to_hf} back and comparing every checksum"):
        problems = compare_checksums(tensor_checksums(tensors),
                                     tensor_checksums(read_weights(args.to_hf)))
        if problems:
            raise CheckpointError(f"{args.to_hf}: tensors did not make it across:\n  "
                                  + "\n  ".join(problems[:20]))
    print(f"wrote {args.to_hf} ({config['architectures'][0]}, {len(tensors)} tensors, "
          f"vocabulary {config['vocab_size']}) from {source[0]}")
    return 0


def read_dense(load, make_vocab_size_divisible_by: int):
    """(FullCheckpoint, description) of --load: a Hugging Face directory or one of ours."""
    if load and has_weights(load):
        return read_hf(load, make_vocab_size_divisible_by)
    folder = resolve_source(load)[0]
    return read_checkpoint(folder), folder


def upcycle(args) -> int:
    from megatron_parm.checkpointing.upcycle import upcycle as upcycle_full
    from megatron_parm.checkpointing.verify import crc32

    if not args.num_experts:
        raise ValueError("--upcycle needs --num-experts")
    dense, origin = read_dense(args.load, args.make_vocab_size_divisible_by)
    moe = upcycle_full(dense, args.num_experts, args.moe_router_topk, args.router_init_std,
                       args.seed)
    expected = checksums(moe.tensors, f"{args.num_experts} experts per layer")
    # Every expert of every layer must be the dense MLP of that layer.
    for name in ("linear_fc1.weight", "linear_fc2.weight", "linear_fc1.bias", "linear_fc2.bias"):
        if f"decoder.layers.mlp.{name}" not in dense.tensors:
            continue
        dense_sums = [crc32(w) for w in dense.tensors[f"decoder.layers.mlp.{name}"]]
        experts = expected[f"decoder.layers.mlp.experts.experts.{name}"]["experts"]
        for layer, row in enumerate(experts):
            bad = [e for e, value in enumerate(row) if value != dense_sums[layer]]
            if bad:
                raise CheckpointError(f"decoder.layers.mlp.experts.experts.{name}: layer "
                                      f"{layer} experts {bad} are not copies of the dense MLP")
    code = write_verified(moe, args.save, 0, "--upcycle",
                          f"with {args.num_experts} experts per layer (top-{args.moe_router_topk}) "
                          f"copied from {origin}", expected)
    if has_weights(args.load):  # a Hugging Face model's flags are nowhere else
        write_flags(moe.common["args"], args.save)
    return code


# ---------------------------------------------------------------------------------------------
# another layout: the target layout's ranks as local gloo processes
# ---------------------------------------------------------------------------------------------

def relayout(source, args) -> int:
    import math

    from megatron_parm.checkpointing import read_checkpoint_info
    from megatron_parm.checkpointing.full import verify_against
    from megatron_parm.checkpointing.paths import checkpoint_dir
    from megatron_parm.training.log import stage

    info = read_checkpoint_info(source[0])
    saved = info.get("args")
    if not saved:
        raise CheckpointError(f"{source[0]}: no saved flags (args) in common.pt: cannot build "
                              f"the model to reshard it")
    layout = info.get("layout") or {}
    tp = args.target_tensor_parallel_size or layout.get("tensor_model_parallel_size") or 1
    ep = args.target_expert_parallel_size or layout.get("expert_model_parallel_size") or 1
    etp = args.target_expert_tensor_parallel_size or tp
    pp = args.target_pipeline_parallel_size or layout.get("pipeline_model_parallel_size") or 1
    world = args.target_world_size or math.lcm(tp, ep * etp) * pp
    problem = relayout_problem(source[0], info, (tp, ep, etp, pp), world)
    if problem:  # every refusal before a process starts (the ranks would take a minute)
        raise ValueError(problem)
    expected = checksums(read_checkpoint(source[0]).tensors, "the source")
    with stage(f"resharding for tp={tp} ep={ep} etp={etp} pp={pp} on "
               f"{plural(world, 'local process', 'local processes')}"):
        run_ranks(world, source[0], args.save, (tp, ep, etp, pp), saved)
    path = checkpoint_dir(args.save, source[1])
    with stage(f"reading {path} back and comparing every checksum"):
        verify_against(path, expected, "conversion to the target layout")
    print(f"wrote {path} for tp={tp} ep={ep} etp={etp} pp={pp} ({plural(world, 'rank')}) from {source[0]}: "
          f"{_summary(expected)}")
    return 0


def relayout_problem(path: str, info: dict, layout, world: int):
    """Why the checkpoint at PATH (its common part INFO) cannot be rewritten in LAYOUT (tp, ep,
    etp, pp) on WORLD ranks, naming this tool's flags; None when it can. Everything the target
    layout's ranks would refuse, found without starting them."""
    from megatron_parm.checkpointing.optimizer_state import DP_RESHARDABLE, saved_sharding
    from megatron_parm.checkpointing.state import RESHARDABLE_FLAG, describe_layout
    from megatron_parm.layout_rules import model_problem, pipeline_stage_layers
    from megatron_parm.parallel import validate_layout

    tp, ep, etp, pp = layout
    saved = saved_flags(info["args"])
    if saved_sharding(info) == DP_RESHARDABLE and info.get("optimizer_step") is not None:
        return (f"--load {path}: its distributed-optimizer state was saved in the dp-reshardable "
                f"format ({describe_layout(info.get('layout'))}), which loads only at the tp, "
                f"pp, ep and etp it was saved at, with --use-distributed-optimizer (at any "
                f"data-parallel size: no conversion needed for that); to convert, resume it "
                f"once in its layout with --use-distributed-optimizer {RESHARDABLE_FLAG} "
                f"--save, and convert that checkpoint")
    problem = None
    try:
        validate_layout(world, tp, ep, etp, saved.get("num_experts"), pp=pp)
        problem = pipeline_stage_layers(saved["num_layers"], pp)
        problem = problem if isinstance(problem, str) else model_problem(
            tp, ep, etp, num_attention_heads=saved["num_attention_heads"],
            seq_length=saved["seq_length"], sequence_parallel=tp > 1,
            num_experts=saved.get("num_experts"),
            moe_ffn_hidden_size=saved.get("moe_ffn_hidden_size") or saved.get("ffn_hidden_size"),
            add_bias_linear=not saved.get("disable_bias_linear"))
    except ValueError as err:
        problem = str(err)
    padded_vocab = (info.get("model_info") or {}).get("padded_vocab_size")
    if problem is None and padded_vocab and padded_vocab % tp:
        problem = (f"the checkpoint's padded vocabulary ({padded_vocab} rows, fixed when it "
                   f"was saved) is not divisible by --tensor-model-parallel-size {tp}")
    if problem:
        for flag, target_flag in TARGET_FLAGS.items():
            problem = problem.replace(flag, target_flag)
        return f"target layout ({plural(world, 'rank')}, --target-world-size): {problem}"
    from megatron_parm.training.model import build_config  # Megatron-Core: seconds to import

    try:  # Megatron-Core's own checks of the model against the layout
        build_config(target_args(saved, layout, world))
    except (ValueError, AssertionError) as err:
        return (f"target layout tp={tp} ep={ep} etp={etp} pp={pp} does not fit the model in "
                f"{path}: {err}")
    return None


def run_ranks(world: int, source: str, target_root: str, layout, saved) -> None:
    """The target layout's WORLD ranks as processes forked from this one: they inherit its
    imported torch and Megatron-Core (importing them is most of a small conversion's time:
    docs/checkpoints.md); a rank's CheckpointError is raised here."""
    import torch.multiprocessing as mp

    import megatron_parm.training.trainer  # noqa: F401 (what the ranks import, imported once)

    # A fork copies what is buffered: write it once, here.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    context = mp.get_context("fork")
    errors = context.SimpleQueue()  # a rank's CheckpointError, as text
    try:
        mp.start_processes(_relayout_worker, nprocs=world, join=True, start_method="fork",
                           args=(world, _free_port(), source, target_root, layout, saved,
                                 errors))
    except mp.ProcessExitedException as err:
        if err.exit_code != cli.USER_ERROR or errors.empty():
            raise
        raise CheckpointError(errors.get()) from None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def target_args(saved: dict, layout, world: int) -> Namespace:
    """The training flags of the target layout's ranks: the saved ones, in LAYOUT (tp, ep,
    etp, pp; the layers split evenly over the stages, not interleaved)."""
    from megatron_parm import settings

    tp, ep, etp, pp = layout
    args = Namespace(**saved_flags(saved))
    # what the saving run's checkpoint flags asked of its saves and loads (--ckpt-format torch,
    # --finetune, --no-save-optim, ...) is not the conversion's: a whole torch_dist copy
    for name in settings.group("checkpoints"):
        setattr(args, settings.FLAGS[name].key, settings.FLAGS[name].default)
    args.tensor_model_parallel_size, args.expert_model_parallel_size = tp, ep
    args.expert_tensor_parallel_size = etp
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = pp, None
    args.num_layers_per_virtual_pipeline_stage = None
    args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    args.account_for_embedding_in_pipeline_split = False
    args.account_for_loss_in_pipeline_split = False
    args.sequence_parallel = tp > 1  # no weights depend on it; Megatron's alltoall needs it
    args.moe_token_dispatcher_type = "alltoall"
    args.use_distributed_optimizer = False
    args.data_parallel_size = world // (tp * pp)
    args.override_opt_param_scheduler = False
    args.use_checkpoint_opt_param_scheduler = True  # a conversion keeps the schedule as saved
    return args


def saved_flags(saved: dict) -> dict:
    """A checkpoint's saved flags, with the declared default of each flag it predates (a
    checkpoint of an earlier version) and old names under their current ones."""
    from megatron_parm import settings

    saved = dict(saved)
    if "layernorm_epsilon" in saved:  # --norm-epsilon's name before today's architectures
        saved.setdefault("norm_epsilon", saved.pop("layernorm_epsilon"))
    return {**vars(settings.training_parser().parse_args([])), **saved}


def _relayout_worker(rank, world, port, source, target_root, layout, saved, errors):
    """One rank of the target layout: load SOURCE, save it under TARGET_ROOT. A CheckpointError
    goes to ERRORS and the rank exits with cli.USER_ERROR; the parent raises it."""
    os.environ["RANK"] = str(rank)
    cli.setup_warnings()  # rank 0 shows each warning once, the others none
    try:
        _relayout_rank(rank, world, port, source, target_root, layout, saved)
    except ValueError as err:
        if not cli.is_user_error(err):
            raise
        errors.put(str(err))
        sys.exit(cli.USER_ERROR)


def _relayout_rank(rank, world, port, source, target_root, layout, saved):
    import torch

    torch.set_num_threads(1)  # one thread per rank (torchrun's default), and no OpenMP pool
    # of the parent's to inherit in a forked process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from megatron_parm.checkpointing import load_checkpoint, read_checkpoint_info, save_checkpoint
    from megatron_parm.parallel import initialize_model_parallel
    from megatron_parm.training.model import build_model_chunks
    from megatron_parm.training.trainer import (
        build_model_and_optimizer,
        initialize_distributed,
        set_seed,
    )

    tp, ep, etp, pp = layout
    args = target_args(saved, layout, world)
    initialize_distributed()
    initialize_model_parallel(tp, ep, etp, args.num_experts, args.moe_token_dispatcher_type,
                              pp=pp)
    set_seed(args.seed)
    info = read_checkpoint_info(source)
    padded_vocab = info["model_info"]["padded_vocab_size"]
    vocab = info["model_info"].get("vocab_size") or padded_vocab
    if info.get("optimizer_step") is not None:
        model, optimizer, scheduler = build_model_and_optimizer(args, vocab, padded_vocab)
    else:  # a model only (converted, upcycled, imported): nothing to build an optimizer for
        model, optimizer, scheduler = build_model_chunks(args, vocab, padded_vocab), None, None
    loaded = load_checkpoint(source, model, optimizer, scheduler, args)
    has_optimizer = loaded["optimizer_loaded"]
    save_checkpoint(target_root, loaded["iteration"], model, optimizer if has_optimizer else None,
                    scheduler if has_optimizer else None, loaded["consumed_samples"], args,
                    save_rng=False)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    cli.run(main)
