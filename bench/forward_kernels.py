"""Benchmark of the target's forward at the GPU's speed (issue 44): `dflash extract` on random targets of real
shapes, beside the same target's truncated forward in every kernel choice dflash would try, in one run, with the
model FLOPs a token and the MFU of each.

    source bench/device_env.sh && python3 bench/forward_kernels.py --work /tmp/fk [--case gpt_oss_20b,qwen3_30b_a3b]
    python3 bench/forward_kernels.py --smoke --work /tmp/fk-smoke      # the same path on the CPU, tiny shapes

Cases (bf16, one GPU, --layers auto):
  gpt_oss_20b:    gpt-oss-20b-shaped (bench/targets.py): sliding 128 / full alternating, attention sinks, 32
                  experts top-4; 2026-12-03's command ran it at 11,728 tok/s (eager attention), the goal is 3x that;
  qwen3_30b_a3b:  Qwen3-30B-A3B-shaped qwen3_moe: hidden 2,048, 48 layers, 32/4 heads of dim 128, 128 experts
                  top-8 of width 768, vocab 151,936;
  deepseek_v3_cut: DeepSeek-V3-shaped (MLA: q rank 1,536, kv rank 512, nope 128 + rope 64, v 128; 128 heads;
                  hidden 7,168; 3 dense layers of 18,432 then MoE of width 2,048, 1 shared expert, top-8), cut to
                  fit one H200: 8 layers and 128 routed experts of the 256 (the per-token FLOPs are V3's);
  qwen36_27b:     Qwen3.6-27B-shaped (bench/targets.py): 3 Gated DeltaNet : 1 gated full attention, dense.
Each case runs
  (1) `dflash extract --gpus 0` as a subprocess (bench/targets.py --child: the command's own entry point with a
      random init on the GPU in place of the weights' load): its steady tok/s (first forward to last commit), the
      kernels its self-check chose and its MFU line, from its log;
  (2) in this process, the model's own truncated forward (TargetRunner.hidden, no self-check) over exactly the
      batches the command ran, once per kernel choice (targets/kernels.candidates: attention x experts), a cold
      pass (flex compiles there) then a warm one, with its model FLOPs (targets/flops.py) and MFU;
and prints, per case: the command's tok/s and MFU, each kernel choice's warm tok/s and MFU, the command over the
best forward, and the goals (MoE >= 35% MFU, dense >= 55%, the command >= 0.95 of the forward, gpt-oss >= 3 x
11,728 tok/s).
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract as bx  # noqa: E402  (bench/extract.py: the data, the command's batches)
import targets as bt  # noqa: E402  (bench/targets.py: the shapes, the folder, the command with a random target)

CASES = {
    "gpt_oss_20b": bt.CASES["gpt_oss_20b"],
    "qwen3_30b_a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "deepseek_v3_cut": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=8, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen36_27b": bt.CASES["qwen36_27b"],
}
SMOKE = {
    "gpt_oss_20b": bt.SMOKE["gpt_oss_20b"],
    "qwen3_30b_a3b": dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=4096),
    "deepseek_v3_cut": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                            n_group=2, topk_group=1, num_experts_per_tok=2, max_position_embeddings=4096),
    "qwen36_27b": bt.SMOKE["qwen36_27b"],
}
MOE = ("gpt_oss_20b", "qwen3_30b_a3b", "deepseek_v3_cut")
GOALS = {"moe_mfu": 0.35, "dense_mfu": 0.55, "command_over_forward": 0.95, "gpt_oss_tok_s": 3 * 11_728}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def command_figures(log: str) -> dict:
    """Return what the command's log says of its kernels and its MFU (extract/perf.py's summary line)."""
    chose = re.search(r"dflash\.targets\.kernels: kernels: (.*?) \(checked", log)
    passed = re.findall(r"dflash\.targets\.kernels: (.*?): (?:differs|cannot run)", log)
    mfu = re.search(r"MFU ([\d.]+)%", log)
    per = re.search(r"target forward ([\d.]+ \w?)FLOP a token", log)
    return {"kernels": chose.group(1) if chose else None, "passed_over": passed,
            "mfu": float(mfu.group(1)) / 100 if mfu else None, "flop_a_token": per.group(1) if per else None}


def trace_forward(runner: Any, ids: torch.Tensor, device: torch.device, label: str) -> None:
    """Print torch.profiler's table of one warm forward of a batch: where the forward's time goes, by kernel (the
    self time on the device, on a GPU; on the CPU, its own), the 25 costliest."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        runner.hidden(ids.to(device, non_blocking=True))
        _sync(device)
    table = prof.key_averages()
    key = "self_cpu_time_total"
    if cuda:
        key = "self_device_time_total" if hasattr(table[0], "self_device_time_total") else "self_cuda_time_total"
    print(f"# one warm forward of {ids.shape[0]} x {ids.shape[1]} tokens under torch.profiler ({label}), by {key}:\n"
          + table.table(sort_by=key, row_limit=25), flush=True)


def features_pass(runner: Any, batches: list, device: torch.device, codec: str | None) -> tuple[int, list[float]]:
    """Return the tok/s of a warm pass over the batches as extract's forward loop runs each on the device: the
    forward, the real tokens' features gathered (TargetRunner.features) and, under a scaled codec on CUDA, encoded
    (pipeline.encode_features), no copy to the host; and each batch's seconds (CUDA events around each, as the
    command's --profile times its forwards, no synchronize between them; on the CPU its wall time). Its ratio to the
    bare forward is the device's share of the command's work beyond the forward; the command's own ratio to it,
    what the rest of the command costs, and batch_by_batch says in which batches."""
    from dflash.extract.pipeline import encode_features
    from dflash.storage.codec import SCALED_CODECS

    encode = codec in SCALED_CODECS and device.type == "cuda"
    cuda = device.type == "cuda"
    tokens = sum(sum(lens) for _, lens in batches)
    marks: list[Any] = []
    _sync(device)
    t0 = time.perf_counter()
    for ids, lens in batches:
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        b0 = time.perf_counter()
        feats = runner.features(ids.to(device, non_blocking=True), lens)
        if encode:
            encode_features(feats, codec)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            marks.append((start, end))
        else:
            marks.append(time.perf_counter() - b0)
    _sync(device)
    rate = round(tokens / (time.perf_counter() - t0))
    return rate, [m[0].elapsed_time(m[1]) / 1e3 if cuda else m for m in marks]


def batch_by_batch(command_batches: list[dict], bench: list[float], shapes: list[tuple[int, int]]) -> dict:
    """Return the command's forwards (its --profile rows: the device's time on CUDA, else the forward thread's) set
    beside the bench's warm features pass over the same batches, batch by batch: totals, the ratio's spread, the
    first batches' excess, and the batches with the most excess; {"matched": False, ...} where the two ran other
    batches."""
    key = "forward_device_s" if command_batches and "forward_device_s" in command_batches[0] else "host_forward_s"
    got = [(b["rows"], b["length"]) for b in command_batches]
    if got != shapes or len(bench) != len(shapes):
        return {"matched": False, "command_batches": len(got), "bench_batches": len(shapes)}
    cmd = [b[key] for b in command_batches]
    ratios = sorted(c / max(w, 1e-9) for c, w in zip(cmd, bench))
    excess = [c - w for c, w in zip(cmd, bench)]
    worst = sorted(range(len(excess)), key=lambda i: -excess[i])[:5]
    q = lambda f: round(ratios[min(len(ratios) - 1, int(f * len(ratios)))], 3)  # noqa: E731
    return {"matched": True, "timed_by": key, "batches": len(cmd), "command_s": round(sum(cmd), 3),
            "bench_s": round(sum(bench), 3), "ratio": round(sum(cmd) / max(sum(bench), 1e-9), 3),
            "ratio_p10_p50_p90": [q(0.1), q(0.5), q(0.9)], "excess_first_10_s": round(sum(excess[:10]), 3),
            "excess_rest_s": round(sum(excess[10:]), 3),
            "worst": [{"batch": i, "shape": list(shapes[i]), "command_s": round(cmd[i], 4),
                       "bench_s": round(bench[i], 4)} for i in worst]}


def _shown(row: dict) -> dict:
    """Return a forward's row without its per-batch lists (batch_by_batch reads them)."""
    return {k: v for k, v in row.items() if k not in ("features_batch_s", "batch_shapes")}


def parse_also(spec: str) -> tuple[Any, bool]:
    """Return (Kernels, compiled) of an --also entry "attention,experts[,compile]" (experts empty for a dense
    target: "sdpa,,compile"); compile: every decoder layer under torch.compile (dynamic shapes), its first cold pass
    counting the compilation."""
    from dflash.targets import kernels

    parts = spec.split(",")
    if len(parts) not in (2, 3) or not parts[0] or (len(parts) == 3 and parts[2] != "compile"):
        raise SystemExit(f"--also {spec!r}: expected attention,experts or attention,experts,compile "
                         "(experts empty for a dense target), e.g. sdpa,dflash_grouped_mm,compile")
    return kernels.Kernels(parts[0], parts[1] or None), len(parts) == 3


def forward_by_kernels(folder: Path, data: Path, store: Path, device: torch.device, only: str | None = None,
                       trace: bool = False, floors: tuple[int, ...] = (0,), also: tuple[str, ...] = (),
                       features: bool = False) -> list[dict]:
    """Return, per kernel choice dflash would try for this target (targets/kernels.candidates) and per packing floor
    (plan.pack_batches: 0 packs as the command does for a resident target, larger ones into fewer, fuller
    forwards), the truncated forward's cold and warm tok/s over those batches, its TFLOP/s and MFU (warm). also:
    more "attention,experts" pairs to time after them (e.g. sdpa,dflash_grouped_mm: targets/experts.py), whether or
    not dflash would try them. features: for the command's packing, one more warm pass as the command's forward loop
    runs each batch (features_pass)."""
    from dflash.extract.perf import device_peak
    from dflash.targets import experts, kernels
    from dflash.targets.runner import TargetRunner

    packed = {f: bx.command_batches(folder, data, store, device, floor_tokens=f) for f in floors}
    header = packed[floors[0]][0]
    model = bt.random_target(folder, device, torch.bfloat16)
    runner = TargetRunner(model, header["layer_ids"], check=False)
    name, peak = device_peak(str(device))
    out = []
    experts.register()
    extra = [parse_also(a) for a in also]
    compiled_only = bool(only and only.endswith(", layers compiled"))  # the command compiled its layers
    only = only.removesuffix(", layers compiled") if only else only
    tried = [(k, compiled_only if only else False) for k in kernels.candidates(model, runner.kinds, device)
             if only is None or str(k) == only]
    last = None
    for (k, compiled), floor in ((kc, f) for kc in tried + [kc for kc in extra if kc not in tried] for f in floors):
        if (k, compiled) != last:
            torch._dynamo.reset()  # compiled afresh for these kernels: the first floor's cold pass compiles
            kernels.compile_layers(runner.text.layers, on=compiled)
            last = (k, compiled)
        batches = packed[floor][1]
        tokens = sum(sum(lens) for _, lens in batches)
        flops = sum(runner.flops.total(lens) for _, lens in batches)
        row = {"kernels": str(k) + (", compiled" if compiled else ""), "tokens": tokens,
               "flops_per_token": round(flops / tokens)}
        if (k, compiled) not in tried:
            row["also"] = True  # not a choice extract makes: never the "best forward" the command is held to
        if floors != (0,):
            row |= {"floor_tokens": floor, "forwards": len(batches),
                    "padded_tokens": sum(ids.numel() for ids, _ in batches)}
        try:
            kernels.apply(model, k)
            for name_ in ("cold", "warm"):
                bx.settle()
                _sync(device)
                t0 = time.perf_counter()
                for ids, _ in batches:
                    runner.hidden(ids.to(device, non_blocking=True))
                _sync(device)
                row[f"{name_}_tok_s"] = round(tokens / (time.perf_counter() - t0))
            if features and floor == 0 and (k, compiled) in tried:
                row["features_tok_s"], row["features_batch_s"] = features_pass(runner, batches, device,
                                                                               header.get("codec"))
                row["batch_shapes"] = [tuple(ids.shape) for ids, _ in batches]
            if trace and floor == floors[0]:
                trace_forward(runner, batches[0][0], device, row["kernels"])
        except Exception as e:  # noqa: BLE001 - out of memory (batched experts), a kernel this machine lacks
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            out.append(row)
            print(json.dumps(_shown(row)), flush=True)
            continue
        rate = flops * row["warm_tok_s"] / tokens
        row["tflops_per_s"] = round(rate / 1e12, 2)
        row["mfu"] = round(rate / peak, 4) if peak else None
        out.append(row)
        print(json.dumps(_shown(row)), flush=True)
    # The variants run the command again on this GPU: this process must give its target back first (on 2026-12-06
    # a variant found 45.7 of 80 GB free with the gpt-oss-20b shape's 42 GB still held here, and streamed its
    # weights from the host). torch.compile's caches hold the compiled layers, and through them the weights.
    gone = weakref.ref(model)
    del runner, model, packed
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(json.dumps({"forward_model_freed": gone() is None,
                          "gpu_bytes_still_allocated": torch.cuda.memory_allocated(device)}), flush=True)
    elif gone() is not None:
        print(json.dumps({"forward_model_freed": False}), flush=True)
    return out


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Return the command's and each kernel choice's figures of one case."""
    work, folder, data = bt.prepare_case(name, CASES[name], SMOKE[name] if args.smoke else None, args)
    flags = (["--codec", args.codec] if args.codec else []) + ["--compile-layers", args.compile]
    cmd, _ = bt.extract_run(folder, data, work, "cpu" if args.smoke else "0", flags, "")
    said = command_figures((work / "extract.log").read_text())
    if cmd["timeline"] is not None:
        print(bx.timeline_totals(cmd["timeline"]), flush=True)
    print(json.dumps({"case": name, "command": {"steady_tok_s": cmd["steady_tok_s"], "wall_s": round(cmd["wall_s"], 1),
                                                **said}}), flush=True)
    forwards = forward_by_kernels(folder, data, work / "store", device, said["kernels"] if args.only_chosen else None,
                                  trace=args.trace, floors=tuple(int(f) for f in args.floors.split(",")),
                                  also=tuple(a for a in args.also.split(";") if a), features=args.features)
    # the command's own packing and kernel choices: what extract could have run
    done = [f for f in forwards if "warm_tok_s" in f and not f.get("floor_tokens") and not f.get("also")]
    best = max(done, key=lambda f: f["warm_tok_s"]) if done else None
    beside, compare = None, None
    if best and best.get("features_batch_s"):
        lists = best["features_batch_s"], best["batch_shapes"]

        def compare(timeline: dict | None) -> dict | None:  # a run of the command beside the bench's pass
            return batch_by_batch(timeline.get("batches", []), *lists) if timeline is not None else None

        beside = compare(cmd["timeline"])
        print(json.dumps({"case": name, "command_batch_by_batch": beside}), flush=True)
    forwards = [_shown(f) for f in forwards]
    best = _shown(best) if best else best
    out = {"case": name, "command": {"steady_tok_s": cmd["steady_tok_s"], "wall_s": round(cmd["wall_s"], 1),
                                     **said}, "forwards": forwards, "best": best, "batch_by_batch": beside}
    if best:
        out["command_over_best_forward"] = round(cmd["steady_tok_s"] / best["warm_tok_s"], 3)
        if args.variants:
            out["variants"] = bt.run_variants(folder, data, work, "cpu" if args.smoke else "0", args.variants,
                                              best["warm_tok_s"], flags, compare)
    return out


def verdict(r: dict) -> str:
    """Return a case's line beside the goals."""
    c, best = r["command"], r["best"] or {}
    goal = GOALS["moe_mfu"] if r["case"] in MOE else GOALS["dense_mfu"]
    mfu = c["mfu"]
    parts = [f"{r['case']}: extract {c['steady_tok_s']:,.0f} tok/s, MFU "
             + (f"{100 * mfu:.1f}% (goal {100 * goal:.0f}%: {'met' if mfu >= goal else 'NOT met'})"
                if mfu is not None else "unknown (no peak for this device)"),
             f"kernels {c['kernels']}" + (f" (passed over: {'; '.join(c['passed_over'])})" if c["passed_over"] else "")]
    if best:
        ratio = r["command_over_best_forward"]
        parts.append(f"best forward {best['kernels']} {best['warm_tok_s']:,} tok/s"
                     + (f" MFU {100 * best['mfu']:.1f}%" if best.get("mfu") is not None else "")
                     + f"; extract / forward {ratio} (goal {GOALS['command_over_forward']})")
        if best.get("features_tok_s"):
            f = best["features_tok_s"]
            parts.append(f"forward with features and encoding {f:,} tok/s ({f / best['warm_tok_s']:.3f} of the "
                         f"forward); extract / that {c['steady_tok_s'] / f:.3f}")
    if r["case"] == "gpt_oss_20b":
        parts.append(f"vs 2026-12-03's 11,728 tok/s: {c['steady_tok_s'] / 11_728:.2f}x (goal 3x)")
    return "; ".join(parts)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return bt.child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("bench-forward-kernels-out"))
    ap.add_argument("--case", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--tokens", type=int, default=150_000, help="tokens of conversations per case")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (check the script first)")
    ap.add_argument("--only-chosen", action="store_true", help="time only the kernels the command chose")
    ap.add_argument("--floors", default="0",
                    help="comma-separated packing floors (tokens a forward counts at least, plan.pack_batches) to time "
                         "the forward at: 0 is the command's packing of a resident target; e.g. 0,16384,32768 asks "
                         "whether fewer, fuller forwards run an MoE target's grouped GEMMs faster")
    ap.add_argument("--also", default="",
                    help="semicolon-separated attention,experts pairs to time after the command's candidates (with "
                         "--only-chosen, after its choice), e.g. sdpa,dflash_grouped_mm (targets/experts.py); a third "
                         "field ',compile' runs every decoder layer under torch.compile (dynamic shapes); a dense "
                         "target's experts field is empty (sdpa,,compile). Never the best forward the command is "
                         "held to: extract does not run them")
    ap.add_argument("--compile-layers", dest="compile", default="on", choices=("auto", "on", "off"),
                    help="the command's --compile-layers (default on: what auto does on a run of 10M tokens or "
                         "more, the runs a user waits for; a case of this bench is shorter)")
    ap.add_argument("--features", action="store_true",
                    help="for the command's kernels and packing, one more warm pass that also gathers each batch's "
                         "features and encodes them as the command does on the device: how much of the command's gap "
                         "to its forward is that work, and how much the rest (threads, copies, the allocator)")
    ap.add_argument("--variants", default="",
                    help="';'-separated reruns of the command after the forwards, each with extra extract flags and "
                         "NAME=VALUE in its environment (bench/targets.py run_variants), e.g. '--writer-threads 2;"
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True': their tok/s over the best forward")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--trace", action="store_true",
                    help="after each kernel choice's warm pass, one more forward under torch.profiler: its costliest "
                         "kernels (where an MoE forward's time goes)")
    ap.add_argument("--codec", default=None,
                    help="the command's --codec (default: its own, uq6 for a new store since 2026-12-05); with "
                         "another --work than a run of another codec's: whether a shape's extraction waits on the "
                         "disk (issue 44's DeepSeek-V3 cut)")
    args = ap.parse_args()
    for a in (a for a in args.also.split(";") if a):
        parse_also(a)  # a misspelt entry ends the run before its first case, not after it
    if args.smoke:
        args.tokens = min(args.tokens, 6_000)
    device = torch.device("cpu" if args.smoke else "cuda:0")
    results = bt.run_cases(run_case, args, device)
    for r in results:
        print(verdict(r), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
