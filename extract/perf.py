"""How close an extract worker ran to its device: the kernels its target ran, the model FLOPs a token and the
fraction of the device's dense bf16 peak its rate reached (MFU), for the summary, the log and --profile."""
from __future__ import annotations

from typing import Any

__all__ = ["device_peak", "worker_perf", "perf_line"]


def device_peak(device: str) -> tuple[str, float | None]:
    """Return (the device's name, its dense bf16 FLOP/s or None when dflash does not know it: a CPU, an unlisted
    GPU; no MFU is reported then rather than a guess)."""
    if not str(device).startswith("cuda"):
        return "the CPU", None
    import torch

    from ..drafter.flops import peak_flops

    name = torch.cuda.get_device_name(torch.device(device))
    return name, peak_flops(name)


def worker_perf(runner: Any, name: str, peak: float | None, flops: float, tokens: int, steady_s: float,
                forward_device_s: float = 0.0) -> dict[str, Any]:
    """Return a worker's performance record on a device of this name and peak (device_peak): kernels, model
    FLOPs (total, a token), the steady rate's TFLOP/s and MFU (first forward to last commit, what the run
    delivered), and, where the device's own forward time was measured (--profile on CUDA), the forward's MFU
    alone."""
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
    return line


def _si(x: float) -> str:
    """Return x with an SI prefix and a space: 19.3 G, 421.7 T, 131.8 k."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {prefix}"
    return f"{x:.3g} "
