"""Probe of where a Gated DeltaNet target's forward goes (issue 44, the dense goal): the Qwen3.6-27B shape's layers
at their real widths, cut to a few layers, forward only, under four ways of running what flash-linear-attention
does not: eager (what extract runs today), the depthwise convolution alone compiled (targets/linear.py's
shifted_conv), the decoder layers compiled around the Gated DeltaNet kernel (a graph break at it) with F.conv1d
in their graphs, and with shifted_conv (what kernels.compile_layers does). Prints each one's warm tok/s, MFU
(targets/flops.py), its difference from eager by the whole-tensor norm of the last layer's output, and one warm
forward under torch.profiler (the top kernels by device time) for eager and for the fastest.

    source bench/device_env.sh && python3 bench/gdn_probe.py              # one GPU, the real widths
    python3 bench/gdn_probe.py --smoke                                     # the same path on the CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import targets as bt  # noqa: E402  (the shapes)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, ids, device, warm=2, reps=4):
    for _ in range(warm):
        fn(ids)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(ids)
    sync(device)
    return (time.perf_counter() - t0) / reps, out


def profile(fn, ids, device, label):
    from torch.profiler import ProfilerActivity, profile as prof_

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof_(activities=acts) as p:
        fn(ids)
        sync(device)
    key = "self_cpu_time_total"
    if device.type == "cuda":
        key = "self_device_time_total" if hasattr(p.key_averages()[0], "self_device_time_total") \
            else "self_cuda_time_total"
    print(f"# {label}: one warm forward of {tuple(ids.shape)} by {key}\n"
          + p.key_averages().table(sort_by=key, row_limit=22), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (a multiple of 4: 3 linear, 1 full)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--variants", default="eager,conv,compiled,compiled+conv")
    ap.add_argument("--trace", default="eager,best")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.extract.perf import device_peak
    from dflash.targets import kernels, linear
    from dflash.targets.adapter import linear_attention_path
    from dflash.targets.runner import TargetRunner

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    model_type, cfg = bt.CASES["qwen36_27b"]
    cfg = dict(cfg) | (bt.SMOKE["qwen36_27b"] if args.smoke else {})
    cfg["num_hidden_layers"] = args.layers
    cfg["layer_types"] = cfg["layer_types"][: args.layers]
    if args.smoke:
        args.rows, args.length = 2, 200
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    layer_ids = [args.layers - 1]
    runner = TargetRunner(model, layer_ids, check=False)
    mod = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    orig_conv = mod.causal_conv1d_fn
    linear.prepare(model.model.layers[0])  # what compile_layers does: the recurrent kernels opaque to compile
    product_conv = mod.causal_conv1d_fn  # F.conv1d eager, linear.shifted_conv while compiling

    def set_variant(variant: str) -> bool:
        compiled = variant.startswith("compiled")
        if variant == "conv":  # the conv alone compiled, the layers eager
            mod.causal_conv1d_fn = torch.compile(linear.shifted_conv, dynamic=True)
        else:  # compiled: the layers around the recurrent kernel with F.conv1d in their graph
            mod.causal_conv1d_fn = product_conv if variant in ("eager", "compiled+conv") else orig_conv
        kernels.compile_layers(runner.text.layers, on=compiled)
        return compiled
    ids = torch.randint(0, cfg["vocab_size"], (args.rows, args.length), device=device)
    lens = [args.length] * args.rows
    flops = runner.flops.total(lens)
    name, peak = device_peak(str(device))
    print(json.dumps({"device": name, "torch": torch.__version__, "layers": args.layers,
                      "batch": [args.rows, args.length], "gflop_per_token": round(flops / sum(lens) / 1e9, 3),
                      "fla": linear_attention_path() if device.type == "cuda" else None,
                      "conv": getattr(orig_conv, "__module__", "?")}), flush=True)

    def forward(x):
        with torch.inference_mode():
            return runner.hidden(x)[-1]

    results, ref = {}, None
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        compiled = set_variant(variant)
        t0 = time.perf_counter()
        try:
            forward(ids)
            sync(device)
            first = time.perf_counter() - t0
            secs, out = timed(forward, ids, device)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
            continue
        out = out.float()
        if ref is None:
            ref = out
        err = ((out - ref).norm() / ref.norm()).item()
        tok_s = sum(lens) / secs
        row = {"variant": variant, "first_call_s": round(first, 1), "ms": round(1e3 * secs, 2),
               "tok_s": round(tok_s), "tflops": round(flops / secs / 1e12, 1),
               "mfu": round(flops / secs / peak, 4) if peak else None, "rel_err_vs_first": round(err, 5)}
        results[variant] = row
        print(json.dumps(row), flush=True)
        if "eager" in args.trace.split(",") and variant == "eager":
            profile(forward, ids, device, variant)
    if "best" in args.trace.split(",") and results:
        best = max(results.values(), key=lambda r: r["tok_s"])["variant"]
        if best != "eager":
            torch._dynamo.reset()
            set_variant(best)
            timed(forward, ids, device, warm=2, reps=1)
            profile(forward, ids, device, best)
    print("SUMMARY " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
