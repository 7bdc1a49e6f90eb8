"""Peak memory of one step (forward + backward) of a layer, per rank.

On GPUs: the device allocator's peak (``torch.cuda.max_memory_allocated``, reset before the
step). On CPUs: the process's peak resident set size (VmHWM of /proc/self/status), reset
before the step by writing 5 to /proc/self/clear_refs (Linux >= 4.0), after the allocator
has handed free memory back to the system (glibc's malloc_trim), so that the peak is what
the step itself made resident. Both give the absolute peak and the rise over what was
resident (allocated) just before the step: the step's own memory (activations, messages,
saved tensors, gradients), which is what differs between dispatchers of the same layer.

glibc keeps freed memory of large tensors in its heap (its mmap threshold grows with the
sizes freed), and how much depends on the order of frees across threads: measured that way,
one dispatcher's peak moved by up to 10% between identical runs. ``exact_cpu_accounting``
makes every tensor of 64 KiB or more an mapping of its own, returned on free, so that the
resident set follows the live tensors; it makes allocation slower, so call it only in a
process that measures memory and never times.
"""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_parm import device

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


@dataclass(frozen=True)
class Peak:
    peak_bytes: int  # the whole process's (or device's) peak during the step
    step_bytes: int  # the peak's rise over what was resident just before the step
    kind: str  # "cuda_allocated" or "cpu_resident"


def _device_peak(fn: Callable[[], object]) -> Peak:
    """The device allocator's view (through the device seam)."""
    device.synchronize()
    device.reset_peak_memory_stats()
    before = device.memory_allocated()
    fn()
    device.synchronize()
    peak = device.max_memory_allocated()
    return Peak(peak, peak - before, "cuda_allocated")


def _status_bytes(field: str) -> int:
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"{_STATUS} has no {field}")


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak then includes retained free memory
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def exact_cpu_accounting() -> bool:
    """Large CPU tensors in mappings of their own (see the module's docstring); False where
    the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024))
    except (OSError, AttributeError):
        return False


def cpu_peak_supported() -> bool:
    return os.access(_CLEAR_REFS, os.W_OK) and os.path.exists(_STATUS)


def _cpu_peak(fn: Callable[[], object]) -> Peak:
    gc.collect()
    _trim()
    before = _status_bytes("VmRSS")
    with open(_CLEAR_REFS, "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    fn()
    peak = _status_bytes("VmHWM")
    return Peak(peak, peak - before, "cpu_resident")


def step_peak(fn: Callable[[], object]) -> Optional[Peak]:
    """The peak memory of running ``fn`` once on this rank, or None where it cannot be read."""
    if device.is_cuda():
        return _device_peak(fn)
    if not cpu_peak_supported():
        fn()
        return None
    return _cpu_peak(fn)
