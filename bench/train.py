"""Benchmark `dflash train`'s data path on one GPU: tokens/s streaming from a store on local disk against the same
batches preloaded in GPU memory, data-wait fraction, host RAM.

    source bench/device_env.sh && python3 bench/train.py --out $OUT/train.json

Workload: a Qwen3-8B-shaped target (random embedding and lm_head only; nothing is downloaded), its 5-layer drafter
(block 16, 512 anchors, 16,384 tokens a step, bf16 compute, flex attention), and a blosc store of real size
(~49K tokens, ~2 GB of features per shard) whose features are LLM-like synthetic activations. Every sample is
--length tokens (4,096: 4 a step) so every step has the same shapes (one flex compilation). The same steps run twice
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
from dflash.train.prepare import ShardLengths, drafter_config
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


def make_store(url: str, target: Path, shards: int, samples: int, length: int) -> None:
    """Write a complete store of `shards` shards of `samples` samples of `length` tokens each."""
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
            for i in range(samples):
                ids = rng.integers(0, SHAPE["vocab_size"] - 200, size=length, dtype=np.int32)
                mask = np.zeros(length, np.bool_)
                mask[length // 8:] = True
                w.append(ids, mask, pool[rng.integers(0, len(pool), size=length)], sample_id=sid * samples + i)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="Local-disk folder for the store [default: a temp dir].")
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--samples", type=int, default=12, help="Samples per shard.")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="Write the results as JSON here too.")
    ap.add_argument("--tiny", action="store_true", help="Smoke-test the script on CPU with a tiny target.")
    args = ap.parse_args()
    if args.tiny:
        SHAPE.update(TINY)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-train-"))
    target, url = work / "target", str(work / "store")
    t0 = time.perf_counter()
    make_target(target)
    make_store(url, target, args.shards, args.samples, args.length)
    log.info("target + store written in %.1f s", time.perf_counter() - t0)
    device = torch.device("cpu" if args.tiny else "cuda:0")
    cfg = TrainConfig(store=url, target=str(target), out=str(work / "run"), gpus="cpu" if args.tiny else "0",
                      epochs=1, **(dict(batch_tokens=4 * args.length, anchors=64, draft_layers=1) if args.tiny else {}))
    store = Store.open(url)
    dcfg = drafter_config(cfg, store)
    dist = Dist(0, 1, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trainer = Learner(cfg, dcfg, dist)
    ids = store.committed_ids()
    plan = plan_round(ShardLengths(store, False).load(ids), ids, num_slots=1, seed=0, epoch=0, round_index=0,
                      batch_tokens=cfg.batch_tokens, buffer_tokens=4 * cfg.batch_tokens)
    n = args.warmup + args.steps
    assert plan.steps >= n, f"the store has {plan.steps} steps, need {n}; pass more --shards"

    spec = StreamSpec(slots=[0], seed=0, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                      anchors=cfg.anchors, max_blocks=max_blocks_for(cfg.batch_tokens), device=device,
                      depth=cfg.prefetch_shards)

    def stream(start: int) -> RoundStream:
        return RoundStream(store, plan, spec, epoch=0, step_offset=0, start=start)

    # Preload: the steps' batches, built by the same stream, kept on the GPU.
    s = stream(0)
    pre = [s.get()[0] for _ in range(n)]
    s.close()
    for item in pre[: args.warmup]:  # compiles flex attention for the (fixed) shapes
        trainer.step(item.micro)
    sync()
    t = time.perf_counter()
    for item in pre[args.warmup:]:
        trainer.step(item.micro)
    sync()
    pre_time = time.perf_counter() - t
    tokens = sum(item.tokens for item in pre[args.warmup:])
    del pre, s
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dropped = drop_page_cache(url)
    # Streamed: the same steps read from disk while training; the warm-up steps (the first shard's read, which a
    # real run pays once) are trained on but not timed, as in the preloaded pass.
    rss_peak, wait = 0.0, 0.0
    s = stream(0)
    for _ in range(args.warmup):
        trainer.step(s.get()[0].micro)
    sync()
    t = time.perf_counter()
    done = 0
    while done < args.steps:
        item, w = s.get()
        wait += w
        trainer.step(item.micro)
        rss_peak = max(rss_peak, rss_gb())
        done += 1
    sync()
    stream_time = time.perf_counter() - t
    s.close()
    feature_bytes = tokens * len(dcfg.target_layer_ids) * dcfg.hidden_size * 2
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {os.cpu_count()} CPUs, "
                   f"{platform.platform()}",
        "torch": torch.__version__,
        "steps": args.steps, "batch_tokens": cfg.batch_tokens, "anchors": cfg.anchors, "draft_layers": cfg.draft_layers,
        "attention": trainer.attention,
        "store_gb_on_disk": sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file()) / 1e9,
        "page_cache_dropped_gb": dropped / 1e9,
        "preloaded_tokens_per_s": tokens / pre_time,
        "streamed_tokens_per_s": tokens / stream_time,
        "ratio": pre_time / stream_time,
        "data_wait": wait / stream_time,
        "feature_read_gb_per_s": feature_bytes / stream_time / 1e9,
        "host_rss_peak_gb": rss_peak,
        "host_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "gpu_peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "step_s": stream_time / args.steps,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
