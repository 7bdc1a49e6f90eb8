"""A simulated accelerator for CPU tests: device-placement mistakes and host syncs, found on CPU.

On a GPU, a dispatcher that builds an index on the host and uses it with rows on the device
fails (index_select, index_copy_, cat, arithmetic: "Expected all tensors to be on the same
device"), and every .item() / .tolist() / .cpu() / masked_select of a device tensor makes the
host wait for the device. On CPU both go unnoticed, because host and device are the same.

``SimulatedDevice`` is a TorchFunctionMode that tells the two apart by where each tensor came
from, with the rules a CUDA device would apply:
- tensors given to ``mark_device`` (layer inputs, parameters) live on the device, and so does
  the result of any op that reads a device tensor;
- a factory (torch.zeros, arange, tensor, full, ...) makes a device tensor when it is given a
  device (``device=rows.device``, ``torch.cuda.current_device()``), and a host tensor when it
  is given none or the seam's ``HOST`` (megatron_parm.device.HOST, compared by
  identity: the way the code says "host on purpose"); ``new_*`` / ``*_like`` follow their
  tensor unless given a device;
- ``.cpu()``, ``.to(HOST)`` or ``.to("cpu")`` makes a host tensor (from a device tensor: a
  device -> host copy); ``.to(<any other device>)`` makes a device tensor;
- an op that reads a device tensor and a host tensor of one or more dimensions is a
  placement error (raised as RuntimeError, as CUDA does), except indexing and copies, which
  CUDA allows across devices;
- a host read of a device tensor (.item(), .tolist(), .numpy(), int(), bool(), .cpu(),
  masked_select, nonzero, ...) is recorded as a host synchronisation, with the first
  call site outside torch.

Tensors that the mode never saw being made (gradients made by the autograd engine) are of
unknown place and never cause an error.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, List, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megatron_parm.device import HOST

_ATTR = "_simulated_place"
DEVICE, HOSTED = "device", "host"

FACTORIES = {
    "zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor", "rand", "randn",
    "randint", "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor",
}
LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
        "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
# Host reads of a tensor's values: a synchronisation when the tensor is on the device.
SYNCS = {"item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "equal", "allclose",
         "masked_select", "nonzero", "unique", "unique_consecutive", "bincount", "cpu"}
# CUDA accepts a host index or a cross-device source for these.
MIXING_ALLOWED = {"__getitem__", "__setitem__", "to", "copy_", "cpu", "__get__", "__set__",
                  "size", "dim", "numel", "element_size", "is_contiguous", "data_ptr"}


def place(tensor):
    return getattr(tensor, _ATTR, None)


def mark_device(*tensors) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            setattr(tensor, _ATTR, DEVICE)


def mark_module(module: torch.nn.Module) -> None:
    mark_device(*module.parameters(), *module.buffers())


def _is_host(target) -> bool:
    """A .to() target that names the host: the seam's HOST (by identity) or the string 'cpu'.
    Any other device object (rows.device, torch.cuda.current_device()) is the device."""
    return target is HOST or (isinstance(target, str) and target.split(":")[0] == "cpu")


def _caller() -> str:
    """The first frame outside torch and this file: who asked."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name == __name__):
            return f"{name}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class SimulatedDevice(TorchFunctionMode):
    """See the module docstring. ``syncs``: [(op, call site)] in order; ``raise_on_mixing``:
    raise at the first placement error (default) or collect them in ``mixing``."""

    def __init__(self, raise_on_mixing: bool = True):
        super().__init__()
        self.syncs: List[Tuple[str, str]] = []
        self.mixing: List[Tuple[str, str]] = []
        self.raise_on_mixing = raise_on_mixing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        places = [place(t) for t in tensors]
        on_device = DEVICE in places

        if on_device and name not in MIXING_ALLOWED:
            host = [t for t in tensors if place(t) == HOSTED and t.dim() > 0]
            if host:
                site = _caller()
                self.mixing.append((name, site))
                if self.raise_on_mixing:
                    raise RuntimeError(
                        f"simulated device: {name} at {site} reads a device tensor and a host "
                        f"tensor of shape {tuple(host[0].shape)} (on a GPU: 'Expected all "
                        f"tensors to be on the same device')")

        self_place = places[0] if tensors and tensors[0] is (args[0] if args else None) else None
        to_host = name == "cpu" or (name == "to" and any(_is_host(a) for a in list(args[1:]) +
                                                          [kwargs.get("device")]))
        if self_place == DEVICE and (name in SYNCS or to_host):
            self.syncs.append((name, _caller()))
        elif name in ("masked_select", "nonzero") and on_device:
            self.syncs.append((name, _caller()))

        result = func(*args, **kwargs)
        if to_host and tensors and result is tensors[0]:
            result = result.clone()  # on a GPU, a copy: the device tensor keeps its place

        if name in FACTORIES or name in LIKE:
            given = kwargs.get("device")
            if given is not None:
                where = HOSTED if given is HOST else DEVICE
            elif name in LIKE and tensors:
                where = place(tensors[0])
            else:
                where = HOSTED
        elif to_host:
            where = HOSTED
        elif name == "to" and any(isinstance(a, (torch.device, str)) for a in list(args[1:]) +
                                  [kwargs.get("device")]):
            where = DEVICE
        elif on_device:
            where = DEVICE
        elif tensors and all(p == HOSTED for p in places):
            where = HOSTED
        else:
            where = None
        if where is not None:
            for out in tree_flatten(result)[0]:
                if isinstance(out, torch.Tensor) and not isinstance(out, torch.nn.Parameter):
                    try:
                        setattr(out, _ATTR, where)
                    except (AttributeError, RuntimeError):
                        pass
        return result


@contextlib.contextmanager
def covering_backward(mode: SimulatedDevice, functions: Sequence[type]) -> Iterator[None]:
    """Run the backward of these autograd.Function classes under ``mode`` too.

    The autograd engine does not carry a TorchFunctionMode into backward passes; inside the
    block, each class's backward enters the mode itself and takes its incoming gradients
    as device tensors (on a GPU they are on the device).
    """
    originals = {cls: cls.__dict__["backward"] for cls in functions}

    def wrap(original):
        def backward(ctx, *grads):
            mark_device(*grads)
            active = mode in torch.overrides._get_current_function_mode_stack()
            with contextlib.nullcontext() if active else mode:
                return original.__func__(ctx, *grads)
        return staticmethod(backward)

    for cls, original in originals.items():
        cls.backward = wrap(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.backward = original


def parm_autograd_functions() -> List[type]:
    """The project's autograd.Functions a layer call's backward runs through: the collectives'
    and the dispatchers' own (S1's dispatch and combine, S2's pipeline)."""
    from megatron_parm.comm import collectives
    from megatron_parm.dispatchers import parm_s1, parm_s2

    found = []
    for module in (collectives, parm_s1, parm_s2):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, torch.autograd.Function) \
                    and value is not torch.autograd.Function and value not in found \
                    and value.__module__ == module.__name__:
                found.append(value)
    return found
