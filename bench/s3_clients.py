"""The S3 client choice of issue 41: s3fs (fsspec, botocore) against obstore (Rust; zarr's ObjectStore uses it) on
a real S3-protocol server (moto's server mode, started here on 127.0.0.1): throughput of 4 MB objects, latency of
small ones, conditional create, and how each fails on a missing bucket and an unreachable endpoint.

    pip install 'moto[server]' s3fs obstore
    python -m dflash.bench.s3_clients [--objects 24] [--mb 4] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objects", type=int, default=24)
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.objects, args.mb = 4, 0.25
    import numpy as np
    import obstore
    import s3fs
    from obstore.store import S3Store

    from dflash.tests.s3_server import start_server

    server = start_server()
    os.environ.update(server.env())
    try:
        bucket = server.bucket()
        n, size = args.objects, int(args.mb * 2**20)
        data = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8).tobytes() for i in range(n)]
        mb = n * size / 1e6
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        st = S3Store(bucket, endpoint=server.endpoint, region="us-east-1", access_key_id=server.key,
                     secret_access_key=server.secret, client_options={"allow_http": True})
        rows = []
        rows.append(("s3fs", "put serial", mb / timed(lambda: [fs.pipe_file(f"{bucket}/a/{i}", d)
                                                                  for i, d in enumerate(data)])))
        rows.append(("s3fs", "get serial", mb / timed(lambda: [fs.cat_file(f"{bucket}/a/{i}") for i in range(n)])))
        with ThreadPoolExecutor(8) as ex:
            rows.append(("s3fs", "get 8 threads", mb / timed(
                lambda: list(ex.map(lambda i: fs.cat_file(f"{bucket}/a/{i}"), range(n))))))
        rows.append(("s3fs", "get one batch (fs.cat)", mb / timed(
            lambda: fs.cat([f"{bucket}/a/{i}" for i in range(n)]))))
        rows.append(("obstore", "put serial", mb / timed(lambda: [obstore.put(st, f"b/{i}", d)
                                                                     for i, d in enumerate(data)])))
        rows.append(("obstore", "get serial", mb / timed(lambda: [obstore.get(st, f"b/{i}").bytes()
                                                                     for i in range(n)])))
        with ThreadPoolExecutor(8) as ex:
            rows.append(("obstore", "get 8 threads", mb / timed(
                lambda: list(ex.map(lambda i: obstore.get(st, f"b/{i}").bytes(), range(n))))))
        for client, what, rate in rows:
            print(f"{client:8s} {what:24s} {rate:7.0f} MB/s")
        small = b"x" * 300
        for client, put, get in (
                ("s3fs", lambda i: fs.pipe_file(f"{bucket}/s/{i}", small), lambda i: fs.cat_file(f"{bucket}/s/{i}")),
                ("obstore", lambda i: obstore.put(st, f"t/{i}", small), lambda i: obstore.get(st, f"t/{i}").bytes())):
            tp = timed(lambda: [put(i) for i in range(50)]) / 50
            tg = timed(lambda: [get(i) for i in range(50)]) / 50
            print(f"{client:8s} 300-byte object         put {tp * 1e3:5.1f} ms, get {tg * 1e3:5.1f} ms")
        # Conditional create: the second PUT with If-None-Match: * must fail.
        fs.pipe_file(f"{bucket}/c1", b"1", mode="create")
        try:
            fs.pipe_file(f"{bucket}/c1", b"2", mode="create")
            print("s3fs     second create succeeded: NOT exclusive")
        except FileExistsError:
            print("s3fs     second create: FileExistsError (exclusive)")
        obstore.put(st, "c2", b"1", mode="create")
        try:
            obstore.put(st, "c2", b"2", mode="create")
            print("obstore  second create succeeded: NOT exclusive")
        except Exception as e:
            print(f"obstore  second create: {type(e).__name__} (exclusive)")
        # Failures: a missing bucket, an unreachable endpoint.
        for label, endpoint, bkt in (("missing bucket", server.endpoint, "no-such-bucket"),
                                     ("unreachable endpoint", "http://127.0.0.1:9", bucket)):
            f2 = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint)
            s2 = S3Store(bkt, endpoint=endpoint, region="us-east-1", access_key_id=server.key,
                         secret_access_key=server.secret, client_options={"allow_http": True})
            for client, call in (("s3fs", lambda: f2.pipe_file(f"{bkt}/x", b"1")),
                                 ("obstore", lambda: obstore.put(s2, "x", b"1"))):
                t = time.perf_counter()
                try:
                    call()
                    what = "no error"
                except Exception as e:
                    what = f"{type(e).__name__}: {' '.join(str(e).split())[:90]}"
                print(f"{client:8s} {label:20s} {time.perf_counter() - t:5.1f} s  {what}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
