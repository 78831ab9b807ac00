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
from dflash.storage.synthetic import activation_bits
from dflash.testing import QWEN3_8B_CONFIG
from dflash.train.dist import Dist
from dflash.train.plan import plan_round
from dflash.train.learner import Learner
from dflash.train.objective import max_blocks_for
from dflash.train.prepare import ShardLengths, drafter_config, resolve_train_dtype
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
    args = ap.parse_args()
    kinds = [k.strip() for k in args.lengths.split(",") if k.strip()]
    if not kinds or any(k not in ("uniform", "mixed") for k in kinds):
        ap.error(f"--lengths takes uniform and/or mixed, got {args.lengths!r}")
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
                      gpus="cpu" if args.tiny else "0", epochs=1,
                      **(dict(batch_tokens=4 * args.length, anchors=64, draft_layers=1) if args.tiny else {}))
    dcfg = drafter_config(cfg, Store.open(cfg.store))
    dist = Dist(0, 1, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = resolve_train_dtype(cfg, dist)  # --dtype auto made concrete, as `dflash train` does
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
