"""Every change this project makes to Megatron-Core 0.16.1 (and to torch where Megatron-Core
calls it), in one table: ``REDIRECTS``.

Megatron-Core's MoE, model, optimizer and checkpoint paths assume a CUDA device in a
handful of places. On a machine without CUDA (this project's CI, laptops) ``setup()``
redirects exactly those places so that the same code runs on CPU with the gloo backend.
A few other changes live next to the code they serve (the checkpoint writer's queue, the
grouped-GEMM check TorchGroupedMLP waives, the benchmark's byte counters, the step timer's
collective wrappers, the launcher's changes to torchrun's agent); the table lists them too,
naming the module that makes them.

Rules:
- Nothing here runs at import time: entry points and tests call ``setup()`` explicitly.
- ``setup()`` changes nothing CUDA-related where CUDA is available, so GPU runs use Megatron
  unchanged. Two redirects are not about CUDA and apply there too (``with_cuda``):
  ``missing_te`` (a no-op when TE imports) and ``uneven_collectives`` (only for process groups
  on gloo: several ranks sharing one GPU over gloo, as tools/gpu_check.sh does; NCCL groups go
  to Megatron's own calls).
- Every change is an entry of ``REDIRECTS``: the reason it exists, the version it was written
  for, who applies it. Each is as narrow as the call site allows (a Megatron module attribute
  rather than torch where possible). tests/unit/test_mcore_compat.py checks the entries that
  live elsewhere against their modules' source.

This module imports nothing from the rest of megatron_parm at import time but its device seam
(``megatron_parm.device``, the one place that asks torch.cuda); the uneven
collectives redirect borrows the padding collectives of ``megatron_parm.comm``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_parm import device

logger = logging.getLogger(__name__)

_APPLIED: List[str] = []


def cuda_available() -> bool:
    return device.is_cuda()


def applied() -> List[str]:
    """Names of the redirects ``setup()`` has applied in this process."""
    return list(_APPLIED)


def setup() -> None:
    """Apply every redirect of ``REDIRECTS`` that setup() owns, once; where CUDA is present,
    only those marked ``with_cuda``."""
    if _APPLIED:
        return
    cuda = cuda_available()
    for name, redirect in REDIRECTS.items():
        if redirect.applied_by == SETUP and (redirect.with_cuda or not cuda):
            redirect.patch()
            _APPLIED.append(name)
    if not cuda:
        logger.info("megatron_parm.mcore_compat: CPU redirects applied: %s", ", ".join(_APPLIED))


# ----------------------------------------------------------------------------------------
# current device
# ----------------------------------------------------------------------------------------


def _patch_current_device() -> None:
    # Megatron passes the result straight to device=..., so the CPU device object works.
    torch.cuda.current_device = lambda: torch.device("cpu")


# ----------------------------------------------------------------------------------------
# streams and events
# ----------------------------------------------------------------------------------------


class _HostStream:
    """A stream that does nothing: CPU ops already run in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


class _HostEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def _patch_streams() -> None:
    torch.cuda.Stream = _HostStream
    torch.cuda.Event = _HostEvent
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.default_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    # Tensor.record_stream rejects a non-CUDA stream; on CPU there is nothing to record.
    torch.Tensor.record_stream = lambda self, stream: None
    # NVTX ranges (the combined 1F1B schedule's nodes mark theirs) need a CUDA build.
    torch.cuda.nvtx.range_push = lambda msg: None
    torch.cuda.nvtx.range_pop = lambda: None


def _patch_combined_1f1b_streams() -> None:
    from megatron_parm.mcore_compat import comm_stream

    comm_stream.patch(_HOST_STREAM)


def _patch_combined_1f1b_bert() -> None:
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.gpt import gpt_model
    from megatron.core.pipeline_parallel import combined_1f1b

    step = combined_1f1b.combined_forward_backward_step

    def combined_forward_backward_step(*args, **kwargs):
        # The step imports the name GPTModel from gpt_model for its one isinstance check.
        gpt = gpt_model.GPTModel
        gpt_model.GPTModel = (gpt, BertModel)
        try:
            return step(*args, **kwargs)
        finally:
            gpt_model.GPTModel = gpt

    combined_1f1b.combined_forward_backward_step = combined_forward_backward_step


def _patch_local_linear_backward_dw() -> None:
    from megatron.core.tensor_parallel import layers

    if not hasattr(layers.RowParallelLinear, "backward_dw"):
        # as ColumnParallelLinear's: the weight gradient was computed in the backward
        layers.RowParallelLinear.backward_dw = lambda self: None


# ----------------------------------------------------------------------------------------
# RNG tracker
# ----------------------------------------------------------------------------------------


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's tracker, keeping CPU generator states under the same names."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # A tracker built before setup() would hold the CUDA class: rebuild it.
    mrandom.initialize_rng_tracker(force_reset=True)
    # Checkpoints save "cuda" RNG states next to the CPU one; on CPU they are the CPU state.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    # The rerun engine (megatron.core.rerun_state_machine) restores the "cuda" state after
    # the CPU one before it reruns an iteration: the same CPU state.
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None
    # Activation recompute (CheckpointFunction) saves and restores every RNG state around the
    # recomputed forward; the "cuda" one is the CPU state, which it restores itself.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: \
        torch.get_rng_state()


# ----------------------------------------------------------------------------------------
# uneven all_gather / reduce_scatter on gloo
# ----------------------------------------------------------------------------------------


def _patch_uneven_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    # The padding collectives live with the dispatchers' own (name=None: not accounted).
    from megatron_parm.comm.collectives import is_gloo, start_all_gather, start_reduce_scatter

    gather_orig: Callable = mappings._gather_along_first_dim
    scatter_orig: Callable = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not is_gloo(group):
            return gather_orig(input_, group, output_split_sizes, use_global_buffer)
        return start_all_gather(input_, group, None, output_split_sizes).wait()

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if group.size() == 1 or not is_gloo(group) or \
                (input_split_sizes is None and not input_.is_cuda):
            return scatter_orig(input_, group, input_split_sizes, use_global_buffer)
        return start_reduce_scatter(input_, group, None, input_split_sizes).wait()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


# ----------------------------------------------------------------------------------------
# LayerNorm under sequence parallelism
# ----------------------------------------------------------------------------------------


def _patch_sp_layernorm() -> None:
    from megatron.core.transformer import torch_norm

    wrapped_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        if not config.sequence_parallel:
            return wrapped_new(cls, config, hidden_size, eps, persist_layer_norm,
                               zero_centered_gamma, normalization)
        norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            # Megatron all-reduces grads of such params over TP (each rank saw a shard).
            setattr(param, "sequence_parallel", True)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


# ----------------------------------------------------------------------------------------
# zero-centered LayerNorm / RMSNorm gamma (--apply-layernorm-1p) without apex or TE
# ----------------------------------------------------------------------------------------


class _ZeroCenteredGamma:
    """A torch norm whose gamma is stored as gamma - 1: the weight starts at zero and the input
    is scaled by 1 + weight, as Megatron-Core's FusedLayerNorm and Transformer Engine's norms do
    with layernorm_zero_centered_gamma."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)


class ZeroCenteredLayerNorm(_ZeroCenteredGamma, torch.nn.LayerNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(input, self.normalized_shape, self.weight + 1,
                                              self.bias, self.eps)


class ZeroCenteredRMSNorm(_ZeroCenteredGamma, torch.nn.RMSNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(input, self.normalized_shape, self.weight + 1,
                                            self.eps)


def _patch_zero_centered_norm() -> None:
    from megatron.core.transformer import torch_norm

    wrapped_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        if not config.layernorm_zero_centered_gamma or config.normalization not in (
                "LayerNorm", "RMSNorm"):
            return wrapped_new(cls, config, hidden_size, eps, persist_layer_norm,
                               zero_centered_gamma, normalization)
        norm_cls = ZeroCenteredLayerNorm if config.normalization == "LayerNorm" \
            else ZeroCenteredRMSNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                setattr(param, "sequence_parallel", True)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


# ----------------------------------------------------------------------------------------
# split sizes that already live on the host
# ----------------------------------------------------------------------------------------


def _patch_host_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    orig = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move


def _patch_cp_rotary_chunks() -> None:
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        size, rank = cp_group.size(), cp_group.rank()
        chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1,
                              *pos_emb.shape[seq_dim + 1:])
        index = torch.tensor([rank, 2 * size - 1 - rank], device=pos_emb.device)
        chunks = chunks.index_select(seq_dim, index)
        return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


# ----------------------------------------------------------------------------------------
# Transformer Engine absent
# ----------------------------------------------------------------------------------------


class _NoFP8:
    """TE's FP8GlobalStateManager as it answers without TE: fp8 is off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def _patch_missing_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    # RouterGatingLinearFunction tests `te_general_gemm is not None`, but the name is only
    # bound when TE imports; without TE the router raises NameError.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.tensor_parallel import random as mrandom

    # CheckpointWithoutOutput (selective recompute of layernorm and moe_act) reads fp8 as
    # `fp8 is not None`, so always True, and then calls TE's FP8GlobalStateManager and its
    # recompute and autocast contexts: without TE, fp8 is off and the contexts do nothing.
    if not hasattr(mrandom, "FP8GlobalStateManager"):
        mrandom.FP8GlobalStateManager = _NoFP8
        mrandom.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
        mrandom.fp8_autocast = lambda **kwargs: contextlib.nullcontext()
    from megatron.core.transformer import multi_latent_attention

    # Without TE, Megatron-Core's TE extension binds TELinear to a placeholder that is no
    # class, yet multi_latent_attention's HAVE_TE is True (its import succeeded): the
    # isinstance(linear_proj, TELinear) of MultiLatentAttention.__init__ raises TypeError.
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    # The FSDP adapter (--use-megatron-fsdp) asks isinstance(module, (TELinear,)) of every
    # module with parameters under tensor parallelism: no module is a TELinear without TE.
    if not isinstance(mcore_fsdp_adapter.TELinear, type):
        mcore_fsdp_adapter.TELinear = type("TELinearAbsent", (), {})


# ----------------------------------------------------------------------------------------
# device='cuda' literals in the optimizer and schedules
# ----------------------------------------------------------------------------------------

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


def _host_device(device):
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _HostDeviceTorch:
    """torch as seen by one Megatron module: factories map device='cuda' to the CPU."""

    def __init__(self, factories=_FACTORIES):
        self._factories = factories

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._factories:
            return attr

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _host_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


def _patch_cuda_device_literals() -> None:
    from megatron.core import rerun_state_machine
    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    for module in (optimizer, clip_grads, grad_scaler, schedules, transformer_utils,
                   rerun_state_machine):
        module.torch = _HostDeviceTorch()


# ----------------------------------------------------------------------------------------
# the mixed-precision optimizer's parameter types, the loss scaler's state
# ----------------------------------------------------------------------------------------


def _patch_float16_param_types() -> None:
    from megatron.core.optimizer import distrib_optimizer, optimizer

    tensor_type = torch.Tensor.type

    def cuda_named_type(tensor, *args, **kwargs):
        if not args and not kwargs and not tensor.is_cuda:
            return tensor_type(tensor).replace("torch.", "torch.cuda.", 1)
        return tensor_type(tensor, *args, **kwargs)

    def while_constructing(construct):
        def __init__(self, *args, **kwargs):
            torch.Tensor.type = cuda_named_type
            try:
                construct(self, *args, **kwargs)
            finally:
                torch.Tensor.type = tensor_type
        return __init__

    for cls in (optimizer.Float16OptimizerWithFloat16Params,
                distrib_optimizer.DistributedOptimizer):
        cls.__init__ = while_constructing(cls.__init__)


def _patch_loss_scaler_state() -> None:
    from megatron.core.optimizer import grad_scaler

    def load_state_dict(self, state_dict):
        self._scale = state_dict["scale"].to(device.HOST)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]

    grad_scaler.DynamicGradScaler.load_state_dict = load_state_dict


# ----------------------------------------------------------------------------------------
# gradient clipping without the CUDA type check
# ----------------------------------------------------------------------------------------


def _patch_clip_grads() -> None:
    from megatron.core.optimizer import optimizer
    from megatron.core.utils import to_local_if_dtensor

    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if isinstance(grads_for_norm, torch.Tensor):
            grads_for_norm = [grads_for_norm]
        grads = [to_local_if_dtensor(grad).float() for grad in grads_for_norm]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            total = torch.tensor([max((g.abs().max().item() for g in grads), default=0.0)])
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX,
                                         group=grad_stats_parallel_group)
            return total.item()
        total = torch.zeros(1)
        for grad in grads:
            total += grad.norm(norm_type) ** norm_type
        torch.distributed.all_reduce(total, group=grad_stats_parallel_group)
        return total.item() ** (1.0 / norm_type)

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                 if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    optimizer.get_grad_norm_fp32 = get_grad_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_pipeline_embedding_sync() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup_weights = LanguageModule.setup_embeddings_and_output_layer
    to_cuda = torch.Tensor.cuda

    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        torch.Tensor.cuda = _stay_on_host(to_cuda)
        try:
            return setup_weights(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = to_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


# ----------------------------------------------------------------------------------------
# Megatron-FSDP (--use-megatron-fsdp) on the CPU with gloo
# ----------------------------------------------------------------------------------------


class _HostNamedDeviceTorch:
    """torch as seen by one Megatron-FSDP module: torch.device('cuda...') (built there from
    f"cuda:{torch.cuda.current_device()}") is the CPU; every other name is torch's own."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name != "device":
            return attr

        def device(spec, *args, **kwargs):
            if isinstance(spec, str) and spec.startswith("cuda"):
                return torch.device("cpu")
            return attr(spec, *args, **kwargs)

        return device


class _HostDeviceMesh:
    """torch's DeviceMesh as the FSDP adapter sees it: a mesh it builds on 'cuda' is a CPU
    mesh (DTensor.from_local moves each local shard to its mesh's device)."""

    def __getattr__(self, name):
        from torch.distributed import DeviceMesh

        return getattr(DeviceMesh, name)

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh

        host_type = "cpu" if device_type == "cuda" else device_type
        return DeviceMesh.from_group(group, host_type, *args, **kwargs)


def _patch_megatron_fsdp() -> None:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import (
        megatron_fsdp,
        param_and_grad_buffer,
        uneven_dtensor,
    )

    for module in (mcore_fsdp_adapter, megatron_fsdp):
        module.torch = _HostNamedDeviceTorch()
    mcore_fsdp_adapter.DeviceMesh = _HostDeviceMesh()

    validate, to_cuda = uneven_dtensor.validate_uneven_dtensor, torch.Tensor.cuda

    def validate_on_host(dtensor):
        torch.Tensor.cuda = _stay_on_host(to_cuda)
        try:
            return validate(dtensor)
        finally:
            torch.Tensor.cuda = to_cuda

    uneven_dtensor.validate_uneven_dtensor = validate_on_host
    param_and_grad_buffer.validate_uneven_dtensor = validate_on_host

    preprocess = param_and_grad_buffer.gradient_reduce_preprocessing

    def scale_then_sum(grad_data, scaling_factor, ddp_config):
        if scaling_factor is not None and not ddp_config.average_in_collective and \
                not grad_data.is_cuda:
            grad_data.mul_(scaling_factor)
            return torch.distributed.ReduceOp.SUM
        return preprocess(grad_data, scaling_factor, ddp_config)

    param_and_grad_buffer.gradient_reduce_preprocessing = scale_then_sum


def _patch_megatron_fsdp_one_rank_grads() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    buffer_init = param_and_grad_buffer.DataParallelBuffer.__init__

    def __init__(self, ddp_config, params, is_data_distributed, *args, **kwargs):
        group = kwargs.get("data_parallel_group")
        # Only a gradient buffer is given a gradient scaling factor.
        if "gradient_scaling_factor" in kwargs and not is_data_distributed and \
                group is not None and group.size() == 1 and \
                ddp_config.data_parallel_sharding_strategy in ("optim_grads",
                                                               "optim_grads_params"):
            is_data_distributed = True
        buffer_init(self, ddp_config, params, is_data_distributed, *args, **kwargs)

    param_and_grad_buffer.DataParallelBuffer.__init__ = __init__


# ----------------------------------------------------------------------------------------
# the fully parallel checkpoint load's exchange (--ckpt-fully-parallel-load)
# ----------------------------------------------------------------------------------------


def _stay_on_host(to_cuda):
    """Tensor.cuda() without arguments that leaves a CPU tensor where it is."""
    def cuda(tensor, *args, **kwargs):
        if not args and not kwargs and not tensor.is_cuda:
            return tensor
        return to_cuda(tensor, *args, **kwargs)
    return cuda


def _patch_fully_parallel_load() -> None:
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    load, init_data, to_cuda = (FullyParallelLoadStrategyWrapper.load, ShardedTensor.init_data,
                                torch.Tensor.cuda)
    host_torch = _HostDeviceTorch(_FACTORIES + ("empty_like",))

    def init_on_host(self, device, init_fn=torch.empty):
        return init_data(self, _host_device(device), init_fn)

    def load_on_host(self, *args, **kwargs):
        exchange_torch = exchange_utils.torch
        torch.Tensor.cuda, ShardedTensor.init_data = _stay_on_host(to_cuda), init_on_host
        exchange_utils.torch = host_torch
        try:
            return load(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda, ShardedTensor.init_data = to_cuda, init_data
            exchange_utils.torch = exchange_torch

    FullyParallelLoadStrategyWrapper.load = load_on_host


# ----------------------------------------------------------------------------------------
# the checkpoint writer's results queue (applied by every save, CPU and GPU)
# ----------------------------------------------------------------------------------------


def keep_writer_results_in_process() -> None:
    """Megatron-Core's torch_dist writer forks writer processes and collects their results in a
    queue it creates, on first use, in a multiprocessing Manager: a spawned helper process that
    re-imports the training script (seconds), outlives a rank killed mid-save and dies with a
    job-wide SIGTERM (Slurm's), failing the save that SIGTERM asked for. Only asynchronous saves
    need it; the project's are synchronous (the results are put and taken in this process), so a
    plain queue serves and no helper process is started."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


# ----------------------------------------------------------------------------------------
# the table: every change this project makes to Megatron-Core (and to torch where Megatron-Core
# calls it), why, the version it was written for, and who applies it
# ----------------------------------------------------------------------------------------

SETUP = "setup()"
MCORE_VERSION = "megatron-core 0.16.1"


@dataclass(frozen=True)
class Redirect:
    """One change to a library's module, class or function, made while this process runs.

    Args:
        patch: the function that makes the change (setup() calls it for ``SETUP`` entries);
            None for changes that live next to the code they serve (``applied_by`` names it).
        why: what the library does that needs the change, and what the change does instead.
        with_cuda: setup() applies it where CUDA is present too (it is not about CUDA).
        applied_by: ``SETUP``, or the project code that makes the change (scoped ones undo it).
        target: the patched names (dotted), for the changes that live elsewhere.
        written_for: the library version whose source the change was written against; check
            the change again when that version moves.
    """

    patch: Optional[Callable[[], None]]
    why: str
    with_cuda: bool = False
    applied_by: str = SETUP
    target: str = ""
    written_for: str = MCORE_VERSION


REDIRECTS: Dict[str, Redirect] = {
    "current_device": Redirect(
        _patch_current_device, with_cuda=False,
        why=(
            'Megatron allocates with device=torch.cuda.current_device() all over (mappings, '
            'layers, router, experts); on CPU that must name the CPU.'
        )),
    "streams": Redirect(
        _patch_streams, with_cuda=False,
        why=(
            'The alltoall dispatcher and shared experts create torch.cuda.Stream objects and '
            'enter torch.cuda.stream(); on CPU work is ordered already, so a do-nothing stream '
            'keeps the call sites working.'
        )),
    "combined_1f1b_streams": Redirect(
        _patch_combined_1f1b_streams, with_cuda=False,
        why=(
            "Megatron's combined 1F1B schedule (--overlap-moe-expert-parallel-comm) runs the MoE "
            'dispatch and combine nodes on a communication stream, so that one micro-batch\'s '
            "all-to-alls overlap another's compute; with do-nothing streams nothing would "
            'overlap. That stream becomes a thread that runs the nodes submitted to it in order '
            '(ScheduleNode._forward/_backward submit there and wait where a result is first '
            "needed; TransformerModelChunkSchedulePlan.run hands back tensors), and activation "
            "recompute's _fork_rng excludes its forward nodes except while they wait for "
            "their peers' part of a collective (collectives.WAIT_CONTEXTS; comm_stream.py "
            'says why it stays exact and free of deadlocks).'
        )),
    "combined_1f1b_bert": Redirect(
        _patch_combined_1f1b_bert, with_cuda=True,
        why=(
            "Megatron-Core's combined 1F1B step (combined_forward_backward_step) asserts that "
            'the model building its schedule plan is a GPTModel. megatron_parm.training\'s '
            'ParmBertModel builds Megatron\'s own plan over its encoder layers '
            '(bert_schedule_plan.py); while the step runs, the name the assertion imports from '
            'gpt_model stands for (GPTModel, BertModel). No other code of the step imports it. '
            'Not about CUDA: applied everywhere.'
        )),
    "local_linear_backward_dw": Redirect(
        _patch_local_linear_backward_dw, with_cuda=True,
        why=(
            "--delay-wgrad-compute makes the combined 1F1B schedule call backward_dw() on the "
            "attention's and the MLPs' linear layers. Transformer Engine's compute their weight "
            "gradients there; Megatron-Core's local ColumnParallelLinear does nothing (its "
            "weight gradient came with the backward), and RowParallelLinear has no backward_dw, "
            "so the schedule failed without TE: it gets ColumnParallelLinear's do-nothing one. "
            'About TE, not CUDA: applied wherever RowParallelLinear lacks it.'
        )),
    "rng_tracker": Redirect(
        _patch_rng_tracker, with_cuda=False,
        why=(
            'tensor_parallel.random keeps per-parallel-group CUDA generator states; on CPU the '
            'same tracker keeps CPU generator states instead, so model-parallel init and dropout '
            "forks stay reproducible; activation recompute's saved 'cuda' state, and the one the "
            "rerun engine saves and restores around a rerun, is the CPU one."
        )),
    "uneven_collectives": Redirect(
        _patch_uneven_collectives, with_cuda=True,
        why=(
            "gloo's list all_gather and reduce_scatter need equal sizes; Megatron's gather with "
            'output_split_sizes and reduce-scatter with input_split_sizes (alltoall dispatcher, '
            'ETP>1) pad every split to the largest and trim. On gloo groups only; there, CUDA '
            "tensors are reduce-scattered by the dispatchers' all_to_all_single way too, which "
            'gloo runs on CUDA tensors (its reduce_scatter is not relied on for them).'
        )),
    "sp_layernorm": Redirect(
        _patch_sp_layernorm, with_cuda=False,
        why=(
            "Megatron's local LayerNorm (WrappedTorchNorm) refuses sequence_parallel=True without "
            "apex/TE; on CPU torch.nn.LayerNorm is exactly right, and the weights get Megatron's "
            'sequence_parallel attribute so their grads are reduced over TP.'
        )),
    "zero_centered_norm": Redirect(
        _patch_zero_centered_norm, with_cuda=True,
        why=(
            "Megatron's local LayerNorm (WrappedTorchNorm, without apex or TE) refuses "
            'layernorm_zero_centered_gamma (--apply-layernorm-1p), which its fused and TE norms '
            'take; torch.nn.LayerNorm / RMSNorm with the gamma stored as gamma - 1 (zero at '
            'initialization, the input scaled by 1 + weight) computes what they compute. Not '
            'about CUDA: applied wherever the local norm is built.'
        )),
    "host_split_sizes": Redirect(
        _patch_host_split_sizes, with_cuda=False,
        why=(
            'The alltoall dispatcher turns its split sizes into numpy arrays only when they live '
            'on the GPU (maybe_move_tensor_to_cpu); on CPU they stay tensors, which '
            'torch.distributed.all_to_all_single rejects as split sizes.'
        )),
    "cp_rotary_chunks": Redirect(
        _patch_cp_rotary_chunks, with_cuda=False,
        why=(
            'With --context-parallel-size > 1 the rotary embeddings (RotaryEmbedding, '
            "YarnRotaryEmbedding) keep this CP rank's chunks r and 2c - 1 - r of the sequence's "
            'positions (get_pos_emb_on_this_cp_rank), through an index in pinned memory moved '
            "with .cuda(). On CPU the same chunks are selected with an index on the embedding's "
            'device.'
        )),
    "missing_te": Redirect(
        _patch_missing_te, with_cuda=True,
        why=(
            'moe_utils.RouterGatingLinearFunction reads the name te_general_gemm, which only '
            'exists when transformer-engine imports; it is bound to None when TE is absent. '
            "tensor_parallel.random's CheckpointWithoutOutput (selective recompute of layernorm "
            "and moe_act) takes any fp8 argument as on and calls TE's FP8GlobalStateManager, "
            'activation_recompute_forward and fp8_autocast: without TE, fp8 is off and the '
            'contexts do nothing. multi_latent_attention takes TE for present when its import '
            'of the TE extension succeeds, whose TELinear is then a placeholder no isinstance '
            'accepts (MultiLatentAttention.__init__ raises TypeError): its HAVE_TE is set '
            "False; the FSDP adapter's isinstance(module, (TELinear,)) (--use-megatron-fsdp "
            'with tensor parallelism) gets a class no module is an instance of. This one is '
            'about TE, not CUDA, so '
            'setup() applies it wherever TE is missing.'
        )),
    "cuda_device_literals": Redirect(
        _patch_cuda_device_literals, with_cuda=False,
        why=(
            "The optimizer (FP32Optimizer's loss scale, MixedPrecisionOptimizer's found-inf "
            'buffers), the loss scalers (grad_scaler), clip_grads, the pipeline schedules and '
            "transformer.utils (get_default_causal_mask: a causal attention called with "
            "attention_mask=None, as a GPTModel user may call it) and the rerun engine "
            "(rerun_state_machine: its all-reduced flags) create small tensors with a "
            "literal device='cuda'. Those six modules see a `torch` whose tensor factories "
            "read 'cuda' as the CPU; every other name is torch's own."
        )),
    "float16_param_types": Redirect(
        _patch_float16_param_types, with_cuda=False,
        why=(
            'Float16OptimizerWithFloat16Params (--bf16 / --fp16) and DistributedOptimizer '
            '(--use-distributed-optimizer) sort parameters by param.type() in '
            "'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor' / 'torch.cuda.FloatTensor' and "
            'refuse anything else, so CPU parameters are refused. While their constructors run, '
            "Tensor.type() without arguments names a CPU tensor's type as its CUDA counterpart; "
            'nothing else changes.'
        )),
    "loss_scaler_state": Redirect(
        _patch_loss_scaler_state, with_cuda=False,
        why=(
            'DynamicGradScaler.load_state_dict (--fp16 resume) moves the saved scale with '
            '.cuda(current_device); on CPU the scale is copied onto the CPU instead.'
        )),
    "clip_grads": Redirect(
        _patch_clip_grads, with_cuda=False,
        why=(
            "get_grad_norm_fp32 computes the 2-norm through Megatron's local multi-tensor "
            "applier, which allocates on 'cuda', and clip_grad_by_total_norm_fp32 asserts "
            "grad.type() == 'torch.cuda.FloatTensor'. The optimizer module gets the same two "
            'functions on the CPU: sum of squares all-reduced over grad_stats_parallel_group '
            '(other norms: max or p-th powers, as Megatron does), then grads *= max_norm / (norm '
            '+ 1e-6) when that is below 1.'
        )),
    "pipeline_embedding_sync": Redirect(
        _patch_pipeline_embedding_sync, with_cuda=False,
        why=(
            'With pipeline parallelism LanguageModule.setup_embeddings_and_output_layer moves the '
            'tied word embedding with weight.data.cuda() before all-reducing it between the first '
            "and last stage (the last stage's copy starts at zero). While it runs, Tensor.cuda() "
            'without arguments leaves a CPU tensor where it is.'
        )),
    "fully_parallel_load": Redirect(
        _patch_fully_parallel_load, with_cuda=False,
        why=(
            "--ckpt-fully-parallel-load: Megatron-Core's FullyParallelLoadStrategyWrapper has "
            "each data-parallel rank read a share of the replicated tensors and broadcast them, "
            "through CUDA buffers (Tensor.cuda(), ShardedTensor.init_data('cuda'), "
            "empty_like(device='cuda') in exchange_utils). While its load runs, those buffers "
            "are CPU tensors, which gloo broadcasts."
        )),
    "megatron_fsdp": Redirect(
        _patch_megatron_fsdp, with_cuda=False,
        why=(
            "Megatron-FSDP (--use-megatron-fsdp) builds torch.device(f'cuda:{current_device}') "
            '(FullyShardedDataParallel, MegatronFSDP), its DeviceMesh on device_type '
            "'cuda' (DTensor.from_local then moves every shard there), moves a check's flags "
            'with .cuda() (validate_uneven_dtensor), and divides the gradients inside the '
            "reduce-scatter with NCCL's PREMUL_SUM (gradient_reduce_preprocessing), which "
            "gloo refuses. On the CPU: those two modules' torch.device('cuda...') is the CPU, "
            "the adapter's meshes are CPU meshes, the check's .cuda() leaves its tensor where it "
            'is, and CPU gradients are multiplied by the factor in place before a SUM '
            "reduce-scatter (Megatron-FSDP's own path without gradient_reduce_div_fusion: "
            'the same sum).'
        )),
    "megatron_fsdp_one_rank_grads": Redirect(
        _patch_megatron_fsdp_one_rank_grads, with_cuda=True,
        why=(
            "A bug of Megatron-FSDP 0.16.1 (NVIDIA/Megatron-LM#6660, fixed upstream later): "
            'with --data-parallel-sharding-strategy optim_grads or optim_grads_params, a '
            'gradient buffer whose data-parallel group has one rank (DP = 1, or expert DP = 1: '
            'EP x ETP = world size / PP) is not distributed, so its reduce-scatter reads and '
            'then adds into the same buffer: every reduction doubles those gradients. Such a '
            'buffer is built distributed over its one rank instead: gradients go through a '
            "temporary bucket as on more ranks, and the reduction is the identity it should "
            'be. Not about CUDA: applied everywhere.'
        )),
    # Changes made elsewhere, next to the code they serve.
    "writer_results_queue": Redirect(
        keep_writer_results_in_process, applied_by="megatron_parm.checkpointing.save_load",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue",
        why=(
            "Megatron-Core's torch_dist writer collects its forked writers' results in a queue "
            "it creates in a multiprocessing Manager: a spawned helper process that outlives a "
            "rank killed mid-save and dies with a job-wide SIGTERM. Synchronous saves need no "
            "Manager: a plain queue of this process is installed before every save."
        )),
    "reduce_scatter_reset": Redirect(
        None, applied_by="megatron_parm.training.ddp",
        target="megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func",
        why=(
            "Megatron-Core's DistributedDataParallel swaps its buffers' reduce-scatter for the "
            "fp32-accumulating one (a module global) when a DDP config asks for "
            "reduce_scatter_with_fp32_accumulation, and never back: a later run of the same "
            "process without --ddp-reduce-scatter-with-fp32-accumulation puts Megatron-Core's "
            "own function back before its DDP is built."
        )),
    "aux_loss_scale_reset": Redirect(
        None, applied_by="megatron_parm.training.trainer",
        target="megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale",
        why=(
            "Megatron-Core keeps the MoE aux-loss scale of the last step in a class attribute "
            "and copies each later scale into it: a second pretrain() in one process whose "
            "scale has another shape (--calculate-per-token-loss) fails in that copy. Each "
            "run starts with none, as a fresh process does."
        )),
    "grouped_gemm_check": Redirect(
        None, applied_by="megatron_parm.experts",
        target="megatron.core.transformer.moe.experts.gg.assert_grouped_gemm_is_available",
        why=(
            "GroupedMLP's constructor asserts that the grouped_gemm package imports, only to "
            "use it in the forward that TorchGroupedMLP replaces; the check is waived while "
            "TorchGroupedMLP's constructor runs, and restored after."
        )),
    "native_byte_taps": Redirect(
        None, applied_by="megatron_parm.bench.native_accounting",
        target="megatron.core.transformer.moe.token_dispatcher.all_to_all",
        why=(
            "To count the bytes Megatron's own alltoall dispatcher sends, the benchmark wraps "
            "the collectives that token_dispatcher imported (all_to_all, the sequence-parallel "
            "gather and reduce-scatter) with counting ones, inside a context manager that "
            "puts the originals back."
        )),
    "step_timer_collectives": Redirect(
        None, applied_by="megatron_parm.training.timing",
        target="megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
        why=(
            "--parm-timing-breakdown times Megatron-Core's tensor- and sequence-parallel "
            "collectives outside the MoE layer: StepTimer wraps tensor_parallel.mappings' "
            "_reduce, _gather_along_*_dim and _reduce_scatter_along_*_dim and "
            "tensor_parallel.layers' dist_all_gather_func / dist_reduce_scatter_func with "
            "timed ones, and puts the originals back when the run closes it."
        )),
    "torchrun_agent": Redirect(
        None, applied_by="megatron_parm.launch",
        target="torch.distributed.elastic.multiprocessing.api._terminate_process_handler",
        written_for="torch 2.13 (torch.distributed.elastic)",
        why=(
            "The launcher is torchrun with four changes to its agent (launch.py's docstring): "
            "the grace before SIGKILL capped, the ranks it stopped remembered, a line before "
            "each restart (SubprocessContext._close, LocalElasticAgent._monitor_workers, "
            "SimpleElasticAgent._restart_workers), and a signal handler that stops cleanly."
        )),
}
