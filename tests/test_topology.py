"""The product's topology on the CPU: two `dflash extract` processes fill one store while `dflash train --follow`
trains from it; the trainer sees every shard once and the store verifies."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from dflash.storage import Store
from dflash.train.plan import split_shards
from dflash.train.metrics import read_metrics
from test_extract_crash import _commits
from test_train_run import EXTRACT_ARGS, cli, flags, opts

# Shards of 2 rows: 12 shards of the toy data, enough for both writers and several rounds of the trainer.
ARGS = [("2" if prev == "--shard-size" else a) for prev, a in zip([None, *EXTRACT_ARGS], EXTRACT_ARGS)]


def wait_for(what: str, ready, procs: list[subprocess.Popen], deadline: float) -> None:
    """Return once ready() holds; fail if a process in procs ended badly or the deadline passed first."""
    while not ready():
        for p in procs:
            assert p.poll() in (None, 0), f"a process ended with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} before the deadline"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_extract_writers_and_a_following_trainer_share_one_store(tiny_qwen3, toy_data, tmp_path):
    out, run, log = tmp_path / "store", tmp_path / "run", tmp_path / "train.log"
    extract = ["extract", "--model", str(tiny_qwen3), "--data", str(toy_data), "--out", str(out), *ARGS]
    deadline = time.monotonic() + 300
    first = cli(*extract, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [first]
    try:
        wait_for("first commit", lambda: _commits(str(out)) >= 1, procs, deadline)
        # Freeze the first writer with a claim still live: the trainer must wait, the second writer must work around it.
        os.killpg(first.pid, signal.SIGSTOP)
        with open(log, "w") as f:
            trainer = cli("train", *flags(opts(str(out), tiny_qwen3, run, follow=True, epochs=1)), stdout=f, stderr=f)
        procs.append(trainer)
        wait_for("wait of the trainer", lambda: "waiting for `dflash extract`" in log.read_text(), procs, deadline)
        second = cli(*extract, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(second)
        assert second.wait(timeout=300) == 0
        assert not Store.open(str(out)).is_complete(), "the frozen writer's shard cannot be committed yet"
        os.killpg(first.pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0
        assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    store = Store.open(str(out))
    assert store.is_complete()
    writers = {store.commit_record(s)["writer"]["pid"] for s in store.committed_ids()}
    assert writers == {first.pid, second.pid}, "both extract processes should have committed shards"
    verify = cli("verify", str(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert verify.wait(timeout=120) == 0, verify.stdout.read()
    train_ids, _ = split_shards(store.num_shards, 0.2)
    ends = [r for r in read_metrics(run) if r.get("event") == "epoch_end"]
    assert [e["epoch"] for e in ends] == [0]
    rounds = ends[0]["rounds"]
    assert len(rounds) >= 2 and sorted(sum(rounds, [])) == train_ids  # every shard once, in several arrivals
