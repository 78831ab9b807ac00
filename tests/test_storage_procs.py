"""Real writer processes: several at once on one store, and SIGKILL at random moments followed by resume."""
from __future__ import annotations

import random
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dflash.storage import Store
from dflash.storage.follow import follow_commits
from dflash.tests.synthetic_shards import synthetic_sample, write_synthetic_shard

HEADER = {"layer_ids": [3, 9], "hidden_size": 256, "codec": "blosc", "shard_plan": {"num_shards": 8}, "run": "procs"}
SAMPLES = 6
CHUNK = 128

# A writer process: claims what it can of the given shards in order and fills them with the deterministic
# synthetic samples; prints one line per commit. No torch import, so it starts fast.
WORKER = """
import sys
from dflash.storage import Store
from dflash.tests.synthetic_shards import write_synthetic_shard
url, ids = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
store = Store.open(url, chunk_tokens={chunk})
print("ready", flush=True)
for i in ids:
    if write_synthetic_shard(store, i, num_samples={samples}) is not None:
        print("committed", i, flush=True)
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER.format(chunk=CHUNK, samples=SAMPLES))
    return str(path)


def start(worker: str, url: str, ids) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, worker, url, ",".join(map(str, ids))], stdout=subprocess.PIPE, text=True)


def reference(tmp_path) -> dict[int, dict]:
    """Return the commit records of every shard written in this process, uninterrupted."""
    ref = Store.create_or_open(str(tmp_path / "reference"), HEADER, chunk_tokens=CHUNK)
    return {i: write_synthetic_shard(ref, i, num_samples=SAMPLES) for i in range(8)}


def assert_same_as_reference(store: Store, shard_id: int, ref: dict) -> None:
    rec = store.commit_record(shard_id)
    # Byte-identical: every stored file has the reference's checksum and size.
    assert rec["files"] == ref["files"] and rec["num_tokens"] == ref["num_tokens"]
    assert store.verify(shard_id) == []


def test_four_writer_processes_and_a_follower(tmp_path, worker):
    url = str(tmp_path / "store")
    store = Store.create_or_open(url, HEADER)
    seen: list[int] = []
    follower = threading.Thread(target=lambda: seen.extend(follow_commits(store, poll=0.02, max_poll=0.2, timeout=120)))
    follower.start()
    # Every process tries every shard, each in its own order, so they contend for the same claims.
    procs = [start(worker, url, list(range(8))[k * 2 :] + list(range(8))[: k * 2]) for k in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    commits = [int(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("committed")]
    assert sorted(commits) == list(range(8)), outs  # each shard written exactly once
    store.mark_complete()
    follower.join(60)
    assert not follower.is_alive() and sorted(seen) == list(range(8)) and len(seen) == 8
    writers = {store.commit_record(i)["writer"]["pid"] for i in range(8)}
    assert writers <= {p.pid for p in procs}
    ref = reference(tmp_path)
    for i in range(8):
        assert_same_as_reference(store, i, ref[i])
        data = store.read_shard(i)
        ids, mask, bits = synthetic_sample(i, SAMPLES - 1, 2, 256)
        np.testing.assert_array_equal(data.sample(SAMPLES - 1)[0], ids)
        np.testing.assert_array_equal(data.sample(SAMPLES - 1)[2].view(dtype=__import__("torch").int16).numpy()
                                      .view(np.uint16), bits)


def crash_and_resume(tmp_path, worker: str, kills: int, seed: int) -> None:
    """SIGKILL a writer `kills` times at random moments; after each, the store must hold exactly sound commits."""
    t0 = time.perf_counter()
    ref = reference(tmp_path)
    per_shard = (time.perf_counter() - t0) / 8  # only to spread the kill moments over the writing
    rng = random.Random(seed)
    url = str(tmp_path / "crash")
    done_kills = 0
    while done_kills < kills:
        store = Store.create_or_open(url, HEADER)
        remaining = sorted(set(range(8)) - set(store.committed_ids()))
        if not remaining:
            shutil.rmtree(url)  # every shard landed: start over so the kills keep hitting writes
            continue
        p = start(worker, url, remaining)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, per_shard * len(remaining) * 1.5))
        p.kill()
        p.wait()
        done_kills += 1
        store = Store.open(url)
        for i in store.committed_ids():
            assert_same_as_reference(store, i, ref[i])
        store.gc()
        if store.committed_ids() and rng.random() < 0.3:
            store.withdraw(rng.choice(store.committed_ids()))  # `verify --repair` does this; the redo must match
            store.gc()
        committed = {f"{i:05d}" for i in store.committed_ids()}
        left = {d.name for d in (tmp_path / "crash/shards").iterdir() if d.is_dir()}
        assert left == committed and not list((tmp_path / "crash/claims").iterdir())
        assert not list((tmp_path / "crash").rglob("*.partial"))
    store = Store.open(url)
    p = start(worker, url, range(8))
    p.communicate(timeout=120)
    assert p.returncode == 0 and store.committed_ids() == list(range(8))
    for i in range(8):
        assert_same_as_reference(store, i, ref[i])


def test_sigkill_then_resume(tmp_path, worker):
    crash_and_resume(tmp_path, worker, kills=4, seed=0)


@pytest.mark.slow
def test_sigkill_at_many_moments_then_resume(tmp_path, worker):
    crash_and_resume(tmp_path, worker, kills=24, seed=1)
