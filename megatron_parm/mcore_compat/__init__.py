"""CPU/gloo redirects for Megatron-Core 0.16.1.

Megatron-Core's MoE, model, optimizer and checkpoint paths assume a CUDA device in a
handful of places. On a machine without CUDA (this project's CI, laptops) ``setup()``
redirects exactly those places so that the same code runs on CPU with the gloo backend.

Rules:
- Nothing here runs at import time: entry points and tests call ``setup()`` explicitly.
- ``setup()`` changes nothing CUDA-related where CUDA is available, so GPU runs use Megatron
  unchanged. Two redirects are not about CUDA and apply there too (``WITH_CUDA``):
  ``missing_te`` (a no-op when TE imports) and ``uneven_collectives`` (only for process groups
  on gloo: several ranks sharing one GPU over gloo, as tools/gpu_check.sh does; NCCL groups go
  to Megatron's own calls).
- Every redirect is listed in ``REDIRECTS`` with the reason it exists, and is as narrow as
  the call site allows (a Megatron module attribute rather than torch where possible).

This module imports nothing from the rest of megatron_parm at import time but its device seam
(``megatron_parm.device``, the one place that asks torch.cuda); the uneven
collectives redirect borrows the padding collectives of ``megatron_parm.comm``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, List

import torch

from megatron_parm import device

logger = logging.getLogger(__name__)

_APPLIED: List[str] = []

# name -> why it exists. Kept next to the code so the list and the patches stay in step.
REDIRECTS: Dict[str, str] = {
    "current_device": (
        "Megatron allocates with device=torch.cuda.current_device() all over "
        "(mappings, layers, router, experts); on CPU that must name the CPU."
    ),
    "streams": (
        "The alltoall dispatcher and shared experts create torch.cuda.Stream objects and "
        "enter torch.cuda.stream(); on CPU work is ordered already, so a do-nothing stream "
        "keeps the call sites working."
    ),
    "rng_tracker": (
        "tensor_parallel.random keeps per-parallel-group CUDA generator states; on CPU the "
        "same tracker keeps CPU generator states instead, so model-parallel init and "
        "dropout forks stay reproducible."
    ),
    "uneven_collectives": (
        "gloo's list all_gather and reduce_scatter need equal sizes; Megatron's gather with "
        "output_split_sizes and reduce-scatter with input_split_sizes (alltoall dispatcher, "
        "ETP>1) pad every split to the largest and trim. On gloo groups only; there, CUDA "
        "tensors are reduce-scattered by the dispatchers' all_to_all_single way too, which "
        "gloo runs on CUDA tensors (its reduce_scatter is not relied on for them)."
    ),
    "sp_layernorm": (
        "Megatron's local LayerNorm (WrappedTorchNorm) refuses sequence_parallel=True "
        "without apex/TE; on CPU torch.nn.LayerNorm is exactly right, and the weights "
        "get Megatron's sequence_parallel attribute so their grads are reduced over TP."
    ),
    "host_split_sizes": (
        "The alltoall dispatcher turns its split sizes into numpy arrays only when they "
        "live on the GPU (maybe_move_tensor_to_cpu); on CPU they stay tensors, which "
        "torch.distributed.all_to_all_single rejects as split sizes."
    ),
    "missing_te": (
        "moe_utils.RouterGatingLinearFunction reads the name te_general_gemm, which only "
        "exists when transformer-engine imports; it is bound to None when TE is absent. "
        "This one is about TE, not CUDA, so setup() applies it wherever TE is missing."
    ),
    "cuda_device_literals": (
        "The optimizer (FP32Optimizer's loss scale, MixedPrecisionOptimizer's found-inf "
        "buffers), the loss scalers (grad_scaler), clip_grads and the pipeline schedules "
        "create small tensors with a literal device='cuda'. Those four modules see a `torch` "
        "whose tensor factories read 'cuda' as the CPU; every other name is torch's own."
    ),
    "float16_param_types": (
        "Float16OptimizerWithFloat16Params (--bf16 / --fp16) sorts parameters by "
        "param.type() in 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor' / "
        "'torch.cuda.FloatTensor' and refuses anything else, so CPU parameters are refused. "
        "While its constructor runs, Tensor.type() without arguments names a CPU tensor's "
        "type as its CUDA counterpart; nothing else changes."
    ),
    "loss_scaler_state": (
        "DynamicGradScaler.load_state_dict (--fp16 resume) moves the saved scale with "
        ".cuda(current_device); on CPU the scale is copied onto the CPU instead."
    ),
    "clip_grads": (
        "get_grad_norm_fp32 computes the 2-norm through Megatron's local multi-tensor "
        "applier, which allocates on 'cuda', and clip_grad_by_total_norm_fp32 asserts "
        "grad.type() == 'torch.cuda.FloatTensor'. The optimizer module gets the same two "
        "functions on the CPU: sum of squares all-reduced over grad_stats_parallel_group "
        "(other norms: max or p-th powers, as Megatron does), then grads *= "
        "max_norm / (norm + 1e-6) when that is below 1."
    ),
    "pipeline_embedding_sync": (
        "With pipeline parallelism LanguageModule.setup_embeddings_and_output_layer moves "
        "the tied word embedding with weight.data.cuda() before all-reducing it between the "
        "first and last stage (the last stage's copy starts at zero). While it runs, "
        "Tensor.cuda() without arguments leaves a CPU tensor where it is."
    ),
}


def cuda_available() -> bool:
    return device.is_cuda()


def applied() -> List[str]:
    """Names of the redirects ``setup()`` has applied in this process."""
    return list(_APPLIED)


# Redirects that are not about CUDA and so also apply where it is present.
WITH_CUDA = ("missing_te", "uneven_collectives")


def setup() -> None:
    """Apply every CPU redirect once; where CUDA is present, only those of WITH_CUDA."""
    if _APPLIED:
        return
    if cuda_available():
        for name in WITH_CUDA:
            _PATCHES[name]()
            _APPLIED.append(name)
        return
    for name, patch in _PATCHES.items():
        patch()
        _APPLIED.append(name)
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
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None


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


# ----------------------------------------------------------------------------------------
# Transformer Engine absent
# ----------------------------------------------------------------------------------------


def _patch_missing_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    # RouterGatingLinearFunction tests `te_general_gemm is not None`, but the name is only
    # bound when TE imports; without TE the router raises NameError.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _host_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


def _patch_cuda_device_literals() -> None:
    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer
    from megatron.core.pipeline_parallel import schedules

    for module in (optimizer, clip_grads, grad_scaler, schedules):
        module.torch = _HostDeviceTorch()


# ----------------------------------------------------------------------------------------
# the mixed-precision optimizer's parameter types, the loss scaler's state
# ----------------------------------------------------------------------------------------


def _patch_float16_param_types() -> None:
    from megatron.core.optimizer import optimizer

    cls = optimizer.Float16OptimizerWithFloat16Params
    construct = cls.__init__
    tensor_type = torch.Tensor.type

    def cuda_named_type(tensor, *args, **kwargs):
        if not args and not kwargs and not tensor.is_cuda:
            return tensor_type(tensor).replace("torch.", "torch.cuda.", 1)
        return tensor_type(tensor, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        torch.Tensor.type = cuda_named_type
        try:
            construct(self, *args, **kwargs)
        finally:
            torch.Tensor.type = tensor_type

    cls.__init__ = __init__


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

    def stay_on_host(tensor, *args, **kwargs):
        if not args and not kwargs and not tensor.is_cuda:
            return tensor
        return to_cuda(tensor, *args, **kwargs)

    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        torch.Tensor.cuda = stay_on_host
        try:
            return setup_weights(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = to_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


_PATCHES: Dict[str, Callable[[], None]] = {
    "current_device": _patch_current_device,
    "streams": _patch_streams,
    "rng_tracker": _patch_rng_tracker,
    "uneven_collectives": _patch_uneven_collectives,
    "sp_layernorm": _patch_sp_layernorm,
    "host_split_sizes": _patch_host_split_sizes,
    "missing_te": _patch_missing_te,
    "cuda_device_literals": _patch_cuda_device_literals,
    "float16_param_types": _patch_float16_param_types,
    "loss_scaler_state": _patch_loss_scaler_state,
    "clip_grads": _patch_clip_grads,
    "pipeline_embedding_sync": _patch_pipeline_embedding_sync,
}
