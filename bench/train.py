"""Benchmark `dflash train` on one GPU: context and query tokens/s and MFU on uniform and on mixed-length samples,
streaming from a store on local disk against the same batches preloaded in GPU memory, data-wait fraction, host RAM.

    source bench/device_env.sh && python3 bench/train.py --out $OUT/train.json
    python3 bench/train.py --tiny   # a CPU smoke test of the script (tiny shapes; the numbers mean nothing)

Workload: a Qwen3-8B-shaped target (random embedding and lm_head only; nothing is downloaded), its 5-layer drafter
(block 16, 512 anchors, 16,384 tokens a step, bf16 compute, flex attention), and a blosc store of real size
(~49K tokens, ~2 GB of features per shard) whose features are LLM-like synthetic activations. Every sample is
--length tokens (4,096: 4 a step) in the `uniform` workload, so every step has the same shapes (one flex
compilation); the `mixed` workload's samples have lognormal lengths of 193..4,096 tokens (median ~1,300: the
conversations of bench/extract.py), so a step packs many short samples and its blocks (query tokens) per context
token differ: context tok/s alone would not compare the two, query tok/s and MFU (drafter/flops.py) do. The same
steps of each workload run twice
with the same trainer: first from batches already on the GPU, then streamed from disk after the store's pages are
dropped from the page cache (posix_fadvise DONTNEED), so the disk, the decode and the packing are all on the clock.
Both passes time the same steps after the same warm-up steps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash.config import TrainConfig
from dflash.facts import build_target_layer_ids
from dflash.storage import Store
from dflash.tests.synthetic_shards import activation_bits
from dflash.tests.tiny_targets import QWEN3_8B_CONFIG
from dflash.train.dist import Dist
from dflash.train.plan import ShardLengths, plan_round
from dflash.train.learner import Learner
from dflash.train.packing import max_blocks_for
from dflash.drafter.config import for_store
from dflash.train.run_folder import resolve_train_dtype
from dflash.train.stream import RoundStream, StreamSpec

log = logging.getLogger("bench.train")


# --tiny: a CPU smoke test of this script with a small target (numbers meaningless).
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
SHAPE = dict(QWEN3_8B_CONFIG)


def make_target(folder: Path) -> None:
    """Write config.json and a safetensors file holding only the embedding and lm_head (all the trainer reads)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**SHAPE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    (folder / "config.json").write_text(json.dumps(cfg))
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16()}, str(folder / "model.safetensors"))


def sample_lengths(kind: str, rng: np.random.Generator, samples: int, length: int) -> list[int]:
    """Return one shard's sample lengths: `samples` of `length` (uniform), or lognormal ones of 193..length tokens
    summing to about as many tokens (mixed; scaled with --length, so 4,096 gives bench/extract.py's lengths)."""
    if kind == "uniform":
        return [length] * samples
    scale = length / 4096
    out: list[int] = []
    while sum(out) < samples * length:
        out.append(int(np.clip(rng.lognormal(np.log(1300 * scale), 0.7), max(2, int(193 * scale)), length)))
    return out


def make_store(url: str, target: Path, shards: int, samples: int, length: int, kind: str = "uniform") -> None:
    """Write a complete store of `shards` shards of about `samples` x `length` tokens each (sample_lengths)."""
    layers = build_target_layer_ids(SHAPE["num_hidden_layers"])
    H = SHAPE["hidden_size"]
    header = {"kind": "bench", "layer_ids": layers, "hidden_size": H, "codec": "blosc", "feature_dtype": "bfloat16",
              "mask_token_id": SHAPE["vocab_size"] - 200, "shard_plan": {"num_shards": shards},
              "target": {"path": str(target), "num_layers": 36, "vocab_size": SHAPE["vocab_size"]}}
    store = Store.create_or_open(url, header)
    rng = np.random.default_rng(0)
    pool = activation_bits(rng, 4096, len(layers), H)  # rows reused in random order: real compressibility, fast
    for sid in range(shards):
        with store.try_claim(sid) as w:
            for i, n in enumerate(sample_lengths(kind, rng, samples, length)):
                ids = rng.integers(0, SHAPE["vocab_size"] - 200, size=n, dtype=np.int32)
                mask = np.zeros(n, np.bool_)
                mask[n // 8:] = True
                w.append(ids, mask, pool[rng.integers(0, len(pool), size=n)], sample_id=sid * 10**6 + i)
            w.commit({"bench": True})
    store.mark_complete()


def drop_page_cache(folder: str) -> int:
    """Return the bytes of store files whose cached pages were dropped (clean pages go without privileges)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def run_workload(kind: str, args: argparse.Namespace, work: Path, target: Path, trainer: Learner,
                 device: torch.device) -> dict:
    """Write the workload's store, then time the same steps preloaded and streamed; return its numbers."""
    from dflash.drafter.flops import peak_flops

    url = str(work / f"store-{kind}")
    t0 = time.perf_counter()
    make_store(url, target, args.shards, args.samples, args.length, kind)
    log.info("%s: store written in %.1f s", kind, time.perf_counter() - t0)
    cfg, dcfg = trainer.cfg, trainer.model.config
    store = Store.open(url)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = store.committed_ids()
    plan = plan_round(ShardLengths(store, False).load(ids), ids, num_slots=1, seed=0, epoch=0, round_index=0,
                      batch_tokens=cfg.batch_tokens, buffer_tokens=4 * cfg.batch_tokens)
    n = args.warmup + args.steps
    assert plan.steps >= n, f"the {kind} store has {plan.steps} steps, need {n}; pass more --shards"

    spec = StreamSpec(slots=[0], seed=0, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                      anchors=cfg.anchors, max_blocks=max_blocks_for(cfg.batch_tokens), device=device,
                      depth=cfg.prefetch_shards)

    def stream(start: int) -> RoundStream:
        return RoundStream(store, plan, spec, epoch=0, step_offset=0, start=start)

    def step(item) -> tuple[float, int]:
        """Train one step; return its FLOPs and query tokens (blocks x block size)."""
        metrics, _, _ = trainer.step(item.micro)
        return trainer.last_flops, (metrics.blocks if metrics is not None else 0) * dcfg.block_size

    # Preload: the steps' batches, built by the same stream, kept on the GPU.
    s = stream(0)
    pre = [s.get()[0] for _ in range(n)]
    s.close()
    for item in pre[: args.warmup]:  # compiles flex attention for the (first) shapes
        step(item)
    sync()
    t = time.perf_counter()
    flops, queries = 0.0, 0
    for item in pre[args.warmup:]:
        f, q = step(item)
        flops, queries = flops + f, queries + q
    sync()
    pre_time = time.perf_counter() - t
    tokens = sum(item.tokens for item in pre[args.warmup:])
    lengths = [x[2] for item in pre[args.warmup:] for x in plan.batches[0][item.step_in_epoch]]
    del pre, s
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dropped = drop_page_cache(url)
    # Streamed: the same steps read from disk while training; the warm-up steps (the first shard's read, which a
    # real run pays once) are trained on but not timed, as in the preloaded pass.
    rss_peak, wait = 0.0, 0.0
    s = stream(0)
    for _ in range(args.warmup):
        step(s.get()[0])
    sync()
    t = time.perf_counter()
    done = 0
    while done < args.steps:
        item, w = s.get()
        wait += w
        step(item)
        rss_peak = max(rss_peak, rss_gb())
        done += 1
    sync()
    stream_time = time.perf_counter() - t
    s.close()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (
        peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    feature_bytes = tokens * len(dcfg.target_layer_ids) * dcfg.hidden_size * 2
    return {
        "sample_tokens": {"min": min(lengths), "median": int(np.median(lengths)), "max": max(lengths),
                          "per_step": len(lengths) / args.steps},
        "store_gb_on_disk": sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file()) / 1e9,
        "page_cache_dropped_gb": dropped / 1e9,
        "preloaded_tokens_per_s": tokens / pre_time,
        "streamed_tokens_per_s": tokens / stream_time,
        "preloaded_query_tokens_per_s": queries / pre_time,
        "streamed_query_tokens_per_s": queries / stream_time,
        "preloaded_tflops_per_s": flops / pre_time / 1e12,
        "streamed_tflops_per_s": flops / stream_time / 1e12,
        "preloaded_mfu": flops / pre_time / peak if peak else None,
        "streamed_mfu": flops / stream_time / peak if peak else None,  # None: a CPU or a GPU of unknown peak
        "ratio": pre_time / stream_time,
        "data_wait": wait / stream_time,
        "feature_read_gb_per_s": feature_bytes / stream_time / 1e9,
        "host_rss_peak_gb": rss_peak,
        "step_s": stream_time / args.steps,
    }


# ---- --variants, --profile, --checkpoint: one store, the same preloaded batches for every measurement ----------

def variant_options() -> dict:
    """Return the StepOptions of each --variants name."""
    from dflash.train.learner import StepOptions

    return {
        "base": StepOptions(),  # `dflash train` as it is (--compile-layers auto: compiled on CUDA)
        "eager": StepOptions(compile_layers=False),  # the step before --compile-layers (its 2026-12-01 figures)
        "few_syncs": StepOptions(compile_layers=False, few_syncs=True),  # one host copy a step (equal numbers)
        # CE chunks of ~2.3 GiB of fp32 logits (8B vocab): fewer, larger
        "ce_4096": StepOptions(compile_layers=False, chunk_rows=4096),
        "ce_8192": StepOptions(compile_layers=False, chunk_rows=8192),
        "foreach_adamw": StepOptions(compile_layers=False, adamw="foreach"),
        "compile": StepOptions(compile_layers=True),  # fuse norms, RoPE, SwiGLU, conv elementwise (dynamic shapes)
        "compile_few_syncs": StepOptions(compile_layers=True, few_syncs=True),
        "compile_ce4096": StepOptions(compile_layers=True, chunk_rows=4096),  # compiled layers free memory for these
        "compile_ce8192": StepOptions(compile_layers=True, chunk_rows=8192),
        "compile_few_syncs_ce4096": StepOptions(compile_layers=True, few_syncs=True, chunk_rows=4096),
    }


def padding(batches: list, trainer: Learner) -> dict:
    """Return the padding of flex's one shape over these batches: padded / padded-shape tokens, context and queries."""
    from dflash.drafter.attention import _round128

    B = trainer.model.config.block_size
    Np, Qp = _round128(trainer.capacity[0]), _round128(trainer.capacity[1] * B)
    ctx = [b.ctx_pos.shape[0] for item in batches for b in item.micro if b is not None]
    qry = [b.num_blocks * B for item in batches for b in item.micro if b is not None]
    n = len(ctx)
    return {"shape": [Np, Qp], "context_padded": 1 - sum(ctx) / (n * Np), "query_padded": 1 - sum(qry) / (n * Qp),
            "padded": 1 - (sum(ctx) + sum(qry)) / (n * (Np + Qp)), "context_tokens_mean": sum(ctx) / n,
            "query_tokens_mean": sum(qry) / n}


def time_steps(trainer: Learner, batches: list, sync) -> tuple[list[float], float, int]:
    """Return (seconds of each step, FLOPs, query tokens) of training on these batches."""
    times, flops, queries = [], 0.0, 0
    B = trainer.model.config.block_size
    for item in batches:
        t = time.perf_counter()
        metrics, _, _ = trainer.step(item.micro)
        sync()
        times.append(time.perf_counter() - t)
        flops += trainer.last_flops
        queries += (metrics.blocks if metrics is not None else 0) * B
    return times, flops, queries


def run_variants(names: list[str], args, cfg, dcfg, dist, batches: list, peak, sync, deadline: float) -> dict:
    """Train the same preloaded batches once per variant (warm-up steps first); return tok/s and MFU of each."""
    options = variant_options()
    out = {}
    for name in names:
        if time.perf_counter() > deadline:
            out[name] = {"skipped": "--deadline-s reached"}
            print(f"variant {name}: skipped (--deadline-s)", flush=True)
            continue
        t0 = time.perf_counter()
        trainer = None
        try:  # one GPU call ranks them all: a variant that fails is reported, the others still run
            trainer = Learner(cfg, dcfg, dist, options[name])
            trainer.total = 10 ** 6
            warm = time_steps(trainer, batches[: args.warmup], sync)[0]
            times, flops, queries = time_steps(trainer, batches[args.warmup:], sync)
        except Exception as e:  # noqa: BLE001
            out[name] = {"skipped": f"failed: {type(e).__name__}: {e}"[:300]}
            print(f"variant {name}: {out[name]['skipped']}", flush=True)
            del trainer
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        tokens = sum(item.tokens for item in batches[args.warmup:])
        s = sum(times)
        out[name] = {"ctx_tokens_per_s": tokens / s, "query_tokens_per_s": queries / s, "tflops_per_s": flops / s / 1e12,
                     "mfu": flops / s / peak if peak else None, "step_s": s / len(times), "step_max_s": max(times),
                     "warmup_s": sum(warm), "total_s": time.perf_counter() - t0,
                     "gpu_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0}
        w = out[name]
        print(f"variant {name}: {w['ctx_tokens_per_s']:,.0f} ctx tok/s {w['query_tokens_per_s']:,.0f} query tok/s "
              f"MFU {w['mfu']:.1%}" if peak else f"variant {name}: {w['query_tokens_per_s']:,.0f} query tok/s",
              f"step {w['step_s']:.3f} s (warm-up {w['warmup_s']:.1f} s)", flush=True)
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return out


_CATEGORIES = ("attention", "block_mask", "lm_head_ce", "selector", "matmul", "optimizer", "elementwise_norm",
               "copy_h2d", "copy_other")


def _category(name: str, ranges: str) -> str:
    """Return the profile category of a kernel (or CPU op) name launched under the given ancestor range names."""
    n, r = name.lower(), ranges.lower()
    if "memcpy htod" in n or "memcpy h2d" in n:
        return "copy_h2d"
    if "memcpy" in n or "memset" in n:
        return "copy_other"
    if "optimizer.step" in r or "bench::clip" in r or "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "bench::block_mask" in r:
        return "block_mask"
    if "flex" in n or "attention" in n or "fmha" in n or "flash" in n or "bench::attend" in r:
        return "attention"
    if "bench::lm_head_ce" in r or "chunkedlinearce" in r:
        return "lm_head_ce"
    if "bench::selector" in r or "candidatelogits" in r:
        return "selector"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "aten::mm", "aten::addmm", "aten::bmm",
                            "cublas", "splitk")):
        return "matmul"
    return "elementwise_norm"


@contextlib.contextmanager
def _labels():
    """Label the regions the kernel names do not tell apart (record_function ranges, for the profile only)."""
    import torch.nn.attention.flex_attention as fa
    from dflash.drafter import linear_ce
    from dflash.train import learner as learner_mod, objective

    def wrap(fn, label):
        def inner(*a, **k):
            with torch.profiler.record_function(label):
                return fn(*a, **k)
        return inner

    from dflash.drafter import attention

    saved = [(linear_ce, "_chunked_ce"), (objective, "selector_loss"), (fa, "create_block_mask"),
             (torch.nn.utils, "clip_grad_norm_"), (attention, "_compiled_flex")]
    old = [getattr(m, n) for m, n in saved]
    labels = ["bench::lm_head_ce", "bench::selector", "bench::block_mask", "bench::clip", None]
    for (m, n), fn, label in zip(saved, old, labels):
        setattr(m, n, wrap(fn, label) if label else (lambda *a, _fn=fn: wrap(_fn(*a), "bench::attend")))
    try:
        yield
    finally:
        for (m, n), fn in zip(saved, old):
            setattr(m, n, fn)
    del learner_mod


def profile_steps(trainer: Learner, batches: list, sync, device) -> dict:
    """Profile a few steady steps; return ms per step and the share of wall time of each category, and idle."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _labels():
        time_steps(trainer, batches[:1], sync)  # the labels' first call outside the profile
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            time_steps(trainer, batches, sync)
            wall = time.perf_counter() - t
    totals = dict.fromkeys(_CATEGORIES, 0.0)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        chain, p = [], e
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        ranges = " ".join(chain)
        if cuda:
            for k in e.kernels:
                totals[_category(k.name, ranges)] += k.duration / 1e6
        elif e.self_cpu_time_total > 0 and e.name.startswith("aten::"):
            totals[_category(e.name, ranges)] += e.self_cpu_time_total / 1e6
    busy = sum(totals.values())
    if cuda:
        device_total = sum(a.self_device_time_total for a in prof.key_averages()
                           if a.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        totals["unattributed"] = max(0.0, device_total - busy)
        busy = max(busy, device_total)
    totals["idle_gaps"] = max(0.0, wall - busy)
    n = len(batches)
    out = {k: {"ms_per_step": v / n * 1e3, "share": v / wall} for k, v in totals.items()}
    out["wall_ms_per_step"] = wall / n * 1e3
    out["timed_by"] = "CUDA kernels (sums of durations)" if cuda else "CPU aten ops' self time (no GPU)"
    return out


def checkpoint_effect(trainer: Learner, batches: list, sync, work: Path, args) -> dict:
    """Time steps without a checkpoint, then steps while a checkpoint of this drafter is written as the loop writes
    it (train/checkpoint.py: host snapshot on the loop, then save_in_background); return the blocked seconds."""
    from dflash.train.checkpoint import Checkpointer, rng_state

    def cycle(k):
        return [batches[i % len(batches)] for i in range(k)]

    before = time_steps(trainer, cycle(args.ckpt_steps), sync)[0]
    ckpt = Checkpointer(work / "run-ckpt", keep=1)
    parts = {"optimizer": trainer.opt, "scheduler": trainer.sched}
    t0 = time.perf_counter()
    snap = ckpt.snapshot(1, trainer.model, parts, {"step": 1, "total_steps": trainer.total, "rng": [rng_state()]})
    ckpt.save_in_background(snap)
    snapshot_s = time.perf_counter() - t0
    during = []
    while (not ckpt._pending.done() or not during) and len(during) < args.ckpt_max_steps:
        during += time_steps(trainer, cycle(1), sync)[0]
    folder = ckpt.wait()
    write_s = time.perf_counter() - t0
    typical = float(np.median(before))
    return {"before_step_s_median": typical, "before_step_s_max": max(before), "snapshot_s (blocks the loop)": snapshot_s,
            "during_steps": len(during), "during_step_s_max": max(during),
            "during_step_s_median": float(np.median(during)),
            "blocked_s": snapshot_s + sum(max(0.0, t - typical) for t in during),
            "background_write_s": write_s, "write_finished_within_steps": write_s <= snapshot_s + sum(during),
            "checkpoint_gb": sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 1e9}


def run_study(args, work: Path, target: Path, cfg, dcfg, dist, device) -> dict:
    """--variants / --profile / --checkpoint on the mixed workload's preloaded batches."""
    from dflash.drafter.flops import peak_flops

    t_start = time.perf_counter()
    deadline = t_start + args.deadline_s
    url = str(work / "store-mixed")
    make_store(url, target, args.shards, args.samples, args.length, "mixed")
    store = Store.open(url)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = store.committed_ids()
    plan = plan_round(ShardLengths(store, False).load(ids), ids, num_slots=1, seed=0, epoch=0, round_index=0,
                      batch_tokens=cfg.batch_tokens, buffer_tokens=4 * cfg.batch_tokens)
    n = args.warmup + args.steps
    assert plan.steps >= n, f"the mixed store has {plan.steps} steps, need {n}; pass more --shards"
    spec = StreamSpec(slots=[0], seed=0, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                      anchors=cfg.anchors, max_blocks=max_blocks_for(cfg.batch_tokens), device=device,
                      depth=cfg.prefetch_shards)
    s = RoundStream(store, plan, spec, epoch=0, step_offset=0, start=0)
    batches = [s.get()[0] for _ in range(n)]
    s.close()
    print(f"mixed store and {n} preloaded steps ready in {time.perf_counter() - t_start:.1f} s", flush=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (
        peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    out: dict = {}
    names = [v.strip() for v in (args.variants or "").split(",") if v.strip()]
    trainer = None
    if args.profile or args.checkpoint:
        trainer = Learner(cfg, dcfg, dist)
        trainer.total = 10 ** 6
        time_steps(trainer, batches[: args.warmup], sync)
        out["flex_padding"] = padding(batches, trainer)
    if args.profile and time.perf_counter() < deadline:
        try:
            out["profile"] = profile_steps(trainer, batches[args.warmup:args.warmup + args.profile_steps], sync,
                                           device)
            print_profile(out["profile"], out["flex_padding"])
        except Exception as e:  # noqa: BLE001  (the checkpoint and the variants still run)
            print(f"profile failed: {type(e).__name__}: {e}", flush=True)
    if args.checkpoint and time.perf_counter() < deadline:
        out["checkpoint"] = checkpoint_effect(trainer, batches[args.warmup:], sync, work, args)
        print("checkpoint:", json.dumps(out["checkpoint"]), flush=True)
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if names:  # after the profile and the checkpoint, so a --deadline-s cuts variants, not those
        out["variants"] = run_variants(names, args, cfg, dcfg, dist, batches, peak, sync, deadline)
    return out


def print_profile(p: dict, pad: dict) -> None:
    print(f"profile ({p['timed_by']}), wall {p['wall_ms_per_step']:.1f} ms/step:")
    for k, v in p.items():
        if isinstance(v, dict):
            print(f"  {k:>18}: {v['ms_per_step']:9.1f} ms/step {v['share']:7.1%}")
    print(f"  flex shape {pad['shape']}: {pad['padded']:.1%} of its tokens are padding (context "
          f"{pad['context_padded']:.1%}, queries {pad['query_padded']:.1%})", flush=True)


def print_variants(vs: dict) -> None:
    print(f"{'variant':>18} {'ctx tok/s':>10} {'query tok/s':>12} {'TFLOP/s':>8} {'MFU':>6} {'step s':>7} "
          f"{'warm-up s':>9} {'peak GiB':>8}")
    for name, w in vs.items():
        if "skipped" in w:
            print(f"{name:>18} skipped: {w['skipped']}")
            continue
        mfu = f"{w['mfu']:.1%}" if w["mfu"] is not None else "n/a"
        print(f"{name:>18} {w['ctx_tokens_per_s']:>10,.0f} {w['query_tokens_per_s']:>12,.0f} {w['tflops_per_s']:>8.1f} "
              f"{mfu:>6} {w['step_s']:>7.3f} {w['warmup_s']:>9.1f} {w['gpu_peak_gb']:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="Local-disk folder for the stores [default: a temp dir].")
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--samples", type=int, default=12, help="Samples per shard (uniform; mixed: as many tokens).")
    ap.add_argument("--length", type=int, default=4096, help="Tokens of a uniform sample, longest mixed one.")
    ap.add_argument("--lengths", default="uniform,mixed",
                    help="Workloads, comma-separated: uniform (every sample --length) and/or mixed (lognormal).")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="Write the results as JSON here too.")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="Dense bf16 peak for MFU [default: the GPU's datasheet peak; none on a CPU].")
    ap.add_argument("--tiny", action="store_true", help="Smoke-test the script on CPU with a tiny target.")
    ap.add_argument("--drafter", default="dflash", choices=("dflash", "dflash2"),
                    help="dflash: the 8B-sized drafter the MFU figures of bench/RESULTS.md were measured with; "
                         "dflash2 adds 2 x 151,936 x 256 selector codebooks and conv activations (it ran out of "
                         "the H200's memory at 65K tokens a step on 2026-12-01)")
    ap.add_argument("--position-weights", default="decay", choices=("decay", "dpace"))
    ap.add_argument("--variants", default=None,
                    help="Comma-separated StepOptions variants to A/B on the mixed workload's preloaded steps "
                         f"(replaces the uniform/mixed passes): {', '.join(variant_options())}.")
    ap.add_argument("--profile", action="store_true",
                    help="Profile --profile-steps steady mixed steps: ms/step and share by category, flex padding.")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--checkpoint", action="store_true",
                    help="Time --ckpt-steps steps, then steps while the drafter's checkpoint is written as the loop "
                         "writes it (snapshot, then background write): the seconds it blocks training.")
    ap.add_argument("--ckpt-steps", type=int, default=4)
    ap.add_argument("--ckpt-max-steps", type=int, default=40, help="Most steps to run while the checkpoint writes.")
    ap.add_argument("--deadline-s", type=float, default=1e9,
                    help="Skip the variants and measurements not started this many seconds after the store is made.")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.lengths.split(",") if k.strip()]
    if not kinds or any(k not in ("uniform", "mixed") for k in kinds):
        ap.error(f"--lengths takes uniform and/or mixed, got {args.lengths!r}")
    unknown = sorted({v.strip() for v in (args.variants or "").split(",") if v.strip()} - set(variant_options()))
    if unknown:
        ap.error(f"--variants {unknown} unknown; choose from {', '.join(variant_options())}")
    if args.tiny:
        SHAPE.update(TINY)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-train-"))
    target = work / "target"
    make_target(target)
    device = torch.device("cpu" if args.tiny else "cuda:0")
    # The first workload's store gives the drafter's shape (every workload's store has the same header).
    make_store(str(work / "store-shape"), target, 1, 1, 8)
    cfg = TrainConfig(store=str(work / "store-shape"), target=str(target), out=str(work / "run"),
                      gpus="cpu" if args.tiny else "0", epochs=1, drafter=args.drafter,
                      position_weights=args.position_weights,
                      **(dict(batch_tokens=4 * args.length, anchors=64, draft_layers=1) if args.tiny else {}))
    dcfg = for_store(cfg, Store.open(cfg.store).header)
    dist = Dist(0, 1, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = resolve_train_dtype(cfg, dist)  # --dtype auto made concrete, as `dflash train` does
    if args.variants or args.profile or args.checkpoint:
        study = run_study(args, work, target, cfg, dcfg, dist, device)
        study.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                      "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "steps": args.steps, "warmup": args.warmup, "batch_tokens": cfg.batch_tokens,
                      "drafter": dcfg.drafter, "position_weights": cfg.position_weights})
        text = json.dumps(study, indent=2)
        print(text)
        if "variants" in study:
            print_variants(study["variants"])
        if "profile" in study:
            print("flex padding:", json.dumps(study["flex_padding"]))
            print_profile(study["profile"], study["flex_padding"])
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
    trainer = Learner(cfg, dcfg, dist)
    workloads = {kind: run_workload(kind, args, work, target, trainer, device) for kind in kinds}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {os.cpu_count()} CPUs, "
                   f"{platform.platform()}",
        "torch": torch.__version__,
        "steps": args.steps, "batch_tokens": cfg.batch_tokens, "anchors": cfg.anchors, "draft_layers": cfg.draft_layers,
        "block_size": dcfg.block_size, "attention": trainer.attention,
        "workloads": workloads,
        "host_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "gpu_peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
    }
    text = json.dumps(result, indent=2)
    print(text)
    for kind, w in workloads.items():
        mfu = f"{w['streamed_mfu']:.1%}" if w["streamed_mfu"] is not None else "n/a (no known peak)"
        print(f"{kind:>8}: {w['streamed_tokens_per_s']:,.0f} ctx tok/s  {w['streamed_query_tokens_per_s']:,.0f} "
              f"query tok/s  MFU {mfu}  data wait {w['data_wait']:.1%}  (streamed; preloaded "
              f"{w['preloaded_tokens_per_s']:,.0f} ctx tok/s)")
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
