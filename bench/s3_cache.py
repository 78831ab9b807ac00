"""Training from a store on S3: read throughput and the trainer's data wait, without a cache and with a cold and a
warm local shard cache, against a real S3-protocol server (moto's server mode, started here on 127.0.0.1).

    python -m dflash.bench.s3_cache [--shards 8] [--samples 24] [--hidden 1024] [--step-s 0.3] [--smoke]

Each epoch reads every shard in order through the trainer's own ShardPrefetcher (whole shards, 2 ahead); the
"trainer" holds each shard for --step-s seconds (its GPU work) and the data wait is the time it spends blocked on
the prefetcher. Cold: the cache is empty (the first epoch); warm: the second epoch over the same cache. Prints one
line per mode; moto and this process share the machine, so the figures are the client's and moto's together.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def epoch(store, ids: list[int], step_s: float) -> tuple[float, float, int]:
    """Return (seconds, seconds waiting for data, bytes read) of one pass over the shards."""
    from dflash.train.prefetch import ShardPrefetcher

    pf = ShardPrefetcher(store, ids, capacity=2, skip_corrupt=False, pin=False)
    t0, wait, nbytes = time.perf_counter(), 0.0, 0
    try:
        for sid in ids:
            t = time.perf_counter()
            data = pf.get(sid)
            wait += time.perf_counter() - t
            nbytes += store.commit_record(sid)["bytes"]
            del data
            time.sleep(step_s)
            pf.release(sid)
    finally:
        pf.close()
    return time.perf_counter() - t0, wait, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--samples", type=int, default=24, help="samples a shard (~150 tokens each)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--step-s", type=float, default=0.3, help="seconds the trainer works on each shard")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.shards, args.samples, args.hidden, args.step_s = 3, 4, 128, 0.01

    from dflash.storage import Store
    from dflash.tests.s3_server import start_server
    from dflash.tests.synthetic_shards import write_synthetic_shard

    server = start_server()
    try:
        os.environ.update(server.env())
        url = f"s3://{server.bucket()}/bench"
        header = {"layer_ids": [1, 2, 3, 4, 5], "hidden_size": args.hidden, "codec": "blosc",
                  "shard_plan": {"num_shards": args.shards}, "run": "bench-s3-cache"}
        writer = Store.create_or_open(url, header, chunk_tokens=512)
        t = time.perf_counter()
        total = sum(write_synthetic_shard(writer, i, num_samples=args.samples)["bytes"] for i in range(args.shards))
        put_s = time.perf_counter() - t
        print(f"wrote {args.shards} shards, {total / 1e6:.1f} MB, to {url}: {total / put_s / 1e6:.0f} MB/s")
        ids = list(range(args.shards))
        with tempfile.TemporaryDirectory() as cache_dir:
            plain = Store.open(url)
            cached = Store.open(url)
            cache = cached.use_cache(cache_dir, gb=2 * total / 1e9)
            plain.read_shard(0)  # warm-up: the client's connections and the reader's threads, not measured
            cached.commit_record(0)
            for label, store in (("no cache, epoch 1", plain), ("no cache, epoch 2", plain),
                                 ("cache cold (epoch 1)", cached), ("cache warm (epoch 2)", cached)):
                secs, wait, nbytes = epoch(store, ids, args.step_s)
                print(f"{label:22s} {nbytes / secs / 1e6:7.1f} MB/s through the epoch, data wait {wait:6.2f} s of "
                      f"{secs:6.2f} s ({100 * wait / secs:4.1f}%)")
            print(f"cache: {cache.stats}")
            cache.close()
            # Raw read throughput of the store's reader, no trainer: every shard once.
            for label, store in (("read, S3 direct", plain), ("read, cache warm", cached)):
                t = time.perf_counter()
                for sid in ids:
                    store.read_shard(sid)
                secs = time.perf_counter() - t
                print(f"{label:22s} {total / secs / 1e6:7.1f} MB/s ({secs:.2f} s)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
