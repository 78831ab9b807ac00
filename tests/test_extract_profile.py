"""`dflash extract --profile`: the command's own timeline covers its wall time and has a row for every shard."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash.storage import Store
from dflash.tests.tiny_targets import build_tiny_target
from test_extract_run import write_conversations


def test_profile_parts_sum_to_wall(tmp_path: Path) -> None:
    model = build_tiny_target(tmp_path / "model")
    data = write_conversations(tmp_path / "data.jsonl", 60, bad={})
    out, profile = tmp_path / "store", tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "dflash.cli", "extract", "--model", str(model), "--data", str(data), "--out", str(out),
           "--gpus", "cpu", "--shard-size", "6", "--batch-tokens", "1024", "--max-length", "256",
           "--min-loss-tokens", "4", "--dtype", "float32", "--profile", str(profile)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(profile.read_text())
    assert doc["version"] == 1 and len(doc["workers"]) == 1
    w = doc["workers"][0]
    # The main thread's parts are timed intervals that never overlap: together they must cover the wall time.
    assert abs(sum(w["parts"].values()) - w["wall_s"]) <= 0.05 * w["wall_s"], w
    for part in ("import_torch", "import_transformers", "import_storage", "import_dflash", "model_config", "read",
                 "model_wait", "runner", "forward", "pack"):
        assert w["parts"].get(part, 0) > 0, (part, w["parts"])
    # One device: the target is checked and loaded beside the main thread, which only waits for it.
    assert "model_load" not in w["parts"] and "model_check" not in w["parts"], w["parts"]
    # The weight files are read into the page cache from the start, beside the imports.
    for part in ("model_prefetch", "model_imports", "model_check", "model_load"):
        assert w["background"].get(part, 0) > 0, (part, w["background"])
    store = Store.open(str(out))
    rows = {r["shard"]: r for r in w["shards"]}
    assert sorted(rows) == list(range(store.num_shards)) == store.committed_ids()
    for r in rows.values():
        for part in ("tokenise", "forward", "sink", "compress", "write_fsync", "commit"):
            assert r.get(part, 0) > 0, (part, r)
    # One row a forward: its shape, its tokens (every committed token once) and the forward thread's seconds in it,
    # which the forward stage holds with the copies it issued.
    batches = w["batches"]
    assert batches and "batches_dropped" not in w
    assert sum(b["tokens"] for b in batches) == sum(store.commit_record(i)["num_tokens"] for i in store.committed_ids())
    for b in batches:
        assert b["shard"] in rows and 0 < b["tokens"] <= b["rows"] * b["length"] and b["host_forward_s"] > 0, b
        assert "sink_s" in b and "copy_s" in b, b
    # on the CPU the forward stage is the forwards themselves (the copies are no work): nothing lost, nothing twice
    host = sum(b["host_forward_s"] for b in batches)
    assert 0.8 * w["parts"]["forward"] <= host <= w["parts"]["forward"] + 1e-3, (host, w["parts"]["forward"])
    assert "timeline cpu: wall" in done.stderr and "beside it: target load (model_prefetch" in done.stderr


def test_an_atomic_write_to_a_pipe_or_a_link_writes_through_and_replaces_no_special_file(tmp_path: Path) -> None:
    """write_atomic (every --profile, metrics and record file): a path that is a FIFO (as /dev/stdout is under a
    pipe, or /dev/null a device) gets the data written to it and stays what it was; a temp file renamed over it
    had put a regular file in /dev/null's place as root. A symbolic link keeps pointing at its file, which is
    replaced whole."""
    import threading

    from dflash.runtime.atomic import write_atomic

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_atomic(fifo, '{"version": 1}\n')
    reader.join(timeout=30)
    assert fifo.is_fifo(), "the pipe was replaced by a regular file"
    assert got == [b'{"version": 1}\n']
    assert [p.name for p in tmp_path.iterdir()] == ["fifo"]  # no temp file left beside it
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_profile_to_a_pipe(tmp_path: Path) -> None:
    """`--profile` naming a pipe (what /dev/stdout is under `| jq`): the timeline's JSON comes through it, exit 0,
    and the pipe is still a pipe."""
    import threading

    model = build_tiny_target(tmp_path / "model")
    data = write_conversations(tmp_path / "data.jsonl", 12, bad={})
    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "dflash.cli", "extract", "--model", str(model), "--data", str(data), "--out",
           str(tmp_path / "store"), "--gpus", "cpu", "--shard-size", "6", "--max-length", "256",
           "--min-loss-tokens", "4", "--dtype", "float32", "--profile", str(fifo)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()  # its open blocks until the command opens the pipe to write its timeline
    err = proc.communicate(timeout=300)[1]
    reader.join(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert fifo.is_fifo(), "the pipe was replaced by a regular file"
    assert got, "nothing came through the pipe"
    doc = json.loads(got[0])
    assert doc["version"] == 1 and doc["workers"][0]["batches"]
