"""Running out of memory: recognising it on the device and on the host, and saying how much is free."""
from __future__ import annotations

from typing import Any

__all__ = ["is_out_of_memory", "host_available_bytes", "free_memory", "out_of_memory_error"]


def is_out_of_memory(e: BaseException) -> bool:
    """Return True if `e` is an allocation that failed: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU
    allocator's RuntimeError."""
    import torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def host_available_bytes() -> int | None:
    """Return the host's available memory (MemAvailable in /proc/meminfo) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_memory(device: Any) -> str:
    """Return the device's free memory in words, for a message (the host's available memory for a CPU)."""
    import torch

    device = torch.device(device)
    try:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB on {device}"
        available = host_available_bytes()
        return "free memory unknown" if available is None else f"{available / 2**30:.1f} GiB of host memory available"
    except (OSError, KeyError, ValueError, IndexError, RuntimeError):
        return "free memory unknown"


def out_of_memory_error(what: str, device: Any, options: str, error: BaseException) -> Any:
    """Return the ResourceError of a command whose batch ran out of memory: what ran out, the free memory, and the
    options that shrink the batch."""
    from ..errors import ResourceError

    detail = str(error).splitlines()[0][:120] if str(error) else "no detail"
    return ResourceError(f"{what} ran out of memory ({free_memory(device)}; {type(error).__name__}: {detail}); "
                         f"rerun with {options}")
