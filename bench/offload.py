"""Benchmark of `dflash extract` with the target's weights in page-locked host memory (--offload cpu: its decoder
layers streamed to the GPU a layer ahead of the forward, targets/streamed.py) against the same target resident on
the GPU, side by side in one run, through the real command.

    source bench/device_env.sh && python3 bench/offload.py --work /tmp/bo [--case qwen36_27b,qwen3_32b]
    python3 bench/offload.py --smoke --work /tmp/bo-smoke      # the same path on the CPU, tiny shapes

Cases (bf16, --layers auto, one GPU):
  qwen36_27b: the Qwen3.6-27B-shaped qwen3_5 text model of bench/targets.py (62 of 64 layers run);
  qwen3_32b:  a Qwen3-32B-shaped qwen3: hidden 5,120, 64 layers, 64/8 heads of dim 128, intermediate 25,600,
              vocab 151,936 (the stack of the issue's probe).
Each case runs the command twice on the same conversations: resident (--shard-weights 1 --offload none) and
offloaded (--shard-weights 1 --offload cpu), each at the command's default batch (32,768 and 65,536 tokens), and
once more resident at the offloaded run's batch (65,536 unless the measured host link grew it). Random weights are made inside the command
(this script with --child: the load is replaced by a random init on the GPU, whose decoder layers then move into
page-locked host memory when offloaded; the folder holds a one-tensor weights file for the fingerprint). Printed
per case: steady tok/s of each run (first forward to last commit, every byte on disk), offloaded / resident (the
issue asks >= 0.9), the peak GPU memory each run reserved after its weights were made, each run's peak host RSS, the
forward side's tok/s and the writer's waits, the --profile timeline's totals, and the largest target the placement rules let this
machine extract (one GPU, resident or offloaded). Offloaded, the child also prints whether the host layers are
page-locked, their bytes beside the process's RSS, the host memory left, and the GB/s of one layer's copy to the GPU
alone; the command's own summary gives the streamed copies' GB/s and the seconds the forward waited for them; and
with --trace the command's second batch forward runs under torch.profiler (its kernel and copy totals land in the
run's log; that forward is slower for it).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract as bx  # noqa: E402  (bench/extract.py: the command runner, the conversations)
import targets as bt  # noqa: E402  (bench/targets.py: the Qwen3.6-27B shape, the target folder)

CASES = {
    "qwen36_27b": bt.CASES["qwen36_27b"],
    "qwen3_32b": ("qwen3", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False)),
}
SMOKE = {
    "qwen36_27b": bt.SMOKE["qwen36_27b"],
    "qwen3_32b": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
}
RUNS = (("resident", ["--shard-weights", "1", "--offload", "none"]),
        ("offloaded", ["--shard-weights", "1", "--offload", "cpu"]),
        ("resident_64k", ["--shard-weights", "1", "--offload", "none", "--batch-tokens", "65536"]))


def random_sharded(model_dir: str | Path, device: torch.device, dtype: str, shard: int, offload: bool) -> object:
    """Return a random-init causal LM of the folder's config placed as target.sharded.load_sharded places a loaded
    one for --shard-weights 1 --offload cpu: built on the GPU, then its decoder layers moved into page-locked host
    memory and streamed a layer ahead (targets/streamed.py), the rest left on the GPU."""
    import torch.distributed as dist

    from dflash.targets.adapter import text_model
    from dflash.targets.streamed import stream_layers

    assert dist.get_world_size() == 1 and shard == 1 and offload, "the bench offloads on one GPU"
    model = bt.random_target(model_dir, device, getattr(torch, dtype))
    model.dflash_stream = stream_layers(model, text_model(model), device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the peak of the run, not of the random init made on the GPU
        try:  # figures, not the run: a failure here costs them only
            host_copies(model.dflash_stream, device)
        except Exception as e:  # noqa: BLE001
            print(f"BENCH host_copies not measured: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return model.eval()


def host_copies(stream: object, device: torch.device) -> None:
    """Print what the streamed weights cost the host and what one layer's copy to the GPU runs at alone: whether
    the host buffers are page-locked, their bytes beside the process's RSS and the host memory left, and the GB/s of
    one decoder layer's copy into a slot (the copy the forward overlaps with the previous layer), 5 times."""
    import time

    from dflash.runtime.memory import host_available_bytes

    layer = stream.layers[0]
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(f"BENCH host_layers {len(stream.layers)} pinned {stream.pinned} host_bytes {stream.host_bytes} "
          f"slot_bytes {sum(s.numel() for s in stream.slots)} process_rss {rss} host_available "
          f"{host_available_bytes()} layer0_pinned {layer.host.is_pinned()}", file=sys.stderr, flush=True)
    dst = stream.slots[0][: layer.nbytes]
    for i in range(6):  # the first round warms up
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(layer.host, non_blocking=True)
        torch.cuda.synchronize()
        if i:
            print(f"BENCH h2d_layer_gb_s {layer.nbytes / (time.perf_counter() - t) / 1e9:.1f} "
                  f"({layer.nbytes / 1e9:.2f} GB)", file=sys.stderr, flush=True)


def child(argv: list[str]) -> None:
    """Run the `dflash` entry point with random weights made inside it (what --child does); print the peak GPU
    memory reserved at exit."""
    import dflash.targets.load as loading
    import dflash.targets.sharded as sharded
    from dflash.cli import main

    loading.load_for_features = bt.random_target
    bt.skip_weight_check()
    sharded.load_sharded = random_sharded
    if torch.cuda.is_available() and os.environ.get("BENCH_TRACE") == "1":
        profile_batch_forward(sharded.ShardedRunner)
    if torch.cuda.is_available():
        atexit.register(lambda: print(f"BENCH peak_gpu_reserved {torch.cuda.max_memory_reserved()}", file=sys.stderr,
                                      flush=True))
    main(argv)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            total += max(0.0, min(b, y[k][1]) - max(a, y[k][0]))
            k += 1
    return total


def overlap_of(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> dict:
    """Return, in ms, how the device spent a profiled forward: compute kernels busy, host-to-device copies, the copy
    time that ran beside compute, and the device's idle gaps (neither) with the largest of them."""
    cu, co = _union(compute), _union(copies)
    busy = _union(cu + co)
    gaps = [b2[0] - b1[1] for b1, b2 in zip(busy, busy[1:])]
    return {"compute_ms": round(_length(cu) / 1e3, 1), "h2d_ms": round(_length(co) / 1e3, 1),
            "h2d_beside_compute_ms": round(_intersect(co, cu) / 1e3, 1),
            "span_ms": round((busy[-1][1] - busy[0][0]) / 1e3, 1) if busy else 0.0,
            "idle_ms": round(sum(gaps) / 1e3, 1), "largest_idle_ms": [round(g / 1e3, 1) for g in sorted(gaps)[-5:]],
            "h2d_copies": len(copies)}


def device_overlap(events: list) -> dict:
    """overlap_of the device events of a torch.profiler run (microseconds): memcpy HtoD against every kernel."""
    copies, compute = [], []
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CUDA") is False:
            continue
        span = (e.time_range.start, e.time_range.end)
        name = e.name.lower()
        if "memcpy" in name and "htod" in name.replace(" ", "").replace("_", ""):
            copies.append(span)
        elif "memcpy" not in name and "memset" not in name:
            compute.append(span)
    return overlap_of(copies, compute)


def profile_batch_forward(runner: type) -> None:
    """Have the runner's second forward of 8,192 tokens or more (extraction's, warm) run under torch.profiler and
    print where its time went: the CUDA kernels' and copies' totals (host-to-device copies are the offloaded weights)
    beside the forward's wall time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    plain, calls = runner.hidden, [0]

    def hidden(self, input_ids):
        calls[0] += input_ids.numel() >= 8192  # the self-check's short rows are not extraction's forwards
        if calls[0] != 2 or input_ids.numel() < 8192:
            return plain(self, input_ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = plain(self, input_ids)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        try:  # the table is a figure: a profiler that cannot make it costs the figure, not the run
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
        except Exception as e:  # noqa: BLE001
            table = f"(no table: {type(e).__name__}: {e})"
        print(f"BENCH profiled forward: {input_ids.numel():,} tokens in {wall:.2f} s\n{table}", file=sys.stderr,
              flush=True)
        try:
            print("BENCH overlap " + json.dumps(device_overlap(prof.events())), file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"BENCH overlap not measured: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return out

    runner.hidden = hidden


def run_case(name: str, args: argparse.Namespace) -> dict:
    """Return the three runs' figures of one case."""
    model_type, config = CASES[name]
    if args.smoke:
        config = {**config, **SMOKE[name]}
    work = args.work / name
    folder, data = work / "target", args.work / f"conversations-{args.tokens}.jsonl"
    bt.make_folder(folder, model_type, config)
    bx.make_conversations(data, args.tokens)
    gpus = "cpu" if args.smoke else "0"
    out: dict = {"case": name}
    for tag, flags in RUNS:
        if tag not in args.runs.split(","):
            continue
        if tag == "resident_64k" and not args.smoke and "offloaded" in out:  # the offloaded run's own batch (65,536 unless it grew)
            chosen = re.search(r"batches of ([\d,]+) tokens", out["offloaded"]["placement"] or "")
            flags = [*flags[:-1], chosen.group(1).replace(",", "") if chosen else flags[-1]]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        log = work / f"extract-{tag}.log"
        cmd = bx.run_command(folder, data, work / "store", gpus, ["--dtype", "bfloat16", *flags], log,
                             profile=work / f"timeline-{tag}.json", entry=[str(Path(__file__).resolve()), "--child"])
        text = log.read_text()
        peak = re.search(r"BENCH peak_gpu_reserved (\d+)", text)
        weights = re.search(r"^.*weights: .*$", text, re.M)
        # ru_maxrss of the children is the largest of any child so far (KB): a later run's only when it is larger.
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        out[tag] = {"steady_tok_s": cmd["steady_tok_s"], "forward_side_tok_s": cmd["forward_side_tok_s"],
                    "tokens": cmd["tokens"], "wall_s": round(cmd["wall_s"], 1), "load_s": cmd["load_s"],
                    "first_commit_s": cmd["first_commit_s"], "writer": cmd["writer"],
                    "timeline": cmd["timeline_line"], "bench_lines": re.findall(r"^BENCH (?:host|h2d|overlap|profiled).*$", text, re.M),
                    "streamed": (re.findall(r"weights streamed from .*$", text, re.M) or [None])[-1],
                    "gpu_peak_gb": round(int(peak.group(1)) / 1e9, 1) if peak else None,
                    "host_peak_rss_gb": round(rss * 1024 / 1e9, 1) if rss > before else "<= an earlier run's",
                    "placement": weights.group(0).split("weights: ", 1)[1] if weights else None}
        print(json.dumps({tag: out[tag]}), flush=True)
    if {"resident", "offloaded"} <= out.keys():
        res = out["resident"]["steady_tok_s"]
        out["offloaded_over_resident"] = round(out["offloaded"]["steady_tok_s"] / res, 3)
        out["offloaded_over_resident_same_batch"] = round(
            out["offloaded"]["steady_tok_s"] / out["resident_64k"]["steady_tok_s"], 3) if "resident_64k" in out else None
    return out


def largest_target() -> str:
    """Return the largest target the placement rules let this machine extract on one GPU, resident and offloaded."""
    from dflash.extract.placement import GPU_USABLE, HOST_USABLE
    from dflash.runtime.memory import host_available_bytes

    host = host_available_bytes() or 0
    free = torch.cuda.mem_get_info(0)[0] if torch.cuda.is_available() else 0
    return (f"one GPU with {free / 1e9:.0f} GB free holds about {free * GPU_USABLE / 2e9:.0f}B parameters in bf16 "
            f"resident (less a batch's activations); host memory ({host / 1e9:.0f} GB available) holds about "
            f"{host * HOST_USABLE / 2e9:.0f}B offloaded")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("bench-offload-out"))
    ap.add_argument("--case", default="qwen36_27b,qwen3_32b", help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--tokens", type=int, default=600_000, help="tokens of conversations per case")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (check the script first)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--runs", default="resident,offloaded,resident_64k",
                    help="which of the runs (a diagnosis of the offloaded one alone: --runs offloaded --trace)")
    ap.add_argument("--trace", action="store_true",
                    help="offloaded: run the command's second batch forward under torch.profiler (costs that forward time)")
    args = ap.parse_args()
    if args.trace:
        os.environ["BENCH_TRACE"] = "1"
    if args.smoke:
        args.tokens = min(args.tokens, 20_000)
        RUNS[2][1][-1] = "4096"  # a CPU's tiny target: the same-batch run at a batch it takes in seconds
    results = [run_case(name, args) for name in args.case.split(",")]
    for r in (r for r in results if "offloaded_over_resident" in r):
        print(f"{r['case']}: resident {r['resident']['steady_tok_s']:,.0f} tok/s "
              f"(GPU {r['resident']['gpu_peak_gb']} GB), offloaded {r['offloaded']['steady_tok_s']:,.0f} tok/s "
              f"(GPU {r['offloaded']['gpu_peak_gb']} GB, host RSS {r['offloaded']['host_peak_rss_gb']} GB): "
              f"offloaded / resident {r['offloaded_over_resident']} (issue: >= 0.9), at the same batch "
              f"{r['offloaded_over_resident_same_batch']}", flush=True)
    print(largest_target(), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
