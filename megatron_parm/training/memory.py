"""Memory in the log: Megatron-LM's memory line (--log-memory-interval, --log-device-memory-used)
and its TensorBoard values (--log-memory-to-tensorboard).

    memory_line(label, device_memory_used)   '(after 10 iterations) memory (MB) | ...'
    report_memory(label, device_memory_used) that line, printed by each rank of data-parallel
                                             rank 0 as '[Rank r] ...' (Megatron-LM's habit)
    memory_scalars()                         {TensorBoard tag: bytes}

What is measured:
  on a GPU   the caching allocator's statistics, as Megatron-LM reports them: allocated, max
             allocated, reserved, max reserved (MB), the whole device's memory in use
             (torch.cuda.device_memory_used, every process's) with --log-device-memory-used;
             TensorBoard: mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes,
             mem-allocated-count
  on CPU     there is no allocator to ask: the process's resident memory (RSS) and its peak
             (getrusage's max RSS), and with --log-device-memory-used the host's memory in use
             (total minus available, every process's); TensorBoard: mem-resident-bytes,
             mem-max-resident-bytes (named apart from the GPU's tags: they measure something
             else)
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_parm import device

MEGABYTE = 1024.0 * 1024.0


def _resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _max_resident_bytes() -> Optional[int]:
    """The process's peak resident memory: getrusage's (KiB on Linux), which the kernel
    updates lazily, so never below the current resident memory."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _resident_bytes())


def _host_memory_used() -> int:
    import psutil

    memory = psutil.virtual_memory()
    return memory.total - memory.available


def memory_line(label: str, device_memory_used: bool = False) -> str:
    """LABEL's memory line, in MB (Megatron-LM's report_memory format on a GPU)."""
    line = f"{label} memory (MB)"
    if device.is_cuda():
        stats = device.memory_stats()
        line += f" | allocated: {stats['allocated_bytes.all.current'] / MEGABYTE:.2f}"
        line += f" | max allocated: {stats['allocated_bytes.all.peak'] / MEGABYTE:.2f}"
        line += f" | reserved: {stats['reserved_bytes.all.current'] / MEGABYTE:.2f}"
        line += f" | max reserved: {stats['reserved_bytes.all.peak'] / MEGABYTE:.2f}"
        if device_memory_used:
            line += f" | total device memory used: {device.device_memory_used() / MEGABYTE:.2f}"
        return line
    line += f" | resident: {_resident_bytes() / MEGABYTE:.2f}"
    peak = _max_resident_bytes()
    if peak is not None:
        line += f" | max resident: {peak / MEGABYTE:.2f}"
    if device_memory_used:
        line += f" | total host memory used: {_host_memory_used() / MEGABYTE:.2f}"
    return line


def report_memory(label: str, device_memory_used: bool = False) -> None:
    """Print this rank's memory line where its data-parallel rank is 0 (one line per
    model-parallel rank)."""
    import torch
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() == 0:
        print(f"[Rank {torch.distributed.get_rank()}] {memory_line(label, device_memory_used)}",
              flush=True)


def memory_scalars() -> Dict[str, float]:
    """This rank's memory as TensorBoard values."""
    if device.is_cuda():
        stats = device.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    values = {"mem-resident-bytes": _resident_bytes()}
    peak = _max_resident_bytes()
    if peak is not None:
        values["mem-max-resident-bytes"] = peak
    return values
