"""S2 with TorchGroupedMLP's deferred weight gradients against alltoall, at world size 1.

    torchrun --nproc-per-node 1 tests/distributed/deferred_wgrad_worker.py OUT.json

For each S2 chunking (forward/backward chunk counts), the same layer twice: the experts'
weight gradients deferred (computed once after the last chunk, as S2 runs them) and per
chunk (``experts.defer_weight_grads = False``: every chunk's graph accumulates them, as
SequentialMLP's do). Each against alltoall from the same seed and weights: output, input
gradient and every parameter gradient; how often each expert weight's gradient is
accumulated per backward (a post-accumulate-grad hook); and a second forward+backward
without zeroing (gradient accumulation). Also S2 with fewer rows than sub-chunks (empty
sub-chunks). OUT.json: one record per (variant, mode).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VARIANTS = ["parm_s2@1", "parm_s2@2", "parm_s2@4", "parm_s2@3/2", "parm_s2@2/4"]
WEIGHTS = ("experts.weight1", "experts.weight2")
FEW_ROWS = 2  # fewer rows than S2's sub-chunks


def run(layer, x, grad, steps=1):
    """{quantity: tensor} after `steps` forward+backward passes from zeroed gradients, and
    the number of accumulations into each expert weight's .grad."""
    layer.zero_grad(set_to_none=True)
    params = dict(layer.named_parameters())
    hits = {name: 0 for name in WEIGHTS}
    handles = [params[name].register_post_accumulate_grad_hook(
        lambda _, name=name: hits.__setitem__(name, hits[name] + 1)) for name in WEIGHTS]
    x = x.detach().requires_grad_()
    for _ in range(steps):
        out, _ = layer(x)
        out.backward(grad)
    for handle in handles:
        handle.remove()
    found = {"y": out.detach(), "x": x.grad}
    found.update({name: p.grad.clone() for name, p in params.items() if p.grad is not None})
    return found, {name: count / steps for name, count in hits.items()}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def compare(spec, variants, records) -> None:
    """Each variant, deferred and per chunk, against alltoall: one record per (variant, mode)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_parm.bench.op_count import build_layer, layer_input

    model_parallel_cuda_manual_seed(1234)
    x, grad = layer_input(spec)
    reference = build_layer(spec, "alltoall", "TorchGroupedMLP")
    ref, _ = run(reference, x, grad)
    ref2, _ = run(reference, x, grad, steps=2)
    for variant in variants:
        found = {}
        for mode in ("deferred", "per_chunk"):
            layer = build_layer(spec, variant, "TorchGroupedMLP")
            if mode == "per_chunk":
                layer.experts.defer_weight_grads = False
            found[mode], hits = run(layer, x, grad)
            twice, _ = run(layer, x, grad, steps=2)
            records.append(dict(
                variant=variant, mode=mode, dtype=str(spec.params_dtype).split(".")[-1], hits=hits,
                rows=x.shape[0] * x.shape[1] * spec.topk,
                quantities=sorted(found[mode]), reference=sorted(ref),
                err={q: rel_err(t, ref[q]) for q, t in found[mode].items() if q in ref},
                err_accumulated={q: rel_err(t, ref2[q]) for q, t in twice.items() if q in ref2},
                equal_reference={q: torch.equal(t, ref[q]) for q, t in found[mode].items() if q in ref}))
        records[-2]["equal_per_chunk"] = {q: torch.equal(t, found["per_chunk"][q])
                                          for q, t in found["deferred"].items()}


def main(out_path: str) -> None:
    from megatron_parm import mcore_compat
    from megatron_parm.bench.moe_layer import MoELayerSpec
    from megatron_parm.parallel import initialize_model_parallel

    dist.init_process_group("gloo")
    mcore_compat.setup()
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        spec = MoELayerSpec(seq_length=64, micro_batch_size=2, hidden_size=64, ffn_hidden_size=128,
                            num_experts=8, topk=2, params_dtype=dtype)
        for name in ("alltoall", "parm_s2"):
            initialize_model_parallel(1, 1, 1, num_experts=spec.num_experts, dispatcher=name)
        compare(spec, VARIANTS if dtype == torch.float32 else ["parm_s2@1", "parm_s2@4"], records)
    # FEW_ROWS rows in 4 sub-chunks: some are empty (as every one is on a rank whose experts
    # got no token); their graphs' backward runs too, the weights' hooks fire per chunk
    spec = MoELayerSpec(seq_length=FEW_ROWS, micro_batch_size=1, hidden_size=64,
                        ffn_hidden_size=128, num_experts=8, topk=1)
    compare(spec, ["parm_s2@2/4"], records)
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
