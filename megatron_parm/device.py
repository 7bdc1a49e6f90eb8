"""The device seam: the one module that asks ``torch.cuda`` anything.

Training, the dispatchers, the benchmarks and calibration ask here which device they run on,
how to wait for it and how to time it; nothing else in the project names ``torch.cuda``
(tests/unit/test_device_seam.py fails otherwise). The CPU redirects of
``megatron_parm.mcore_compat`` stay separate: they change Megatron-Core, only where CUDA is absent.

    is_cuda()            a CUDA device is usable (then collectives run on NCCL)
    current()            the device this rank computes on: cuda:<current> or the CPU
    HOST                 the CPU, named as the place of data that must live on the host
                         (split sizes, routing counts): a factory given device=HOST makes a
                         host tensor on purpose, one without a device makes it by accident
    set_device(index)    bind this process to its GPU (no-op on CPU); device_count()
    backend()            "nccl" on CUDA, "gloo" on CPU
    to_host(tensor)      one device -> host copy (a host synchronisation on CUDA)
    synchronize()        wait for the device (no-op on CPU)
    Timer                start() / stop() -> seconds; CUDA events on GPUs, perf_counter on CPU
    stamp(), seconds_between(start, end)    the same clocks, for stamps taken apart
    empty_cache()        the caching allocator's free blocks back (after an out-of-memory)
    memory_allocated(), max_memory_allocated(), reset_peak_memory_stats(), device_name()
    memory_stats()       the caching allocator's statistics ({} on CPU)
    device_memory_used() the whole GPU's memory in use, every process's (None on CPU)
    get_rng_state(), set_rng_state(state)   the device generator (None / no-op on CPU)
    sync_debug_mode(mode)                   torch.cuda.set_sync_debug_mode, restored on exit

Notes for GPUs: ``Timer`` records events on the current stream, so a stop() measures the
work queued on that stream (including the stream waits of collectives), and stop() blocks
until the end event has happened; a CPU timer synchronises the device first, so the two
measure the same thing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

HOST = torch.device("cpu")


def is_cuda() -> bool:
    return torch.cuda.is_available()


def current() -> torch.device:
    if is_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def set_device(index: int) -> None:
    if is_cuda():
        torch.cuda.set_device(index)


def device_count() -> int:
    return torch.cuda.device_count() if is_cuda() else 0


def backend() -> str:
    return "nccl" if is_cuda() else "gloo"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the host: the one blocking device -> host copy a caller means to make."""
    return tensor.to(HOST)


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


class Timer:
    """Elapsed time of the work between start() and stop(), in seconds."""

    def __init__(self):
        self._cuda = is_cuda()
        self._start_event = self._end_event = None
        self._start = 0.0

    def start(self) -> "Timer":
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._end_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        if self._cuda:
            self._end_event.record()
            self._end_event.synchronize()
            return self._start_event.elapsed_time(self._end_event) / 1e3
        return time.perf_counter() - self._start


def stamp():
    """Now, on the device's clock, without waiting: a recorded CUDA event, or perf_counter
    seconds on CPU. seconds_between(start, end) reads two of them (it waits for the end)."""
    if is_cuda():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def empty_cache() -> None:
    """Hand the caching allocator's free blocks back (after an out-of-memory); no-op on CPU."""
    if is_cuda():
        torch.cuda.empty_cache()


def memory_allocated() -> int:
    return torch.cuda.memory_allocated() if is_cuda() else 0


def max_memory_allocated() -> int:
    return torch.cuda.max_memory_allocated() if is_cuda() else 0


def memory_stats() -> dict:
    return torch.cuda.memory_stats() if is_cuda() else {}


def device_memory_used() -> Optional[int]:
    return torch.cuda.device_memory_used() if is_cuda() else None


def reset_peak_memory_stats() -> None:
    if is_cuda():
        torch.cuda.reset_peak_memory_stats()


def device_name() -> str:
    if is_cuda():
        return torch.cuda.get_device_name()
    return "cpu"


def get_rng_state() -> Optional[torch.Tensor]:
    return torch.cuda.get_rng_state() if is_cuda() else None


def set_rng_state(state: Optional[torch.Tensor]) -> None:
    if state is not None and is_cuda():
        torch.cuda.set_rng_state(state)


@contextlib.contextmanager
def sync_debug_mode(mode: str = "warn") -> Iterator[None]:
    """CUDA's synchronisation debug mode ("warn": a warning per host sync) inside the block;
    does nothing on CPU, where nothing synchronises."""
    if not is_cuda():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
