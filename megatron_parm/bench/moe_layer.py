"""One MoE layer, built alone and timed: what tools/bench_moe_layer.py and the tests share.

Notation: S sequence length, B micro-batch, M hidden, F expert FFN hidden, E experts,
k top-k; (t, e, s) the layout (TP, EP, ETP).

Layers, inputs and gradients live on megatron_parm.device.current() (the GPU where
there is one) and steps are timed with the seam's Timer (CUDA events on GPUs, perf_counter on
CPU), so that a step's time is the device's time on both.

Dispatchers are given by name, or, for a chunked schedule, as a *variant* with its chunk
counts: ``parm_s2@4`` (4 chunks both ways) or ``parm_s2@8/4`` (8 forward, 4 backward).

The experts are the spec's ``expert_impl``, one of
megatron_parm.training.implementation.EXPERT_IMPLS (SequentialMLP by default;
TorchGroupedMLP, GroupedMLP, TEGroupedMLP); time_experts runs several side by side, their
weights made equal across implementations (copy_weights).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_parm import schedules
from megatron_parm.bench.memory import step_peak
from megatron_parm.bench.native_accounting import account_native_dispatchers
from megatron_parm.comm.accounting import track_comm
from megatron_parm.config import ParmTransformerConfig
from megatron_parm.layer import ParmMoELayer
from megatron_parm.perf_model.calibrate import layer_fit_schedules
from megatron_parm import device
from megatron_parm import settings
from megatron_parm.specs import layer_spec
from megatron_parm.training.implementation import (EXPERT_IMPLS, expert_impl_flags,
                                                   expert_impl_problem)


@dataclass
class MoELayerSpec:
    seq_length: int = 256
    micro_batch_size: int = 2
    hidden_size: int = 256
    ffn_hidden_size: int = 512
    num_experts: int = 8
    topk: int = 2
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    tp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = True
    num_chunks: Optional[int] = None  # None: each chunked schedule's default
    bwd_num_chunks: Optional[int] = None  # None: the forward count
    parm_profile: Optional[str] = None
    aux_loss_coeff: float = 0.0
    params_dtype: torch.dtype = torch.float32
    expert_impl: str = EXPERT_IMPLS[0]  # the expert module (implementation.EXPERT_IMPLS)
    # Conveniences for grids (applied by ``resolved``): "tp,ep,etp" sets the three sizes, and
    # tokens per rank entering the layer sets seq_length for the layout and micro-batch.
    layout: Optional[str] = None
    tokens_per_rank: Optional[int] = None
    extra: Dict = field(default_factory=dict)

    def resolved(self) -> "MoELayerSpec":
        """The spec with ``layout`` and ``tokens_per_rank`` applied (ValueError naming the field)."""
        spec = dataclasses.replace(self)
        if spec.layout is not None:
            try:
                spec.tp, spec.ep, spec.etp = (int(v) for v in str(spec.layout).split(","))
            except ValueError:
                raise ValueError(f"layout: expected 'tp,ep,etp', got {spec.layout!r}") from None
        if spec.tokens_per_rank is not None:
            shards = spec.tp if (spec.sequence_parallel and spec.tp > 1) else 1
            if spec.tokens_per_rank * shards % spec.micro_batch_size:
                raise ValueError(f"tokens_per_rank: {spec.tokens_per_rank} x {shards} sequence "
                                 f"shards is not a multiple of micro_batch_size {spec.micro_batch_size}")
            spec.seq_length = spec.tokens_per_rank * shards // spec.micro_batch_size
        return spec

    def config(self, dispatcher: str) -> ParmTransformerConfig:
        transformer_impl, grouped_gemm = expert_impl_flags(self.expert_impl)
        return ParmTransformerConfig(
            num_layers=1, hidden_size=self.hidden_size, num_attention_heads=4,
            ffn_hidden_size=self.ffn_hidden_size, moe_ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_experts, moe_router_topk=self.topk,
            moe_router_pre_softmax=self.topk == 1, moe_token_dispatcher_type=dispatcher,
            tensor_model_parallel_size=self.tp, expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=self.sequence_parallel and self.tp > 1,
            moe_aux_loss_coeff=self.aux_loss_coeff, moe_expert_capacity_factor=self.capacity_factor,
            moe_pad_expert_input_to_capacity=self.pad_to_capacity, use_cpu_initialization=True,
            add_bias_linear=False, params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16, parm_num_chunks=self.num_chunks,
            parm_bwd_num_chunks=self.bwd_num_chunks, parm_profile=self.parm_profile,
            moe_grouped_gemm=grouped_gemm, transformer_impl=transformer_impl, **self.extra)

    def expert_problem(self) -> Optional[str]:
        """Why this machine cannot build the spec's expert_impl (None: it can)."""
        return expert_impl_problem(self.expert_impl, cuda=device.is_cuda(),
                                   dtype=dtype_name(self.params_dtype),
                                   num_experts=self.num_experts, hidden_size=self.hidden_size,
                                   ffn_per_rank=self.ffn_hidden_size // self.etp)

    def local_input_shape(self):
        """This rank's layer input [S/t, B, M] (or [S, B, M] replicated without SP)."""
        rows = self.seq_length // self.tp if (self.sequence_parallel or self.tp == 1) else self.seq_length
        return (rows, self.micro_batch_size, self.hidden_size)


LAYER_FLAGS = ("--tensor-model-parallel-size", "--expert-model-parallel-size",
               "--expert-tensor-parallel-size", "--sequence-parallel", "--seq-length",
               "--micro-batch-size", "--hidden-size", "--moe-ffn-hidden-size", "--num-experts",
               "--moe-router-topk", "--moe-expert-capacity-factor",
               "--moe-pad-expert-input-to-capacity")


def add_layer_args(p, *, seq_length: int, hidden_size: int, moe_ffn_hidden_size: int) -> None:
    """One MoE layer's layout and shape, with Megatron-LM's flag names (the layer tools:
    bench_moe_layer, count_ops; declared in megatron_parm.settings); the sizes' defaults are
    each tool's own."""
    settings.add_flags(p, LAYER_FLAGS, defaults={
        "seq_length": seq_length, "micro_batch_size": 2, "hidden_size": hidden_size,
        "moe_ffn_hidden_size": moe_ffn_hidden_size, "num_experts": 8})


def dtype_name(dtype: torch.dtype) -> str:
    """'fp32', 'bf16' or 'fp16', as the precision flags and layout_rules name them."""
    from megatron_parm.experts import _DTYPE_NAMES  # the grouped GEMM's names of its dtypes

    return _DTYPE_NAMES.get(dtype, str(dtype))


# parm's two ways of choosing, timed side by side as variants of `parm` (``parm:model``,
# ``parm:measured``): the value of --parm-tune each forces (plain ``parm``: as the flags say)
TUNE_MODES = {"model": False, "measured": True}


def tune_mode(entry: str) -> Optional[bool]:
    """--parm-tune forced by a variant: ``parm:measured`` -> True, ``parm:model`` -> False,
    anything else -> None. ValueError naming the entry for an unknown mode or a schedule that
    does not choose (only the catalog's automatic kind has modes)."""
    name, colon, mode = entry.partition(":")
    if not colon:
        return None
    if mode not in TUNE_MODES:
        raise ValueError(f"{entry}: unknown mode {mode!r} (one of {', '.join(TUNE_MODES)})")
    if schedules.get(name).kind != schedules.AUTO:
        raise ValueError(f"{entry}: {name} does not choose a schedule (only "
                         f"{', '.join(schedules.names(schedules.AUTO))} has :model / :measured)")
    return TUNE_MODES[mode]


def parse_variant(entry: str) -> Tuple[str, Optional[int], Optional[int]]:
    """'parm_s2@8/4' -> ('parm_s2', 8, 4); 'parm_s2@4' -> (.., 4, 4); 'alltoall' -> (.., None, None);
    'parm:measured' -> ('parm', None, None) (its mode: tune_mode). ValueError naming the entry for
    anything else."""
    tune_mode(entry)
    name, _, chunks = entry.partition(":")[0].partition("@")
    schedules.get(name)  # an unknown name names the flag and the valid ones
    if not chunks:
        return name, None, None
    if not schedules.get(name).chunked:
        raise ValueError(f"{entry}: {name} is not a chunked schedule (only those take @chunks)")
    forward, _, backward = chunks.partition("/")
    try:
        counts = int(forward), int(backward or forward)
    except ValueError:
        raise ValueError(f"{entry}: expected {name}@C or {name}@C/B with integer chunk counts") from None
    for count, flag in zip(counts, (schedules.CHUNKS_FLAG, schedules.BWD_CHUNKS_FLAG)):
        schedules.check_num_chunks(count, flag)
    if schedules.get(name).pair(*counts) != counts:
        raise ValueError(f"{entry}: {name} runs its backward in its forward's chunks "
                         f"({name}@{counts[0]})")
    return name, counts[0], counts[1]


def variant(name: str, forward: int, backward: Optional[int] = None) -> str:
    """The variant label of a chunked schedule at (forward, backward) chunks."""
    backward = forward if backward is None else backward
    return f"{name}@{forward}" + ("" if backward == forward else f"/{backward}")


def build_layer(spec: MoELayerSpec, dispatcher: str) -> ParmMoELayer:
    """The layer with a dispatcher or a variant of one (``parm_s2@8/4``) and the spec's experts
    (ValueError saying why where this machine cannot build them)."""
    name, forward, backward = parse_variant(dispatcher)
    if forward is not None:
        spec = dataclasses.replace(spec, num_chunks=forward, bwd_num_chunks=backward)
    tune = tune_mode(dispatcher)
    if tune is not None:
        spec = dataclasses.replace(spec, extra={**spec.extra, "parm_tune": tune})
    problem = spec.expert_problem()
    if problem is not None:
        raise ValueError(f"expert_impl {spec.expert_impl}: {problem}")
    transformer_impl, grouped_gemm = expert_impl_flags(spec.expert_impl)
    mlp = layer_spec("gpt", spec.num_experts, transformer_impl, grouped_gemm,
                     spec.expert_impl).submodules.mlp
    layer = ParmMoELayer(spec.config(name), mlp.submodules)
    return layer.to(device.current()).train()


def expert_weights(experts: torch.nn.Module) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per local expert, views (fc1 [M, F1], fc2 [F2, M]) of its two weights, whichever the
    implementation (F1, F2 this rank's widths; F1 = 2 F2 with a gated activation): copying
    into them sets the weights."""
    kind = type(experts).__name__
    if hasattr(experts, "local_experts"):  # SequentialMLP: one MLP per expert, [out, in]
        return [(e.linear_fc1.weight.t(), e.linear_fc2.weight.t()) for e in experts.local_experts]
    if hasattr(experts, "weight1"):  # GroupedMLP, TorchGroupedMLP: one tensor per layer
        count, hidden = experts.num_local_experts, experts.config.hidden_size
        fc1 = experts.weight1.view(count, hidden, -1)
        fc2 = experts.weight2.view(count, -1, hidden)
        return [(fc1[e], fc2[e]) for e in range(count)]
    if kind == "TEGroupedMLP":  # TE's GroupedLinear: weight0 .. weight{E-1}, [out, in]
        return [(getattr(experts.linear_fc1, f"weight{e}").t(),
                 getattr(experts.linear_fc2, f"weight{e}").t())
                for e in range(experts.num_local_experts)]
    raise TypeError(f"expert_weights: unknown expert module {kind}")


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Same router and expert weights (both layers built on this rank with one layout, their
    experts of the same or of different implementations)."""
    if type(src.experts) is type(dst.experts):
        dst.load_state_dict(src.state_dict())
        return
    mine = {k: v for k, v in src.state_dict().items() if not k.startswith("experts.")}
    missing, unexpected = dst.load_state_dict(mine, strict=False)
    assert not unexpected and all(k.startswith("experts.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        pairs = list(zip(expert_weights(src.experts), expert_weights(dst.experts)))
        assert pairs and len(pairs) == src.experts.num_local_experts, "expert counts differ"
        for (src_fc1, src_fc2), (dst_fc1, dst_fc2) in pairs:
            dst_fc1.copy_(src_fc1)
            dst_fc2.copy_(src_fc2)


def step(layer: ParmMoELayer, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Forward + backward; returns the output."""
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    return out.detach()


@dataclass
class Timing:
    dispatcher: str
    times_ms: List[float]
    bytes: Dict[str, Dict[str, int]]
    choice: Optional[str] = None  # the schedule the automatic dispatcher `parm` picked
    # per rank: {"intra": bytes, "inter": bytes} sent in one step (for per-node link loads)
    rank_bytes: List[Dict[str, int]] = field(default_factory=list)
    # the largest over the ranks of the step's peak memory and of its rise (bench.memory)
    peak_bytes: Optional[int] = None
    step_peak_bytes: Optional[int] = None
    memory_kind: Optional[str] = None
    choice_line: Optional[str] = None  # parm: how it chose, with every candidate's time
    expert_impl: str = EXPERT_IMPLS[0]

    @property
    def median_ms(self) -> Optional[float]:
        return statistics.median(self.times_ms) if self.times_ms else None


def time_dispatchers(spec: MoELayerSpec, dispatchers: List[str], warmup: int = 2, iters: int = 5,
                     seed: int = 1234, memory: bool = False) -> Dict[str, Timing]:
    """Forward+backward time of one layer per dispatcher (or variant), interleaved so drift
    hits all alike.

    A step's time is the slowest rank's. Bytes are summed over ranks for one step
    (Megatron's own dispatchers included, through account_native_dispatchers). With
    ``memory``, one more step per dispatcher measures its peak memory (bench.memory).
    """
    timings = time_layers({name: build_layer(spec, name) for name in dispatchers}, spec, warmup,
                          iters, seed, memory=memory)
    return {name: dataclasses.replace(t, expert_impl=spec.expert_impl) for name, t in timings.items()}


def time_experts(spec: MoELayerSpec, dispatchers: List[str], expert_impls: List[str],
                 warmup: int = 2, iters: int = 5, seed: int = 1234,
                 memory: bool = False) -> Dict[str, Dict[str, Timing]]:
    """time_dispatchers for each expert implementation, all interleaved in one loop (same
    router and expert weights): {expert_impl: {dispatcher: Timing}}."""
    layers = build_expert_layers(spec, dispatchers, expert_impls)
    return by_expert_impl(time_layers(layers, spec, warmup, iters, seed, memory=memory))


def build_expert_layers(spec: MoELayerSpec, dispatchers: List[str],
                        expert_impls: List[str]) -> Dict[Tuple[str, str], ParmMoELayer]:
    """{(expert_impl, dispatcher): layer} for time_layers (which makes their weights equal)."""
    return {(impl, name): build_layer(dataclasses.replace(spec, expert_impl=impl), name)
            for impl in expert_impls for name in dispatchers}


def by_expert_impl(timings: Dict[Tuple[str, str], Timing]) -> Dict[str, Dict[str, Timing]]:
    """time_layers' results of build_expert_layers as {expert_impl: {dispatcher: Timing}}."""
    out: Dict[str, Dict[str, Timing]] = {}
    for (impl, name), timing in timings.items():
        out.setdefault(impl, {})[name] = dataclasses.replace(timing, dispatcher=name,
                                                             expert_impl=impl)
    return out


def time_schedules(spec: MoELayerSpec, chunk_counts: List[int], warmup: int = 2, iters: int = 5,
                   seed: int = 1234) -> Dict[int, Timing]:
    """Forward+backward time per chunk count: 1 is the sequential schedule the in-layer terms
    are fitted on (parm_s1), c >= 2 the chunked one (parm_s2) at c chunks (same weights and
    input, interleaved; perf_model.calibrate.layer_fit_schedules names them)."""
    sequential, chunked = layer_fit_schedules()
    layers = {count: build_layer(spec, sequential if count <= 1 else variant(chunked, count))
              for count in chunk_counts}
    return time_layers(layers, spec, warmup, iters, seed)


def time_layers(layers: Dict, spec: MoELayerSpec, warmup: int, iters: int, seed: int,
                memory: bool = False) -> Dict:
    """Interleaved timing of layers built from one spec; their weights are made equal first."""
    keys = list(layers)
    for key in keys[1:]:
        copy_weights(layers[keys[0]], layers[key])
    x, grad = _inputs(spec, seed, 2)

    results = {key: Timing(str(key), [], {}) for key in keys}
    for key in keys:  # parm's measured choice (--parm-tune): its first call starts the tuning
        # (or decides), and its tuning calls come before the others, so that its bytes, memory
        # and times are its choice's
        dispatcher = layers[key].token_dispatcher
        first = hasattr(dispatcher, "tuning") and dispatcher.choice is None
        while first or getattr(dispatcher, "tuning", False):
            step(layers[key], x, grad)
            layers[key].zero_grad(set_to_none=True)
            first = False
    for key in keys:  # one accounted step each (also a warm-up)
        with track_comm() as stats, account_native_dispatchers():
            step(layers[key], x, grad)
        results[key].bytes, results[key].rank_bytes = _world_bytes(stats)
        layers[key].zero_grad(set_to_none=True)
    if memory:  # one more step each, alone, for its peak memory (grads freed before and after)
        for key in keys:
            dist.barrier()
            peak = step_peak(lambda: step(layers[key], x, grad))
            layers[key].zero_grad(set_to_none=True)
            if peak is not None:
                both = torch.tensor([peak.peak_bytes, peak.step_bytes], dtype=torch.float64,
                                    device=device.current())
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                results[key].peak_bytes, results[key].step_peak_bytes = (int(v) for v in both.tolist())
                results[key].memory_kind = peak.kind
    for it in range(warmup + iters):
        for key in keys:
            dist.barrier()
            timer = device.Timer().start()
            step(layers[key], x, grad)
            elapsed = torch.tensor([timer.stop()], device=device.current())
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it >= warmup:
                results[key].times_ms.append(1e3 * elapsed.item())
            layers[key].zero_grad(set_to_none=True)
    for key, layer in layers.items():
        choice = getattr(layer.token_dispatcher, "choice", None)
        if choice is not None:
            results[key].choice = choice.label
            results[key].choice_line = choice.describe()
    return results


def _inputs(spec: MoELayerSpec, seed: int, count: int):
    """``count`` random tensors of this rank's input shape (a generator seeded per rank),
    in the spec's dtype on the device."""
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    return [torch.randn(spec.local_input_shape(), generator=gen).to(device.current(), spec.params_dtype)
            for _ in range(count)]


def _world_bytes(stats):
    """Every rank's accounted bytes: summed over ranks as {"kind/group": {"intra": ..,
    "inter": ..}}, and per rank as [{"intra": .., "inter": ..}] (all kinds and groups)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats.totals())
    out: Dict[str, Dict[str, int]] = {}
    per_rank = []
    for totals in gathered:
        mine = {"intra": 0, "inter": 0}
        for (kind, group), v in totals.items():
            entry = out.setdefault(f"{kind}/{group}", {"intra": 0, "inter": 0})
            for link in ("intra", "inter"):
                entry[link] += v[link]
                mine[link] += v[link]
        per_rank.append(mine)
    return out, per_rank


def max_output_diff(spec: MoELayerSpec, dispatchers: List[str], reference: str = "alltoall",
                    seed: int = 99) -> Dict[str, float]:
    """Max |out - out_reference| over ranks for each dispatcher, same weights and input."""
    return max_output_diff_by_experts(spec, dispatchers, [spec.expert_impl], reference,
                                      seed)[spec.expert_impl]


def max_output_diff_by_experts(spec: MoELayerSpec, dispatchers: List[str], expert_impls: List[str],
                               reference: str = "alltoall", seed: int = 99) -> Dict[str, Dict[str, float]]:
    """{expert_impl: {dispatcher: max |out - out_reference|}} over ranks, same weights and
    input; the reference is `reference` with the first of expert_impls."""
    keys = [(expert_impls[0], reference)] + [(impl, name) for impl in expert_impls
                                             for name in dispatchers]
    layers = {key: build_layer(dataclasses.replace(spec, expert_impl=key[0]), key[1])
              for key in dict.fromkeys(keys)}
    for key in layers:
        if key != keys[0]:
            copy_weights(layers[keys[0]], layers[key])
    (x,) = _inputs(spec, seed, 1)
    grad = torch.ones_like(x)
    ref = step(layers[keys[0]], x, grad)
    diffs: Dict[str, Dict[str, float]] = {impl: {} for impl in expert_impls}
    for impl, name in keys[1:]:
        d = torch.tensor([(step(layers[(impl, name)], x, grad) - ref).abs().max().item()],
                         device=device.current())
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        diffs[impl][name] = d.item()
    return diffs
