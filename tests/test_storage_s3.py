"""A store on a real S3-protocol server (moto's server mode, started here on 127.0.0.1, credentials checked): extract,
concurrent extracts, SIGKILL and resume, verify with a flipped byte, train through the shard cache while following,
refusals of bad input, and no secret anywhere."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash.errors import CorruptShard, StoreError
from dflash.storage import Store
from dflash.tests.synthetic_shards import write_synthetic_shard

pytest.importorskip("s3fs", reason="the S3 tests need the s3 extra: pip install 'dflash[s3]'")

from s3_server import start_server  # noqa: E402
from test_train_run import EXTRACT_ARGS, dflash_main, flags, opts  # noqa: E402

HEADER = {"layer_ids": [3, 9], "hidden_size": 128, "codec": "blosc", "shard_plan": {"num_shards": 4}, "run": "s3"}


@pytest.fixture(scope="module")
def s3():
    """A moto server and this process's AWS environment pointing at it (restored afterwards)."""
    try:
        server = start_server()
    except Exception as e:  # moto missing or no local port: one line, the rest of the suite runs
        pytest.skip(f"no S3 server here ({type(e).__name__}: {e})")
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def dflash(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash.cli", *args], env={**os.environ, **(env or {})},
                            text=True, start_new_session=True, **popen)


def run(*args: str, env: dict | None = None) -> tuple[int, str]:
    p = dflash(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def files(store: Store) -> dict[int, dict]:
    return {i: store.commit_record(i)["files"] for i in store.committed_ids()}


@pytest.mark.slow
def test_extract_kill_resume_concurrent_verify_repair(s3, store, tiny_qwen3, toy_data, tmp_path, capsys):
    """A dry run that writes nothing and counts the objects; two extracts at once, one SIGKILLed after the first
    commit, the other finishing; every shard equals the local store's, written once; a flipped byte is found by
    verify and repaired by a rerun; no secret anywhere."""
    from dflash.config import ExtractConfig
    from dflash.extract import run as extract
    from dflash.storage.summary import verify_store

    bucket = s3.bucket()
    url = f"s3://{bucket}/stores/tiny"
    config = dict(model=str(tiny_qwen3), data=(str(toy_data),), out=url, gpus="cpu", shard_size=4, batch_tokens=1024,
                  max_length=256, min_loss_tokens=4, dtype="float32")
    plan = extract(ExtractConfig(**config, dry_run=True))["plan"]
    printed = capsys.readouterr().out
    assert s3.keys(bucket) == {}, "a dry run wrote something"
    assert f"objects    {plan['projected_left_objects']:,} objects, " in printed and f"to write to {url}" in printed
    cmd = ("extract", "--model", str(tiny_qwen3), "--data", str(toy_data), "--out", url, *EXTRACT_ARGS)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [dflash(*cmd, stdout=open(p, "w"), stderr=subprocess.STDOUT) for p in logs]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if Store.open(url).committed_ids():
                break
        except StoreError:
            pass
        time.sleep(0.05)
    os.killpg(procs[0].pid, signal.SIGKILL)
    assert procs[1].wait(timeout=300) == 0, logs[1].read_text()[-2000:]  # and took over the killed one's claims
    s3_store, local = Store.open(url), Store.open(store)
    assert s3_store.is_complete() and files(s3_store) == files(local)  # byte for byte the local store's shards
    sample_ids = [int(x) for i in s3_store.committed_ids() for x in s3_store.read_shard(i).sample_ids]
    assert sorted(sample_ids) == sorted(int(x) for i in local.committed_ids() for x in local.read_shard(i).sample_ids)
    assert len(sample_ids) == len(set(sample_ids))  # nothing duplicated

    prefix = url[5:].split("/", 1)[1]
    shard_objects = [k for k in s3.keys(bucket) if k.startswith((f"{prefix}/shards/0", f"{prefix}/commits/"))]
    assert plan["projected_left_objects"] == len(shard_objects)
    key = f"{prefix}/shards/00002/features/c.0.0.0"
    c = s3.client()
    data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x40
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    code, rout = run("verify", url, "--repair")
    assert code == 1 and f"{url}/shards/00002/features/c.0.0.0" in rout and "checksum mismatch" in rout, rout
    assert "withdrew" in rout and 2 not in Store.open(url).committed_ids()
    extract(ExtractConfig(**config))
    assert verify_store(url) == (6, []) and files(Store.open(url)) == files(local)

    texts = [p.read_text() for p in logs] + [rout, printed] + [v.decode("latin-1") for v in s3.keys(bucket).values()]
    assert not [t for t in texts if s3.secret in t]


@pytest.mark.slow
def test_train_follows_an_s3_store_through_the_cache(s3, store, tiny_qwen3, tmp_path):
    """`train --follow` on a store still being written to S3: every shard fetched once into the cache, the second
    epoch read from local disk."""
    bucket = s3.bucket()
    url = f"s3://{bucket}/follow"
    local = Path(store)
    c = s3.client()

    def put(rel: str) -> None:
        c.put_object(Bucket=bucket, Key=f"follow/{rel}", Body=(local / rel).read_bytes())

    first, rest = ["00000", "00001"], ["00002", "00003", "00004", "00005"]
    for rel in ("zarr.json", "shards/zarr.json"):
        put(rel)

    def put_shards(ids):
        for sid in ids:
            for p in sorted((local / "shards" / sid).rglob("*")):
                if p.is_file():
                    put(str(p.relative_to(local)))
            put(f"commits/{sid}.json")  # last, as a writer commits

    put_shards(first)
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    tr = dflash("--log-level", "info", "train", *flags(opts(url, tiny_qwen3, run_dir, follow=True,
                                                             cache_dir=str(tmp_path / "cache"), cache_gb=1.0)),
                stdout=open(log, "w"),
                stderr=subprocess.STDOUT)
    time.sleep(3)
    put_shards(rest)
    put("complete.json")
    assert tr.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    cached = [line for line in text.splitlines() if "shard cache" in line and "fetched" in line]
    assert cached, text[-3000:]
    fetched = int(cached[-1].split("fetched ")[1].split()[0])
    hits = int(cached[-1].split("), ")[1].split()[0])
    from dflash.train.metrics import read_metrics

    ends = [r for r in read_metrics(run_dir) if r.get("event") == "epoch_end"]
    train_shards = sorted(sum(ends[0]["rounds"], []))
    assert [e["epoch"] for e in ends] == [0, 1] and sorted(ends[1]["rounds"][0]) == train_shards
    # Every shard (the held-out one too) fetched from S3 once; epoch 2 read local disk only.
    assert fetched == Store.open(url).num_shards and hits >= len(train_shards)
    assert s3.secret not in text


def test_cache_bounds_evicts_refetches_and_checks(s3, tmp_path):
    url = f"s3://{s3.bucket()}/cache"
    w = Store.create_or_open(url, HEADER, chunk_tokens=64)
    ref = {i: write_synthetic_shard(w, i, num_samples=3) for i in range(4)}
    r = Store.open(url)
    one = max(rec["bytes"] for rec in ref.values())
    cache = r.use_cache(str(tmp_path), gb=2.5 * one / 1e9, ahead=1)
    for _ in range(2):
        for i in range(4):
            got = r.read_shard(i)
            assert np.array_equal(got.input_ids, w.read_shard(i).input_ids)
        assert cache.used_bytes() <= 2.5 * one
    assert cache.stats["fetched"] > 4 and cache.stats["evicted"] > 0  # a bounded cache fetches evicted shards again
    # A damaged local copy is fetched again; a damaged object in the store is named by its S3 path.
    with cache.local(r.fs, 3, r.commit_record(3)) as fs:
        chunk = Path(fs.path("shards/00003/features/c.0.0.0"))
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    assert np.array_equal(r.read_shard(3).input_ids, w.read_shard(3).input_ids) and cache.stats["refetched"] == 1
    bucket = url[5:].split("/")[0]
    key = "cache/shards/00001/features/c.0.0.0"
    obj = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    obj[5] ^= 1
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(obj))
    for name in os.listdir(cache.root):
        if name.startswith("00001-"):
            import shutil

            shutil.rmtree(os.path.join(cache.root, name))
    with pytest.raises(CorruptShard, match=f"{url}/shards/00001/features/c.0.0.0.*do not match"):
        r.read_shard(1)
    cache.close()


def test_dead_writers_claim_is_taken_over_and_live_claims_are_exclusive(s3):
    url = f"s3://{s3.bucket()}/claims"
    st = Store.create_or_open(url, HEADER)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from dflash.runtime.locks import HOST

    st.fs.write_file("claims/00001.json", json.dumps({"host": HOST, "pid": dead.pid, "token": "x"}).encode())
    first = st.try_claim(0)
    assert first is not None and st.try_claim(0) is None  # a live claim (ours) is exclusive
    first.abort()
    w = st.try_claim(1)  # the dead writer's claim is taken over
    assert w is not None
    w.commit()
    assert st.committed_ids() == [1]
    # A machine that died (or a pod back under another name): its claim is taken over once its lease ran out.
    gone = {"host": "node-that-died", "pid": 7, "token": "y", "lease_s": 600}
    st.fs.write_file("claims/00002.json", json.dumps({**gone, "time": time.time() - 30}).encode())
    assert st.try_claim(2) is None  # renewed 30 s ago: alive
    st.fs.write_file("claims/00002.json", json.dumps({**gone, "time": time.time() - 700}).encode())
    w = st.try_claim(2)
    assert w is not None
    w.commit()
    assert st.committed_ids() == [1, 2]


def test_a_writer_renews_its_claim_on_s3(s3, monkeypatch):
    monkeypatch.setenv("DFLASH_CLAIM_LEASE_S", "1")  # renewals every 0.2 s
    st = Store.create_or_open(f"s3://{s3.bucket()}/renew", HEADER)
    w = st.try_claim(0)
    first = json.loads(st.fs.read_bytes("claims/00000.json"))
    time.sleep(0.8)
    assert json.loads(st.fs.read_bytes("claims/00000.json"))["time"] > first["time"]
    w.commit()
    time.sleep(0.4)
    assert not st.fs.exists("claims/00000.json")  # released, and no late renewal made it again


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "unreachable endpoint"])
def test_bad_s3_input_is_one_line_exit_2_and_writes_nothing(s3, case, tiny_qwen3, toy_data, capsys, monkeypatch):
    bucket = s3.bucket()
    url, env = f"s3://{bucket}/store", {}
    if case == "missing bucket":
        url = "s3://no-such-bucket-dflash/store"
    elif case == "wrong credentials":
        env = {"AWS_SECRET_ACCESS_KEY": "wrong-secret-0123456789"}
    else:
        env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = dflash_main(capsys, "extract", "--model", str(tiny_qwen3), "--data", str(toy_data), "--out", url,
                                 *EXTRACT_ARGS)
    out += err
    lines = [ln for ln in out.splitlines() if "error" in ln.lower() or "Traceback" in ln]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dflash: error: " + url), out
    assert {"missing bucket": "does not exist", "wrong credentials": "refused",
            "unreachable endpoint": "cannot reach"}[case] in lines[0]
    assert "wrong-secret-0123456789" not in out and s3.secret not in out
    assert s3.keys(bucket) == {}  # no half-made store
    names = [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert "no-such-bucket-dflash" not in names  # dflash never creates a bucket


def test_a_server_ignoring_conditional_creates_is_refused(s3, monkeypatch):
    from s3_server import start_forgetful_proxy

    from dflash.storage import s3 as s3_module

    plain = start_server(auth=False)
    proxy, url = start_forgetful_proxy(plain.endpoint)
    try:
        bucket = plain.bucket()
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        monkeypatch.setattr(s3_module, "_opened", {})
        with pytest.raises(StoreError, match=r"does not honour conditional creates \(a second PUT with If-None-Match"):
            Store.create_or_open(f"s3://{bucket}/store", HEADER)
        assert plain.keys(bucket) == {}  # refused before anything was written
    finally:
        proxy.shutdown()
        plain.stop()
