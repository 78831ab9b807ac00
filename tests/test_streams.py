"""A command's standard streams cannot fail its work: a full, closed or vanished stderr/stdout changes nothing but
the log, and no thread of ours hangs the exit."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from test_extract_run import data_file  # noqa: F401  (fixture)

FLAGS = "--gpus cpu --batch-tokens 1024 --max-length 256 --min-loss-tokens 1 --dtype float32 --shard-size 4"


def test_extract_completes_with_stderr_full_closed_or_gone(tiny_qwen3, data_file, tmp_path):  # noqa: F811
    """2>/dev/full (a log on a full disk), >&- 2>&- (a daemon) and | head -1 (a reader that leaves): each run ends
    by itself with exit 0 and a complete store, as the plain run does."""
    from dflash.storage import Store

    base = f"exec dflash extract --model {tiny_qwen3} --data {data_file} {FLAGS}"
    ways = {
        "full": f"{base} --out {tmp_path}/full 2>/dev/full",
        "closed": f"{base} --out {tmp_path}/closed >&- 2>&-",
        "gone": f"set -o pipefail; ({base} --out {tmp_path}/gone) 2>&1 | head -c 1 >/dev/null",
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {k: subprocess.Popen(["bash", "-c", cmd], env=env, start_new_session=True) for k, cmd in ways.items()}
    try:
        for k, p in procs.items():
            assert p.wait(timeout=240) == 0, k
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for k in ways:
        store = Store.open(str(tmp_path / k))
        assert store.is_complete() and len(store.committed_ids()) == store.num_shards, k


def test_a_lossy_stream_counts_what_it_drops():
    from dflash.runtime.process import LossyStream

    with open("/dev/full", "w") as full:
        s = LossyStream(full, "stderr")
        assert s.write("x" * 10_000) == 10_000  # buffered, then the flush fails
        s.flush()
        assert s.dropped >= 1 and "No space left" in str(s.error)


def test_a_thread_waited_for_is_still_waited_for_after_a_signal_interrupts_the_wait():
    """Python 3.11's join() can mark a thread stopped when a signal interrupts it; the pipeline's waits cannot."""
    from dflash.extract.pipeline import _Thread

    release = threading.Event()
    finished: list[float] = []

    def work() -> None:
        release.wait()
        finished.append(time.monotonic())

    t = _Thread(work, "test-commit")

    class Interrupted(Exception):
        pass

    def on_alarm(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            t.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not finished
    threading.Timer(0.3, release.set).start()
    t.wait()  # waits for the work itself, not a stale "stopped" mark
    assert finished
