"""What one forward+backward of one MoE layer runs: operators, GEMMs, collectives, launches.

tools/count_ops.py is the command line; tests/unit/test_op_count.py holds S2's per-chunk
budget (docs/benchmark.md, "Per-chunk work").

A ``TorchDispatchMode`` sees every operator the layer runs, forward and backward (autograd's
own included), after PyTorch's composite operators are taken apart: what a GPU would launch,
less fusions, plus the host's bookkeeping. Each operator is sorted into one class:

    view     an alias of its input (view, slice, transpose, detach, ...): no data moves,
             no kernel; only the host pays (a few microseconds each)
    alloc    empty / new_empty / empty_like: memory only, no kernel
    host     an operator of the routing plan on the host: the code in HOST_FUNCTIONS
             (row_order's index arithmetic, S2's chunk plan, the RoutingPlan's sums) builds
             host tensors on purpose; on a GPU these never reach the device
    device   the rest: on a GPU each is a kernel (or a copy) launched by the host
    collective  a c10d operator (all_to_all_single, all_gather, ...) this rank issues

``gemms`` counts the matrix products among the device operators (mm, addmm, bmm,
_grouped_mm, ...). On a GPU (``device.is_cuda()``), ``kernels`` is what the profiler saw run
on the device in the same step (kernels, copies and memsets), and ``launches`` the host's
launch calls. Counts are per rank; a multi-rank run reports the largest over the ranks.

Per extra chunk (``per_chunk``): (count at c chunks - count at 1 chunk) / (c - 1).

Notation as in docs/design.md: S sequence length, B micro-batch, M hidden, F expert FFN, E
experts, k top-k; (t, e, s) the layout (TP, EP, ETP).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_parm.bench import moe_layer
from megatron_parm.bench.moe_layer import MoELayerSpec, parse_variant
from megatron_parm.dispatchers import base, parm_s2, row_order
from megatron_parm.layer import ParmMoELayer
from megatron_parm import device

# The expert modules counted side by side (megatron_parm.training.implementation's names).
EXPERT_MODULES = ("SequentialMLP", "TorchGroupedMLP")
# The dispatchers a count covers by default: S2 at 1/2/4/8 chunks gives its per-chunk work.
DEFAULT_DISPATCHERS = ("alltoall", "parm_s1", "parm_s2@1", "parm_s2@2", "parm_s2@4",
                       "parm_s2@8", "parm")

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_grouped_mm",
                   "_scaled_grouped_mm", "_scaled_mm"})
ALLOCATIONS = frozenset({"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"})
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})

# Code that computes the routing plan on the host (its operators never reach a GPU).
HOST_FUNCTIONS: tuple = (
    row_order.cut_bounds, row_order.cut, row_order.ranges, row_order.block_starts,
    row_order.inverse, row_order.is_identity,
    base.sort_order, base.RoutingPlan.mine, base.RoutingPlan.local_counts,
    base.RoutingPlan.a2a_input_splits, base.RoutingPlan.a2a_output_splits,
    base.RoutingPlan.etp_split_sizes, base.RoutingPlan.gathered_chunk_sizes,
    base.RoutingPlan.tokens_per_local_expert, base.RoutingPlan.expert_order,
    parm_s2.plan_direction, parm_s2.ChunkPlan.__init__,
)
# ... less the one transfer of its indices to the rows' device (a device copy).
DEVICE_FUNCTIONS: tuple = (row_order.to_device,)
KINDS = ("view", "alloc", "host", "device", "collective")


def _codes(functions: Iterable[Callable]) -> frozenset:
    return frozenset(f.__code__ for f in functions)


_HOST_CODES = _codes(HOST_FUNCTIONS)
_DEVICE_CODES = _codes(DEVICE_FUNCTIONS)


def _is_view(func) -> bool:
    """True for an operator whose result aliases an input without writing it."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _in_host_plan() -> bool:
    """Whether the operator being dispatched was called from the host plan's code."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _DEVICE_CODES:
            return False
        if frame.f_code in _HOST_CODES:
            return True
        frame = frame.f_back
    return False


def classify(func) -> str:
    """One of KINDS for an operator being dispatched (see the module docstring)."""
    if func.namespace in COLLECTIVE_NAMESPACES:
        return "collective"
    name = func.overloadpacket.__name__
    if _is_view(func):
        return "view"
    if name in ALLOCATIONS:
        return "alloc"
    if _in_host_plan():
        return "host"
    return "device"


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active, by (kind, operator name)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[(classify(func), func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Count:
    """One configuration's operators in one forward+backward (one rank's, or the largest)."""

    dispatcher: str
    experts: str
    by_kind: Dict[str, int]
    gemms: int
    by_op: Dict[str, int] = field(default_factory=dict)  # "kind:name" -> count
    kernels: Optional[int] = None  # GPU only: what ran on the device
    launches: Optional[int] = None  # GPU only: the host's launch calls

    @property
    def ops(self) -> int:
        return sum(self.by_kind.values())

    @property
    def device(self) -> int:
        return self.by_kind.get("device", 0)

    @property
    def collectives(self) -> int:
        return self.by_kind.get("collective", 0)

    def row(self) -> Dict[str, object]:
        return dict(dispatcher=self.dispatcher, experts=self.experts, ops=self.ops,
                    device=self.device, gemms=self.gemms, collectives=self.collectives,
                    host=self.by_kind.get("host", 0), view=self.by_kind.get("view", 0),
                    alloc=self.by_kind.get("alloc", 0), kernels=self.kernels,
                    launches=self.launches)


def chunks_of(variant: str) -> Optional[int]:
    """The forward chunk count of a variant (``parm_s2@4`` -> 4), None for other names."""
    return parse_variant(variant)[1]


def per_chunk(counts: Dict[str, Count], variant: str, quantity: str = "device") -> Optional[float]:
    """What each chunk beyond the first adds to ``quantity`` (a key of Count.row()): from the
    variant's count and the same schedule's at one chunk in ``counts``; None where either
    is missing or the variant has one chunk."""
    name, chunks, _ = parse_variant(variant)
    one = f"{name}@1"
    if not chunks or chunks == 1 or one not in counts or variant not in counts:
        return None
    extra = counts[variant].row()[quantity] - counts[one].row()[quantity]
    return extra / (chunks - 1)


def build_layer(spec: MoELayerSpec, variant: str, experts: str = "SequentialMLP",
                seed: int = 1234) -> ParmMoELayer:
    """The layer with a dispatcher (or ``parm_s2@C[/B]``) and an expert module of
    EXPERT_MODULES, on this rank's device; the same seed gives every build the same router."""
    if experts not in EXPERT_MODULES:
        raise ValueError(f"experts: {experts!r} is not one of {', '.join(EXPERT_MODULES)}")
    torch.manual_seed(seed)
    return moe_layer.build_layer(dataclasses.replace(spec, expert_impl=experts), variant)


def layer_input(spec: MoELayerSpec, seed: int = 99):
    """This rank's input and output gradient (a generator seeded per rank)."""
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x, grad = (torch.randn(spec.local_input_shape(), generator=gen) for _ in range(2))
    return (x.to(device.current(), spec.params_dtype), grad.to(device.current(), spec.params_dtype))


def step(layer: ParmMoELayer, x: torch.Tensor, grad: torch.Tensor) -> None:
    """One forward + backward."""
    out, _ = layer(x.detach().requires_grad_())
    out.backward(grad)


def count_step(layer: ParmMoELayer, x: torch.Tensor, grad: torch.Tensor) -> collections.Counter:
    """(kind, operator) -> count of one forward+backward (after one uncounted step, which
    makes what a layer builds once: parm's choice, Megatron's caches)."""
    step(layer, x, grad)
    layer.zero_grad(set_to_none=True)
    with OpCounter() as counter:
        step(layer, x, grad)
    layer.zero_grad(set_to_none=True)
    return counter.counts


def count_kernels(layer: ParmMoELayer, x: torch.Tensor, grad: torch.Tensor):
    """GPU only: (kernels that ran on the device, the host's launch calls) in one step,
    from the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(layer, x, grad)
        device.synchronize()
    layer.zero_grad(set_to_none=True)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    launches = sum(1 for e in events if e.device_type == DeviceType.CPU and
                   e.name.startswith(("cudaLaunch", "cuLaunch", "cudaMemcpy", "cudaMemset",
                                      "cudaGraphLaunch")))
    return kernels, launches


def _largest_over_ranks(counts: collections.Counter) -> collections.Counter:
    if dist.get_world_size() == 1:
        return counts
    gathered: List[Optional[Dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(counts))
    out: collections.Counter = collections.Counter()
    for rank_counts in gathered:
        for key, value in rank_counts.items():
            out[key] = max(out[key], value)
    return out


def count(spec: MoELayerSpec, variant: str, experts: str, kernels: bool = True) -> Count:
    """The operators of one forward+backward of the layer; with a GPU and ``kernels``, also
    its kernels and launches."""
    layer = build_layer(spec, variant, experts)
    x, grad = layer_input(spec)
    ops = _largest_over_ranks(count_step(layer, x, grad))
    by_kind = {kind: sum(v for (k, _), v in ops.items() if k == kind) for kind in KINDS}
    gemms = sum(v for (k, name), v in ops.items() if k == "device" and name in GEMMS)
    result = Count(variant, experts, by_kind, gemms,
                   by_op={f"{k}:{name}": v for (k, name), v in sorted(ops.items())})
    if kernels and device.is_cuda():
        result.kernels, result.launches = count_kernels(layer, x, grad)
    return result


def count_all(spec: MoELayerSpec, variants: Sequence[str] = DEFAULT_DISPATCHERS,
              experts: Sequence[str] = EXPERT_MODULES, kernels: bool = True) -> Dict[str, Dict[str, Count]]:
    """experts -> variant -> Count, for every pair."""
    return {impl: {variant: count(spec, variant, impl, kernels) for variant in variants}
            for impl in experts}


# ---------------------------------------------------------------------------------------
# time: what the count does not show
# ---------------------------------------------------------------------------------------


def time_steps(layers: Dict[str, ParmMoELayer], x: torch.Tensor, grad: torch.Tensor,
               passes: int = 3, iters: int = 5, warmup: int = 2,
               clock: str = "wall") -> Dict[str, List[float]]:
    """Seconds per forward+backward: per layer, the median of each pass. Layers run
    interleaved (each iteration runs every one once), so drift hits all alike; a step's
    time is the slowest rank's. ``clock`` "cpu" (CPU only): this process's CPU time instead
    of wall time, which other processes on a shared machine do not inflate (with one
    intra-op thread it is the step's own work)."""
    if clock not in ("wall", "cpu") or (clock == "cpu" and device.is_cuda()):
        raise ValueError(f"clock: {clock!r} is not 'wall' or, on CPU, 'cpu'")
    medians: Dict[str, List[float]] = {key: [] for key in layers}
    for key in layers:
        for _ in range(warmup):
            step(layers[key], x, grad)
            layers[key].zero_grad(set_to_none=True)
    for _ in range(passes):
        times: Dict[str, List[float]] = {key: [] for key in layers}
        for _ in range(iters):
            for key, layer in layers.items():
                if dist.get_world_size() > 1:
                    dist.barrier()
                if clock == "cpu":
                    start = time.process_time()
                    step(layer, x, grad)
                    elapsed = torch.tensor([time.process_time() - start])
                else:
                    timer = device.Timer().start()
                    step(layer, x, grad)
                    elapsed = torch.tensor([timer.stop()])
                if dist.get_world_size() > 1:
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[key].append(elapsed.item())
                layer.zero_grad(set_to_none=True)
        for key in layers:
            medians[key].append(statistics.median(times[key]))
    return medians


def time_layers(spec: MoELayerSpec, variants: Sequence[str], experts: Sequence[str],
                passes: int = 3, iters: int = 5, warmup: int = 2,
                clock: str = "wall") -> Dict[str, List[float]]:
    """"experts/variant" -> per-pass median seconds of one forward+backward, interleaved."""
    layers = {f"{impl}/{variant}": build_layer(spec, variant, impl)
              for impl in experts for variant in variants}
    x, grad = layer_input(spec)
    return time_steps(layers, x, grad, passes, iters, warmup, clock)


def chunk_plan_seconds(spec: MoELayerSpec, chunk_counts: Sequence[int], repeats: int = 50,
                       seed: int = 5) -> Dict[int, float]:
    """Host CPU seconds to build S2's chunk plan (``parm_s2.ChunkPlan``) per chunk count, for a
    routing like the layer's (world size 1: one rank's counts of S * B * k rows over E
    experts); the median of ``repeats`` builds."""
    gen = torch.Generator().manual_seed(seed)
    rows = spec.seq_length * spec.micro_batch_size * spec.topk
    experts = torch.randint(0, spec.num_experts, (rows,), generator=gen)
    counts = torch.bincount(experts, minlength=spec.num_experts).view(1, 1, -1)
    plan = base.RoutingPlan(counts, 0, 0, spec.num_experts)
    out = {}
    for chunks in chunk_counts:
        times = []
        for _ in range(repeats):
            start = time.process_time()
            parm_s2.ChunkPlan(plan, chunks, chunks, device.current())
            times.append(time.process_time() - start)
        out[chunks] = statistics.median(times)
    return out
