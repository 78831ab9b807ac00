"""How close an extract worker ran to its device: the kernels its target ran, the model FLOPs a token and the
fraction of the device's dense bf16 peak its rate reached (MFU), for the summary, the log and --profile."""
from __future__ import annotations

from typing import Any

__all__ = ["device_peak", "memory_mark", "device_memory", "worker_perf", "perf_line"]


def device_peak(device: str) -> tuple[str, float | None]:
    """Return (the device's name, its dense bf16 FLOP/s or None when dflash does not know it: a CPU, an unlisted
    GPU; no MFU is reported then rather than a guess)."""
    if not str(device).startswith("cuda"):
        return "the CPU", None
    import torch

    from ..drafter.flops import peak_flops

    name = torch.cuda.get_device_name(torch.device(device))
    return name, peak_flops(name)


# The caching allocator's counters that say a run was at the edge of the device's memory: each retry freed every
# cached block (a device-wide synchronisation and cudaFree) and asked again, inside the forward that needed it.
_ALLOC_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def memory_mark(device: str) -> dict[str, int] | None:
    """Return the caching allocator's counters on a CUDA device now and start its peak afresh (the run's own peak,
    not its start-up's), or None off CUDA; device_memory(device, mark) gives the run's figures since."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    dev = torch.device(device)
    stats = torch.cuda.memory_stats(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return {k: int(stats.get(k, 0)) for k in _ALLOC_COUNTERS}


def device_memory(device: str, mark: dict[str, int] | None) -> dict[str, Any] | None:
    """Return the run's device memory since memory_mark: peak GiB allocated and reserved, the device's total, and
    how often the allocator retried (flushed its cache), called cudaMalloc and cudaFree, or ran out."""
    if mark is None:
        return None
    import torch

    dev = torch.device(device)
    stats = torch.cuda.memory_stats(dev)
    out: dict[str, Any] = {
        "peak_allocated_gib": round(stats.get("allocated_bytes.all.peak", 0) / 2**30, 2),
        "peak_reserved_gib": round(stats.get("reserved_bytes.all.peak", 0) / 2**30, 2),
        "total_gib": round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 2),
    }
    out.update({k.removeprefix("num_"): int(stats.get(k, 0)) - mark.get(k, 0) for k in _ALLOC_COUNTERS})
    return out


def worker_perf(runner: Any, name: str, peak: float | None, flops: float, tokens: int, steady_s: float,
                forward_device_s: float = 0.0, memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a worker's performance record on a device of this name and peak (device_peak): kernels, model
    FLOPs (total, a token), the steady rate's TFLOP/s and MFU (first forward to last commit, what the run
    delivered), and, where the device's own forward time was measured (--profile on CUDA), the forward's MFU
    alone; memory: device_memory's record of the run, where there is one."""
    kernels = getattr(runner, "kernels", None)
    out: dict[str, Any] = {
        "kernels": kernels.to_dict() if kernels is not None else None,
        "model_flops": flops,
        "flops_per_token": round(flops / tokens) if tokens else None,
        "device_name": name,
        "peak_flops": peak,
        "tflops_per_s": round(flops / steady_s / 1e12, 4) if steady_s > 0 else None,
    }
    out["mfu"] = round(flops / steady_s / peak, 4) if peak and steady_s > 0 else None
    if forward_device_s > 0:
        out["forward_device_s"] = round(forward_device_s, 4)
        out["forward_mfu"] = round(flops / forward_device_s / peak, 4) if peak else None
    if memory is not None:
        out["device_memory"] = memory
    stream = getattr(runner, "weight_stream", None)  # targets/streamed.py: weights streamed from host memory
    if stream is not None:
        out["weights_streamed"] = stream.stats()
    return out


def perf_line(p: dict[str, Any]) -> str:
    """Return the one-line human form of worker_perf's record."""
    k = p.get("kernels") or {}
    kernels = (f"attention {k.get('attention')}" + (f", experts {k['experts']}" if k.get("experts") else "")
               + (", layers compiled" if k.get("compiled") else ""))
    per = f"{_si(p['flops_per_token'])}FLOP a token" if p.get("flops_per_token") else "no tokens"
    rate = f"{_si(p['tflops_per_s'] * 1e12)}FLOP/s" if p.get("tflops_per_s") is not None else "no rate"
    if p.get("peak_flops"):
        mfu = f"MFU {100 * p['mfu']:.1f}% of {p['device_name']}'s {p['peak_flops'] / 1e12:.1f} TFLOP/s dense bf16"
        if p.get("forward_mfu") is not None:
            mfu += f" (the forward alone {100 * p['forward_mfu']:.1f}%)"
    else:
        mfu = f"no MFU: the bf16 peak of {p['device_name']} is not known to dflash"
    line = f"kernels: {kernels}; target forward {per}, {rate} to disk, {mfu}"
    w = p.get("weights_streamed")
    if w:
        speed = f"{w['copy_gb_s']:.1f} GB/s" if w.get("copy_gb_s") else "an unmeasured rate"
        where = {True: "page-locked host memory", False: "pageable host memory"}.get(w["pinned"], "host memory")
        line += (f"; weights streamed from {where} at {speed}, "
                 f"the forward waited {w['forward_wait_s']:.1f} s for them")
    m = p.get("device_memory")
    if m:
        line += f"; device memory peak {m['peak_reserved_gib']:.1f} of {m['total_gib']:.1f} GiB"
        if m.get("alloc_retries"):
            line += (f", the allocator flushed its cache {m['alloc_retries']:,} times (each a device-wide sync "
                     "inside a forward: a smaller --batch-tokens, or "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, avoids them)")
    return line


def _si(x: float) -> str:
    """Return x with an SI prefix and a space: 19.3 G, 421.7 T, 131.8 k."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {prefix}"
    return f"{x:.3g} "
