"""Where `dflash extract`'s steady rate goes: its own pipeline in this process, each thing that runs beside the
forward switched on in turn, over the batches of bench/extract.py's cases (same target, data and shard plan).

    source bench/device_env.sh && python3 bench/extract_parts.py --work /tmp/bx --case short
    python3 bench/extract_parts.py --smoke                     # a small Qwen3 on the CPU: checks the script

Variants (--variants, comma-separated; each runs every shard of the case once):
  hidden        the truncated forward alone (runner.hidden, nothing captured): bench/extract.py's baseline
  features      + capturing the layers (index_select, stack), nothing copied
  discard       + the pinned host copy and the writer thread, features dropped (FeaturePipeline, DiscardSink)
  store         + a real store on --store-dir (compression pool, fsyncs, commits): fill_shards as the command runs
                it, on samples tokenised beforehand
  tok           store + tokenising the next shard on a thread (the command's path)
  tok_si        tok with sys.setswitchinterval(0.0002) (CPython's default is 0.005)
  tok_gc        tok with the cyclic garbage collector off (gc.freeze, gc.disable)
  tok_w4        tok with 4 compression threads instead of the machine's share
  tok_profile   tok with --profile's CUDA events around each forward and copy
  *_cudnn       hidden_cudnn, features_cudnn, tok_cudnn: the same with SDPA free to pick cuDNN's attention, which
                the runner excludes (targets/runner.attention_backends: cuDNN plans each new shape)
  empty_cache   no pass: torch.cuda.empty_cache(), so the next variant's allocations go to the driver again
A variant may be named more than once (e.g. hidden,hidden,empty_cache,hidden: a cold pass, a warm one, and one
after the allocator's cache was emptied).
Each prints tok/s and its ratio to `hidden`, the device's busy time over the span of its forwards (CUDA events
around each forward, no synchronize), the main thread's CPU seconds (time.thread_time: near the wall means the
thread that launches the kernels is the limit) and the timeline's parts.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract as bx  # noqa: E402  (bench/extract.py: the cases' targets and data)

ALL = ("hidden", "features", "discard", "store", "tok", "tok_si", "tok_gc", "tok_w4", "tok_profile", "hidden_cudnn",
       "features_cudnn", "tok_cudnn", "empty_cache")
# The caching allocator's counters whose change over a variant is printed: cudaMalloc/cudaFree calls, retries
# after a failed cudaMalloc (which free the cache and synchronise).
ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


class TimedRunner:
    """The runner with CUDA events around each call of features/hidden (no synchronize): the device's busy time."""

    def __init__(self, runner: Any) -> None:
        self._r = runner
        self.events: list[tuple[Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._r, name)

    def _timed(self, fn: Any, *args: Any) -> Any:
        if self._r.device.type != "cuda":
            return fn(*args)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn(*args)
        e.record()
        self.events.append((s, e))
        return out

    def features(self, ids: Any, lens: list[int]) -> Any:
        return self._timed(self._r.features, ids, lens)

    def hidden(self, ids: Any) -> Any:
        return self._timed(self._r.hidden, ids)

    def device_figures(self) -> dict[str, float]:
        if not self.events:
            return {}
        torch.cuda.synchronize()
        busy = sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        span = self.events[0][0].elapsed_time(self.events[-1][1]) / 1e3
        self.events = []
        return {"device_busy_s": round(busy, 3), "device_span_s": round(span, 3),
                "device_idle_share": round(1 - busy / span, 4) if span else 0.0}


class DiscardSink:
    """A sink (extract/pipeline.py's Sink) that drops features after the host copy: the pipeline without disk."""

    def append(self, input_ids: Any, loss_mask: Any, features: Any, sample_id: int) -> None:
        return None


def setup(args: argparse.Namespace) -> dict[str, Any]:
    """Return the case's config, header, rows, encoder, runner and per-shard samples (the command's own steps)."""
    from dflash.conversations import read_rows
    from dflash.config import ExtractConfig
    from dflash.targets.load import load_for_features
    from dflash.targets.runner import TargetRunner
    from dflash.extract.header import build_header
    from dflash.extract.orchestrate import _model_files
    from dflash.extract.plan import make_plan, scan_rows
    from dflash.extract.template import ChatEncoder, load_template
    from dflash.extract.worker import prepare_shard

    device = torch.device("cpu" if args.smoke else "cuda:0")
    config = bx.SMOKE_CONFIG if args.smoke else bx.QWEN3_8B_CONFIG
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, data, flags = bx.prepare_case(args.case, work, device, config, args)
    store_dir = Path(args.store_dir or work) / "parts-store"
    cfg = ExtractConfig(model=str(model), data=(str(data),), out=str(store_dir), gpus="cpu" if args.smoke else "0",
                        dtype="bfloat16", shard_size=3 if "--shard-size" in flags else None)
    model_config, tokenizer = _model_files(cfg.model)
    template = load_template(tokenizer, cfg.chat_template)
    rows = read_rows(cfg.data)
    scan = scan_rows(rows, cfg.max_length)
    header = build_header(cfg, model_config, tokenizer, template, scan)
    encoder = ChatEncoder(tokenizer, template, cfg.max_length, cfg.chat_template_kwargs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t0 = time.perf_counter()
    runner = TimedRunner(TargetRunner(load_for_features(cfg.model, device, torch.bfloat16), header["layer_ids"]))
    print(f"target loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    plan = make_plan(header, rows, scan, (), cfg.out, [str(device)])
    t0 = time.perf_counter()
    shards = [prepare_shard(plan.shard_rows(s)[2], encoder, cfg.min_loss_tokens, False)[0]
              for s in range(plan.num_shards)]
    tokens = sum(len(s.input_ids) for sh in shards for s in sh)
    print(f"{len(rows)} rows, {len(shards)} shards, {tokens:,} tokens tokenised in {time.perf_counter() - t0:.1f} s "
          "(one thread, nothing beside it)", flush=True)
    return {"cfg": cfg, "header": header, "plan": plan, "encoder": encoder, "pad": pad, "runner": runner,
            "shards": shards, "tokens": tokens, "device": device}


def _alloc_stats(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOC_STATS}


def run_variant(name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Return the figures of one variant over every shard of the case."""
    from dflash.targets.runner import pad_batch
    from dflash.extract.pipeline import FeaturePipeline
    from dflash.extract.plan import pack_batches
    from dflash.extract.timeline import Timeline
    from dflash.extract.worker import WorkerSpec, auto_writer_threads, fill_shards, prepare_shard
    from dflash.storage import Store

    cfg, runner, device = ctx["cfg"], ctx["runner"], ctx["device"]
    cudnn = runner._r.cudnn_attention = name.endswith("_cudnn")  # the TimedRunner's runner
    name = name.removesuffix("_cudnn")
    tl = Timeline(origin=time.perf_counter())
    profile = name == "tok_profile"
    threads = 4 if name == "tok_w4" else auto_writer_threads(1)
    interval = sys.getswitchinterval()
    if name == "tok_si":
        sys.setswitchinterval(0.0002)
    if name == "tok_gc":
        gc.collect()
        gc.freeze()
        gc.disable()
    shutil.rmtree(cfg.out, ignore_errors=True)
    extra: dict[str, Any] = {}
    bx._sync(device)
    alloc0 = _alloc_stats(device)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    try:
        if name in ("hidden", "features"):
            for samples in ctx["shards"]:
                lengths = [len(s.input_ids) for s in samples]
                for idx in pack_batches(lengths, cfg.batch_tokens):
                    ids, lens = pad_batch([samples[i].input_ids for i in idx], ctx["pad"])
                    ids = ids.to(device, non_blocking=True)
                    runner.hidden(ids) if name == "hidden" else runner.features(ids, lens)
            bx._sync(device)
        else:
            pipe = FeaturePipeline(runner, cfg.batch_tokens, pad_id=ctx["pad"], timeline=tl, profile=profile)
            if name == "discard":
                for samples in ctx["shards"]:
                    pipe.submit(samples, DiscardSink())
                pipe.drain()
            else:
                store = Store.create_or_open(cfg.out, ctx["header"], replace_skeleton=True)
                tokenise = name.startswith("tok")

                def samples_for(shard_id: int) -> tuple[list[Any], dict[str, Any]]:
                    if not tokenise:
                        return ctx["shards"][shard_id], {}
                    with tl.stage("tokenise", shard_id, main=False):
                        rows = ctx["plan"].shard_rows(shard_id)[2]
                        return prepare_shard(rows, ctx["encoder"], cfg.min_loss_tokens, False)[0], {}

                spec = WorkerSpec(device=str(device), index=0, header=store.header, writer_threads=threads)
                extra = fill_shards(store, samples_for, pipe, lambda e: None, spec, writer_threads=threads,
                                    timeline=tl)
            extra = {**extra, **{f"writer_{k}": round(v, 3) for k, v in pipe.writer_times.items()}}
    finally:
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        sys.setswitchinterval(interval)
        if name == "tok_gc":
            gc.enable()
            gc.unfreeze()
        shutil.rmtree(cfg.out, ignore_errors=True)
    t = tl.to_dict()
    alloc = {k: v - alloc0.get(k, 0) for k, v in _alloc_stats(device).items()}
    return {"variant": name + ("_cudnn" if cudnn else ""), "tokens": ctx["tokens"], "wall_s": round(wall, 3),
            "tok_s": round(ctx["tokens"] / wall),
            "main_cpu_s": round(cpu, 3), "threads": threads, **runner.device_figures(), "alloc": alloc,
            "parts": t["parts"], "background": t["background"],
            **{k: v for k, v in extra.items() if k in ("steady_s", "wait_s") or k.startswith("writer_")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="bench-extract-out", help="bench/extract.py's folder (targets, data)")
    ap.add_argument("--store-dir", default=None, help="folder for the store [default: --work]")
    ap.add_argument("--case", choices=("short", "long"), default="short")
    ap.add_argument("--tokens", type=int, default=1_550_000, help="tokens of the long case")
    ap.add_argument("--variants", default=",".join(ALL))
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.tokens = min(args.tokens, 30_000)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(ALL))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(ALL)}")
    ctx = setup(args)
    results = []
    for name in variants:
        if name == "empty_cache":
            if ctx["device"].type == "cuda":
                torch.cuda.empty_cache()
            print("[empty_cache] the allocator's cached blocks went back to the driver", flush=True)
            continue
        r = run_variant(name, ctx)
        base = next((x for x in reversed(results) if x["variant"] == "hidden"), None)
        r["over_hidden"] = round(r["tok_s"] / base["tok_s"], 3) if base else None
        results.append(r)
        dev = (f"device busy {r['device_busy_s']:.2f} of {r['device_span_s']:.2f} s (idle {r['device_idle_share']:.1%})"
               if "device_busy_s" in r else "no device events")
        print(f"[{name}] {r['tok_s']:,} tok/s" + (f" = {r['over_hidden']:.3f} of hidden" if r["over_hidden"] else "")
              + f"; wall {r['wall_s']:.2f} s, main thread CPU {r['main_cpu_s']:.2f} s; {dev}; allocator {r['alloc']}",
              flush=True)
        if r["parts"]:
            print("    parts: " + ", ".join(f"{k} {v:.2f}" for k, v in r["parts"].items() if v >= 0.005)
                  + "\n    beside: " + ", ".join(f"{k} {v:.2f}" for k, v in r["background"].items())
                  + "".join(f"; {k} {r[k]}" for k in r if k.startswith("writer_") or k == "steady_s"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"case": args.case, "results": results,
                                               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
