"""SDPA's attention kernels on the device, one by one, at the attention shapes of issue 44's targets: warm time, the
first call's cost on a shape not seen before (cuDNN builds an execution plan per shape), TFLOP/s, and each kernel's
error against the float32 math kernel. Which SDPA kernel extract should let the layers run is decided by this and by
the start-up self-check (targets/kernels.py), not here.

    source bench/device_env.sh && python3 bench/attention_probe.py [--smoke]

Shapes (rows x tokens, query heads / key-value heads, head dims):
  qwen3_30b_a3b: 3 x 3,992, 32/4 heads of 128 (GQA), causal
  qwen36_27b:    2 x 8,000, 24/4 heads of 256 (its full-attention layers), causal
  deepseek_v3:   3 x 3,992, 128/128 heads, q and k 192, v 128 (MLA as transformers runs it), causal
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (rows, tokens, query heads, kv heads, qk dim, v dim)
    "qwen3_30b_a3b": (3, 3992, 32, 4, 128, 128),
    "qwen36_27b": (2, 8000, 24, 4, 256, 256),
    "deepseek_v3": (3, 3992, 128, 128, 192, 128),
}
SMOKE = {"qwen3_30b_a3b": (2, 64, 4, 2, 16, 16), "deepseek_v3": (2, 64, 4, 4, 24, 16)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def tensors(shape: tuple, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple:
    b, s, hq, hk, dqk, dv = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hq, s, dqk, generator=g).to(device, dtype)
    k = torch.randn(b, hk, s, dqk, generator=g).to(device, dtype)
    v = torch.randn(b, hk, s, dv, generator=g).to(device, dtype)
    return q, k, v


def attend(q, k, v, backend: str, gqa: str) -> torch.Tensor:
    n = q.shape[1] // k.shape[1]
    if n > 1 and gqa == "repeat":
        k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    with sdpa_kernel([BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n > 1 and gqa == "sdpa")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn over reps calls (CUDA events on the GPU)."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def flops(shape: tuple) -> float:
    b, s, hq, hk, dqk, dv = shape
    return 2.0 * b * hq * (s * (s + 1) / 2) * (dqk + dv)  # causal: QK^T and PV over the lower triangle


def probe(name: str, shape: tuple, device: torch.device, reps: int, new_shapes: int) -> list[dict]:
    dtype = torch.bfloat16
    q, k, v = tensors(shape, device, dtype)
    want = attend(q.float(), k.float(), v.float(), "math", "repeat")
    rows = []
    for backend in ("flash", "cudnn", "efficient"):
        for gqa in (("sdpa", "repeat") if shape[2] != shape[3] else ("none",)):
            row = {"shape": name, "backend": backend, "gqa": gqa}
            try:
                sync(device)
                t = time.perf_counter()
                got = attend(q, k, v, backend, gqa)
                sync(device)
                row["first_s"] = round(time.perf_counter() - t, 4)
                warm = timed(lambda: attend(q, k, v, backend, gqa), device, reps)
                row["warm_ms"] = round(warm * 1e3, 3)
                row["tflops"] = round(flops(shape) / warm / 1e12, 1)
                err = (got.float() - want).norm() / want.norm()
                row["rel_err"] = float(f"{err.item():.3g}")
                # a shape not seen before (another length, as the packer makes nearly every batch): its first call
                firsts, warms = [], []
                for j in range(new_shapes):
                    s2 = shape[1] - 7 * (j + 1)
                    q2, k2, v2 = (x[:, :, :s2].contiguous() for x in (q, k, v))
                    sync(device)
                    t = time.perf_counter()
                    attend(q2, k2, v2, backend, gqa)
                    sync(device)
                    firsts.append(time.perf_counter() - t)
                    warms.append(timed(lambda: attend(q2, k2, v2, backend, gqa), device, 3))
                if new_shapes:
                    row["new_shape_first_ms"] = round(1e3 * sum(firsts) / len(firsts), 2)
                    row["new_shape_warm_ms"] = round(1e3 * sum(warms) / len(warms), 3)
            except Exception as e:  # noqa: BLE001 - a kernel the device or shape lacks: say so and go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (only the math kernel runs there)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-shapes", type=int, default=6)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    print(json.dumps(info), flush=True)
    rows = []
    for name, shape in (SMOKE if a.smoke else SHAPES).items():
        rows += probe(name, shape, device, 3 if a.smoke else a.reps, 2 if a.smoke else a.new_shapes)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
