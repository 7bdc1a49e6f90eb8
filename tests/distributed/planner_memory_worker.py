"""Measures what the planner's memory model predicts, on the model Megatron-Core builds.

    torchrun --nproc-per-node 4 tests/distributed/planner_memory_worker.py CASES.json OUT.json

CASES.json: a list of {"config", "model_type", "tp", "ep", "etp", "dispatcher", "flags",
"meta"}. For each case every rank builds the model (training/model.py) in that layout and
reports its parameter count; with "meta" the model is built on the meta device (no memory,
for the big configs), otherwise one forward of a synthetic micro-batch runs under
torch.autograd.graph.saved_tensors_hooks and the rank reports the bytes of the distinct
storages autograd saved for backward (parameters excluded): the activation memory of one
micro-batch. Rank 0 writes OUT.json: one record per case with per-rank lists.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker  # noqa

from megatron_parm.data.tokenizers import build_tokenizer  # noqa: E402
from megatron_parm.parallel import initialize_model_parallel  # noqa: E402
from megatron_parm.training import model as model_module  # noqa: E402
from megatron_parm.training.arguments import parse_args  # noqa: E402
from megatron_parm.training.trainer import initialize_distributed, set_seed  # noqa: E402


def build(args, vocab_size: int, meta: bool):
    if not meta:
        return model_module.build_model(args, vocab_size)
    config = model_module.build_config(args)
    config.perform_initialization = False
    original = model_module.build_config
    model_module.build_config = lambda _: config
    try:
        with torch.device("meta"):
            return model_module.build_model(args, vocab_size)
    finally:
        model_module.build_config = original


def synthetic_batch(args, vocab_size: int):
    b, s = args.micro_batch_size, args.seq_length
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab_size, (b, s), generator=generator)
    if args.model_type == "gpt":
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        return {"tokens": tokens, "labels": tokens.roll(-1, dims=1),
                "position_ids": torch.arange(s).unsqueeze(0).repeat(b, 1),
                "attention_mask": causal.view(1, 1, s, s).repeat(b, 1, 1, 1).contiguous(),
                "loss_mask": torch.ones(b, s)}
    return {"text": tokens, "labels": tokens, "types": torch.zeros(b, s, dtype=torch.long),
            "padding_mask": torch.ones(b, s, dtype=torch.long), "loss_mask": torch.ones(b, s),
            "is_random": torch.zeros(b, dtype=torch.long)}


def saved_activation_bytes(model, args, batch) -> int:
    """Bytes of the distinct storages autograd saves in one forward (parameters excluded)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameter_storages:
            saved.setdefault(pointer, storage.nbytes())
        return tensor

    forward_step = model_module.FORWARD_STEPS[args.model_type]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output, loss_func = forward_step(iter([batch]), model)
        loss, _ = loss_func(output)
    total = sum(saved.values())
    loss.backward()
    return total


def main(cases_path: str, out_path: str) -> None:
    initialize_distributed()
    with open(cases_path) as handle:
        cases = json.load(handle)
    world = torch.distributed.get_world_size()
    records = []
    for case in cases:
        argv = ["--config", case["config"], "--tensor-model-parallel-size", str(case["tp"]),
                "--expert-model-parallel-size", str(case["ep"]),
                "--expert-tensor-parallel-size", str(case["etp"]),
                "--moe-token-dispatcher-type", case.get("dispatcher", "alltoall"),
                *case.get("flags", [])]
        if case["tp"] > 1:
            argv.append("--sequence-parallel")
        args = parse_args(argv, model_type=case["model_type"], world_size=world)
        initialize_model_parallel(args.tensor_model_parallel_size,
                                  args.expert_model_parallel_size,
                                  args.expert_tensor_parallel_size, args.num_experts,
                                  args.moe_token_dispatcher_type)
        set_seed(args.seed)
        get_moe_layer_wise_logging_tracker().clear()  # sized by the previous case's layers
        vocab_size = build_tokenizer(args).vocab_size
        model = build(args, vocab_size, case.get("meta", False))
        record = dict(case, vocab_size=vocab_size,
                      parameters=sum(p.numel() for p in model.parameters()))
        if not case.get("meta", False):
            model.train()
            record["activation_bytes"] = saved_activation_bytes(model, args,
                                                                synthetic_batch(args, vocab_size))
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, record)
        records.append({**case, "vocab_size": vocab_size,
                        "parameters": [r["parameters"] for r in gathered],
                        "activation_bytes": [r.get("activation_bytes") for r in gathered]})
        del model
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(records, handle, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
