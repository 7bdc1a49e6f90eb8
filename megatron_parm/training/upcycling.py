"""--moe-use-upcycling: the first run of an MoE model starts from a dense checkpoint, as
Megatron-LM's training does it (tools/convert_checkpoint.py --upcycle does it offline).

    check_args(args, cuda)            what upcycling cannot start from (ValueError naming the
                                      flag), before any process group exists
    source(args)                      the dense checkpoint in --load and its padded vocabulary;
                                      --save must hold no checkpoint yet
    upcycle(checkpoint, model, optimizer, scheduler, args)
                                      the MoE model's weights from the dense checkpoint, saved
                                      to --save as iteration 1; returns (1, 0): the run goes on
                                      from iteration 1 with no sample consumed (Megatron-LM's)

What it does, on every rank for its own shards: build the dense model of the same flags
without experts (--ffn-hidden-size x --moe-upcycling-granularity wide, expert parallelism 1),
load the dense checkpoint into it, and let Megatron-Core's upcycling (upcycling_state_dict,
arXiv 2410.07524) fill the MoE model: every weight the two share is copied; each expert gets
one of the granularity slices of its layer's dense MLP, scaled so that the layer's output
stays the dense one's (with granularity 1 and the softmax after the top-k, plain copies: the
top-k probabilities sum to 1); the router keeps its own initialization. The generators are
back where the MoE model's initialization left them, so a run's dropout does not depend on
the dense model built on the side.

Megatron-LM 0.16.1 builds that dense model with the MoE run's --moe-ffn-hidden-size, which
its TransformerConfig refuses for a model without experts: here the dense model is built
without it, which is what Megatron-LM's upcycling means.
"""

from __future__ import annotations

import argparse
import copy
import os

from megatron_parm.layout_rules import moe_layer_pattern

def check_args(args, cuda: bool) -> None:
    """Refuse what Megatron-Core 0.16.1's upcycling cannot convert, in one line naming the
    flag (cuda: a GPU is usable, for the expert module's name)."""
    from megatron_parm.training.implementation import expert_implementation

    if not args.moe_use_upcycling:
        if args.moe_upcycling_granularity != 1:
            raise ValueError("--moe-upcycling-granularity needs --moe-use-upcycling")
        return
    if not args.load or not args.save:
        raise ValueError("--moe-use-upcycling needs --load (the dense checkpoint) and --save "
                         "(where the upcycled one goes)")
    if _same_folder(args.load, args.save):
        raise ValueError("--moe-use-upcycling: --load (the dense checkpoint) and --save (the "
                         "MoE run's) must be different folders")
    if args.expert_tensor_parallel_size != args.tensor_model_parallel_size:
        raise ValueError(f"--moe-use-upcycling needs --expert-tensor-parallel-size equal to "
                         f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}): "
                         f"Megatron-Core's upcycling gives each rank's experts its own shard of "
                         f"the dense MLP")
    if not all(moe_layer_pattern(args.moe_layer_freq, args.num_layers)):
        raise ValueError("--moe-use-upcycling needs an MoE layer in every layer (--moe-layer-freq "
                         "1): Megatron-Core's upcycling expands every dense MLP")
    experts = expert_implementation(args.transformer_impl, args.moe_grouped_gemm, cuda=cuda,
                                    bf16=args.bf16)
    if experts not in ("SequentialMLP", "TEGroupedMLP"):
        raise ValueError(f"--moe-use-upcycling with --moe-grouped-gemm ({experts}): "
                         f"Megatron-Core's upcycling fills SequentialMLP or TEGroupedMLP experts")
    if args.openai_gelu or args.quick_geglu:
        flag = "--openai-gelu" if args.openai_gelu else "--quick-geglu"
        raise ValueError(f"--moe-use-upcycling with {flag}: Megatron-Core's upcycling scales "
                         f"GELU, SwiGLU and squared-ReLU MLPs")
    _check_widths(args)


def _check_widths(args) -> None:
    dense_ffn = args.ffn_hidden_size * args.moe_upcycling_granularity
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if dense_ffn % moe_ffn:
        raise ValueError(f"--moe-use-upcycling: the dense MLP (--ffn-hidden-size x "
                         f"--moe-upcycling-granularity = {dense_ffn}) must split into experts of "
                         f"--moe-ffn-hidden-size ({moe_ffn})")
    slices = dense_ffn // moe_ffn
    if args.num_experts % slices:
        raise ValueError(f"--moe-use-upcycling: --num-experts ({args.num_experts}) must be a "
                         f"multiple of the {slices} slices of each dense MLP")


def _same_folder(first: str, second: str) -> bool:
    return os.path.abspath(first) == os.path.abspath(second)


def dense_args(args) -> argparse.Namespace:
    """The flags of the dense model upcycling starts from: the run's, without experts, the MLP
    --moe-upcycling-granularity times wider."""
    dense = copy.copy(args)
    dense.num_experts = None
    dense.moe_ffn_hidden_size = None
    dense.ffn_hidden_size = args.ffn_hidden_size * args.moe_upcycling_granularity
    dense.expert_model_parallel_size = 1
    dense.expert_tensor_parallel_size = args.tensor_model_parallel_size
    dense.moe_layer_freq = 1
    dense.moe_shared_expert_intermediate_size = None
    dense.moe_shared_expert_gate = dense.moe_shared_expert_overlap = False
    dense.overlap_moe_expert_parallel_comm = dense.delay_wgrad_compute = False
    dense.moe_grouped_gemm = dense.moe_layer_recompute = False
    if args.recompute_modules:
        dense.recompute_modules = [name for name in args.recompute_modules
                                   if name not in ("moe", "moe_act", "shared_experts")]
        if args.recompute_granularity == "selective" and not dense.recompute_modules:
            dense.recompute_granularity, dense.recompute_modules = None, None
    return dense


def source(args):
    """(the dense checkpoint (folder, iteration) in --load, its padded vocabulary); refuses a
    --save that already holds a checkpoint (upcycling is for the first run only)."""
    from megatron_parm.checkpointing import read_checkpoint_info
    from megatron_parm.checkpointing.errors import CheckpointError
    from megatron_parm.checkpointing.paths import list_checkpoints, read_tracker, resolve_load
    from megatron_parm.checkpointing.save_load import Found

    if os.path.isdir(args.save) and (read_tracker(args.save) is not None
                                     or list_checkpoints(args.save)):
        raise CheckpointError(f"--moe-use-upcycling: --save {args.save} already holds a "
                              f"checkpoint; upcycling is for the first run only (resume without "
                              f"--moe-use-upcycling)")
    # no fresh start: the dense model is where the run starts
    checkpoint = Found(*resolve_load(args.load), pretrained=False)
    info = read_checkpoint_info(checkpoint.path)
    if (info.get("args") or {}).get("num_experts"):
        raise CheckpointError(f"--moe-use-upcycling: {checkpoint.path} already has experts "
                              f"(--num-experts {info['args']['num_experts']}); upcycling starts "
                              f"from a dense checkpoint")
    return checkpoint, (info.get("model_info") or {}).get("padded_vocab_size")


def upcycle(checkpoint, model, optimizer, scheduler, args):
    """The MoE model (this rank's DDP chunks) from the dense CHECKPOINT, saved to --save as
    iteration 1 (model and schedule: the optimizer has taken no step); returns (1, 0), the
    iteration and consumed samples the run goes on from. Collective."""
    import torch
    from megatron.core.transformer.moe.upcycling_utils import upcycle_state_dict

    from megatron_parm.checkpointing import load_checkpoint, save_checkpoint
    from megatron_parm.checkpointing import rng
    from megatron_parm.checkpointing.state import model_chunks
    from megatron_parm.training.model import build_model_chunks

    state = rng.capture()
    first = model_chunks(model)[0]
    dense_flags = dense_args(args)
    dense = build_model_chunks(dense_flags, first.tokenizer_vocab_size, first.vocab_size)
    load_checkpoint(checkpoint.path, dense, None, None, dense_flags)
    for chunk, dense_chunk in zip(model_chunks(model), model_chunks(dense)):
        chunk.load_state_dict(upcycle_state_dict([chunk], [dense_chunk])["model"])
    del dense
    rng.restore(state)
    if optimizer is not None and (args.bf16 or args.fp16):
        optimizer.reload_model_params()  # the fp32 main parameters from the upcycled weights
    save_checkpoint(args.save, 1, model, optimizer, scheduler, 0, args)
    torch.distributed.barrier()
    return 1, 0
