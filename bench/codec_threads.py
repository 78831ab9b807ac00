"""What reading a store costs the loop beside it (issue 41): the store's read pool reads and decodes a real store's
feature chunks at a trainer's pace while the main thread runs a loop of torch ops, once as a CPU training step does
(matmuls on torch's intra-op threads) and once as a GPU step's host does (small ops: dispatch and the GIL); prints each
loop's rate while reading over its rate alone, per store.

    python bench/codec_threads.py --store STORE_BLOSC --store STORE_UQ6 [--tokens-per-s 40000] [--seconds 6]

On one H100 (2026-12-05) a uq6 store trained the GPU demo's drafter at 0.38x the blosc store's steps a second, with
the trainer waiting 0% on data, and extracted at 0.44x: the scaled codecs ran torch ops in the pool's threads, and
each of those threads drove its own team of torch's intra-op threads. Run it with PYTHONPATH pointing at a checkout
of each version to compare them on the same stores.
"""
from __future__ import annotations

import argparse
import json
import threading
import time


def main_loop(kind: str, seconds: float) -> float:
    """Return the iterations a second of the main thread's loop over `seconds`."""
    import torch

    a, b = torch.randn(64, 64), torch.randn(16)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if kind == "cpu_step":
            for _ in range(100):
                a = torch.tanh(a @ a * 0.01)
        else:
            for _ in range(300):
                b = b.add(1.0).mul_(0.5)
        n += 1
    return n / (time.perf_counter() - t0)


def reader(store_url: str, tokens_per_s: float, stop: threading.Event, done: list[int]) -> None:
    """Read the store's committed features in slices of 4,096 tokens at tokens_per_s, round and round."""
    import numpy as np

    from dflash.storage import Store
    from dflash.storage.reader import read_features

    store = Store.open(store_url)
    records = [(i, store.commit_record(i)) for i in store.committed_ids()]
    L, H = len(store.header["layer_ids"]), int(store.header["hidden_size"])
    buf = np.empty((4096, L, H), np.uint16)
    t0 = time.perf_counter()
    while not stop.is_set():
        for shard, rec in records:
            total = int(rec["num_tokens"])
            for s in range(0, total, 4096):
                if stop.is_set():
                    return
                e = min(total, s + 4096)
                read_features(store.fs, shard, rec, s, e, buf[: e - s])
                done[0] += e - s
                lag = done[0] / tokens_per_s - (time.perf_counter() - t0)
                if lag > 0:
                    time.sleep(lag)


def run(store_url: str, tokens_per_s: float, seconds: float) -> dict:
    from dflash.storage import Store

    codec = Store.open(store_url).header["codec"]
    out = {"store": store_url, "codec": codec}
    for kind in ("cpu_step", "gpu_host"):
        alone = main_loop(kind, seconds)
        stop, done = threading.Event(), [0]
        th = threading.Thread(target=reader, args=(store_url, tokens_per_s, stop, done), daemon=True)
        t0 = time.perf_counter()
        th.start()
        beside = main_loop(kind, seconds)
        stop.set()
        th.join()
        out[kind] = {"alone_it_s": round(alone, 1), "reading_it_s": round(beside, 1), "ratio": round(beside / alone, 3),
                     "read_tok_s": round(done[0] / (time.perf_counter() - t0))}
    return out


def main(argv: list[str] | None = None) -> None:
    import dflash

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", action="append", required=True, help="a committed store (repeatable)")
    p.add_argument("--tokens-per-s", type=float, default=40_000, help="the pace of the reads (a trainer's)")
    p.add_argument("--seconds", type=float, default=6.0, help="each loop's length")
    args = p.parse_args(argv)
    print(f"dflash from {dflash.__path__[0]}", flush=True)
    for url in args.store:
        r = run(url, args.tokens_per_s, args.seconds)
        print(json.dumps(r), flush=True)
        for kind in ("cpu_step", "gpu_host"):
            k = r[kind]
            print(f"{r['codec']:6s} {kind:8s}: {k['reading_it_s']:8.1f} it/s reading {k['read_tok_s']:,} tok/s against "
                  f"{k['alone_it_s']:.1f} alone: {k['ratio']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
