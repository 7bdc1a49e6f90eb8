"""Measures what the planner's memory model predicts, on the model Megatron-Core builds.

    torchrun --nproc-per-node 4 tests/distributed/planner_memory_worker.py CASES.json OUT.json

CASES.json: a list of {"config", "model_type", "tp", "ep", "etp", "pp", "dispatcher",
"flags", "meta"} (and "vocab_size" for a config whose tokenizer files are not shipped). For
each case every rank builds the model (training/model.py) in that layout, its pipeline stage's
part at pp > 1, and reports its parameter count; with "meta" the model is built on the meta
device (no memory, for the big configs), otherwise one forward of a synthetic micro-batch runs under
torch.autograd.graph.saved_tensors_hooks (SavedStorages) and the rank reports the bytes of the
distinct storages autograd saved for backward (parameters excluded), the activation memory of
one micro-batch, and the peak of those it held at once (the same, unless autograd drops some
during the forward). At pp > 1 the rank builds its stage as the trainer does
(build_model_and_optimizer), runs one training step's micro-batches (the flags'
--global-batch-size) through Megatron-Core's schedule (get_forward_backward_func) and reports
its stage, the peak of the bytes autograd held for backward and the most micro-batches whose
saved tensors it held at once. A case with "step" runs that training step at pp = 1 too, so
that the peak counts what activation recomputation saves again in the backward pass; with
"rss" the rank also reports the peak resident set of the step and its rise over what was
resident before (megatron_parm/bench/memory.py's exact CPU accounting). Rank 0 writes
OUT.json: one record per case with per-rank lists (MEASURED).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker)

from megatron_parm.bench.memory import exact_cpu_accounting, step_peak  # noqa: E402
from megatron_parm.data.tokenizers import build_tokenizer  # noqa: E402
from megatron_parm.parallel import initialize_model_parallel  # noqa: E402
from megatron_parm.training import model as model_module  # noqa: E402
from megatron_parm.training.arguments import parse_args  # noqa: E402
from megatron_parm.training.trainer import (  # noqa: E402
    build_model_and_optimizer, initialize_distributed, set_seed)


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


def synthetic_batch(args, vocab_size: int, seed: int = 1234):
    b, s = args.micro_batch_size, args.seq_length
    generator = torch.Generator().manual_seed(seed)
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


class _Held:
    """A tensor autograd saved, as its graph holds it: dropped with the graph's node."""

    def __init__(self, tensor):
        self.tensor = tensor


class SavedStorages:
    """The storages autograd saves for backward (parameters excluded), through
    saved_tensors_hooks(tracker.pack, tracker.unpack):

        distinct   {storage pointer: bytes} of every storage saved
        peak       the most bytes of storages held at once: a storage counts from the first
                   tensor saved in it until autograd drops the last (after its node's backward)
        peak_microbatches  the most micro-batches (forward steps, counted in `microbatch`)
                   with saved tensors held at once
    """

    def __init__(self, chunks):
        self.parameters = {p.untyped_storage().data_ptr() for chunk in chunks
                           for p in chunk.parameters()}
        self.distinct = {}
        self.held = {}  # storage pointer -> [bytes, saved tensors holding it]
        self.held_bytes = self.peak = 0
        self.microbatch = 0
        self.held_per_microbatch = {}  # micro-batch -> saved tensors held
        self.peak_microbatches = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.parameters:
            return tensor
        self.distinct.setdefault(pointer, storage.nbytes())
        entry = self.held.setdefault(pointer, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.held_bytes += entry[0]
            self.peak = max(self.peak, self.held_bytes)
        entry[1] += 1
        count = self.held_per_microbatch
        count[self.microbatch] = count.get(self.microbatch, 0) + 1
        self.peak_microbatches = max(self.peak_microbatches, len(count))
        held = _Held(tensor)
        weakref.finalize(held, self._drop, pointer, self.microbatch)
        return held

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _drop(self, pointer, microbatch):
        entry = self.held[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.held_bytes -= entry[0]
            del self.held[pointer]
        self.held_per_microbatch[microbatch] -= 1
        if self.held_per_microbatch[microbatch] == 0:
            del self.held_per_microbatch[microbatch]


def saved_activation_bytes(model, args, batch):
    """(bytes of the distinct storages autograd saves in one forward, the peak of those it
    holds): parameters excluded; the two agree unless autograd drops some during the
    forward."""
    tracker = SavedStorages([model])
    forward_step = model_module.FORWARD_STEPS[args.model_type]
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        output, loss_func = forward_step(iter([batch]), model)
        loss, _ = loss_func(output)
    total = sum(tracker.distinct.values())
    loss.backward()
    return total, tracker.peak


def pipelined_step(model, args, vocab_size: int) -> SavedStorages:
    """One training step (args.num_microbatches synthetic micro-batches) of this rank's stage
    through Megatron-Core's pipeline schedule, as the trainer runs it, under a SavedStorages
    tracker."""
    tracker = SavedStorages(model)
    forward_step = model_module.FORWARD_STEPS[args.model_type]

    def counted_forward_step(data_iterator, chunk):
        tracker.microbatch += 1
        return forward_step(data_iterator, chunk)

    batches = [synthetic_batch(args, vocab_size, seed=1234 + index)
               for index in range(args.num_microbatches)]
    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    # The plain backward of a previous case left Megatron-Core's aux-loss scale as a 0-dim
    # tensor, into which the schedule copies its [1]-shaped one: let the schedule make it.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        get_forward_backward_func()(
            forward_step_func=counted_forward_step, data_iterator=[iter(batches)],
            model=model, num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
    return tracker


MEASURED = ("parameters", "activation_bytes", "peak_bytes", "stage", "num_microbatches",
            "peak_microbatches", "process_groups", "rss_peak_bytes", "rss_step_bytes")


def measure(args, vocab_size: int, case: dict) -> dict:
    """This rank's MEASURED values for one case (those that apply)."""
    meta = case.get("meta", False)
    if (args.pipeline_model_parallel_size > 1 or case.get("step")) and not meta:
        model, _, _ = build_model_and_optimizer(args, vocab_size)
        record = {}
        if case.get("rss"):
            exact_cpu_accounting()
            trackers = []
            peak = step_peak(lambda: trackers.append(pipelined_step(model, args, vocab_size)))
            tracker = trackers[0]
            if peak is not None:
                record.update(rss_peak_bytes=peak.peak_bytes, rss_step_bytes=peak.step_bytes)
        else:
            tracker = pipelined_step(model, args, vocab_size)
        return {**record,
                "parameters": sum(p.numel() for chunk in model for p in chunk.parameters()),
                "peak_bytes": tracker.peak, "peak_microbatches": tracker.peak_microbatches,
                "stage": parallel_state.get_pipeline_model_parallel_rank(),
                "num_microbatches": args.num_microbatches}
    model = build(args, vocab_size, meta)
    record = {"parameters": sum(p.numel() for p in model.parameters()),
              "stage": parallel_state.get_pipeline_model_parallel_rank()}
    if not meta:
        model.train()
        record["activation_bytes"], record["peak_bytes"] = saved_activation_bytes(
            model, args, synthetic_batch(args, vocab_size))
    return record


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
                "--pipeline-model-parallel-size", str(case.get("pp", 1)),
                "--moe-token-dispatcher-type", case.get("dispatcher", "alltoall"),
                *case.get("flags", [])]
        if case["tp"] > 1:
            argv.append("--sequence-parallel")
        # a real-size config without its tokenizer files: the case gives the vocabulary
        given_vocab = case.get("vocab_size")
        args = parse_args(argv, model_type=case["model_type"], world_size=world,
                          reads_data=given_vocab is None)
        initialize_model_parallel(args.tensor_model_parallel_size,
                                  args.expert_model_parallel_size,
                                  args.expert_tensor_parallel_size, args.num_experts,
                                  args.moe_token_dispatcher_type,
                                  pp=args.pipeline_model_parallel_size)
        set_seed(args.seed)
        get_moe_layer_wise_logging_tracker().clear()  # sized by the previous case's layers
        vocab_size = given_vocab or build_tokenizer(args).vocab_size
        record = measure(args, vocab_size, case)
        record["process_groups"] = len(distributed_c10d._world.pg_map)
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, record)
        records.append({**case, "vocab_size": vocab_size,
                        **{key: [r.get(key) for r in gathered] for key in MEASURED}})
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(records, handle, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
