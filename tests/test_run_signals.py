"""`dflash run` stopped by a signal while both stages work: Ctrl-C (SIGINT to the terminal's whole foreground process
group) or SIGTERM (to the supervisor alone) stops extract and train cleanly, ends with one line saying how to resume,
leaves no process, claim or lock behind, and the same command then resumes both to the uninterrupted result."""
from __future__ import annotations

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash.config import ExtractConfig
from dflash.storage import Store
from dflash.train.checkpoint import Checkpointer
from dflash.train.run_folder import RUN_LOCK
from test_extract_run import store_samples
from test_run import EXTRACT, children, committed, dflash, run_argv
from test_train_run import losses

supervise = importlib.import_module("dflash.run.supervise")  # the package's name `supervise` is the function
stage = importlib.import_module("dflash.run.stage")  # where Stage and its SWEEP_S live

RESUME = "dflash run: stopped; rerun the same command to resume extraction and training"
# Enough rows that extraction is still going when training has made its first step (each stage needs seconds to
# start on cpu); one slot so training starts on the first committed shard.
ROWS = 1200
# Far more steps than a stage makes between its first checkpoint and the signal (the test asserts it), and few
# enough that the resumed run's remaining steps take seconds.
MAX_STEPS = 80
SHARDS = ROWS // 8  # test_run's EXTRACT: shards of 8 rows
TRAIN_FLAGS = ["--grad-accum", "1", "--max-steps", str(MAX_STEPS), "--save-every", "5", "--keep", "2"]
STOP_TIMEOUT = 90  # the supervisor's stop waits for both stages to unwind; far below its 60 s SIGKILL per stage


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run-signals-data") / "rows.jsonl"
    rng = random.Random(1)
    words = "the a model token layer block draft target cache shard store verify".split()
    with open(path, "w") as f:
        for _ in range(ROWS):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": "one two three four " * 3}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(tiny_qwen3, many_rows, tmp_path_factory) -> dict:
    """The samples of an uninterrupted extract of many_rows."""
    import torch

    from dflash.extract import run as extract

    out = tmp_path_factory.mktemp("run-signals-ref") / "store"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stages' OMP_NUM_THREADS=1: two threads on a shared machine crawl
    try:
        extract(ExtractConfig(model=str(tiny_qwen3), data=(str(many_rows),), out=str(out), **EXTRACT))
    finally:
        torch.set_num_threads(before)
    return store_samples(out)


def start_both(model: Path, data: Path, tmp_path: Path) -> tuple[subprocess.Popen, list[str], dict[str, int]]:
    """Start `dflash run` and return it, its argv and its children once extract has committed a shard (and is
    still extracting) and training has made a step and a checkpoint (and is still training)."""
    store, run = tmp_path / "store", tmp_path / "run"
    argv = run_argv(model, data, store, run, *TRAIN_FLAGS)
    p = dflash(*argv)
    deadline = time.monotonic() + 300
    paused = None
    while not (committed(store) >= 1 and losses(run) and Checkpointer(run).latest() is not None):
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out waiting for a commit and a step"
        if paused is None and committed(store) >= SHARDS - 20 and "extract" in (kids := children(p.pid)):
            # On a fast machine extraction could finish before training has made a checkpoint: hold it near its
            # end (its whole process group, as a terminal's Ctrl-Z would) until training has one.
            paused = kids["extract"]
            os.killpg(paused, signal.SIGSTOP)
        time.sleep(0.02)
    if paused is not None:
        os.killpg(paused, signal.SIGCONT)
    kids = children(p.pid)
    assert set(kids) == {"extract", "train"}, kids
    assert not Store.open(str(store)).is_complete() and len(losses(run)) < MAX_STEPS  # both still at work
    return p, argv, kids


def processes_of(groups: set[int], marker: str) -> list[str]:
    """Return 'pid cmdline' of every live process in one of the process groups, or whose command line names
    marker (the test's unique tmp path)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        if fields[0] == "Z":
            continue  # exited, not yet reaped by its parent (init): nothing runs
        if int(fields[2]) in groups or marker in cmdline:
            found.append(f"{proc.name} {cmdline}")
    return found


def assert_stopped_cleanly(p: subprocess.Popen, err: str, sig: int, kids: dict[str, int], tmp_path: Path) -> None:
    assert p.returncode == 128 + sig, err[-3000:]
    assert err.rstrip().splitlines()[-1] == RESUME, err[-3000:]
    assert err.count(RESUME) == 1 and "dflash: interrupted" not in err, err[-3000:]  # one line, said once
    assert "Traceback" not in err and "Aborted" not in err, err[-3000:]
    for log in (tmp_path / "run" / "logs").glob("*.log"):  # the plan's and both stages'
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
    left = processes_of(set(kids.values()), str(tmp_path))
    assert not left, left
    claims = tmp_path / "store" / "claims"
    assert not claims.is_dir() or not list(claims.iterdir()), list(claims.iterdir())
    assert not (tmp_path / "run" / RUN_LOCK).exists()


def send(p: subprocess.Popen, sig: int, to_group: bool) -> None:
    """Send sig as a terminal's Ctrl-C does (the whole foreground process group) or as `kill PID` does."""
    if to_group:
        os.killpg(p.pid, sig)
    else:
        os.kill(p.pid, sig)


def press_ctrl_c_until_it_ends(p: subprocess.Popen) -> None:
    """Send SIGINT to the process group every 10 ms, as a user pressing Ctrl-C again and again, until p ends."""
    deadline = time.monotonic() + STOP_TIMEOUT
    while p.poll() is None and time.monotonic() < deadline:
        try:
            os.killpg(p.pid, signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("sig,to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-again-and-again-to-the-group", "sigterm-to-the-supervisor"])
def test_a_signal_stops_both_stages_cleanly_and_the_same_command_resumes_both(tiny_qwen3, many_rows, reference,
                                                                              tmp_path, sig, to_group):
    p, argv, kids = start_both(tiny_qwen3, many_rows, tmp_path)
    if to_group:  # Ctrl-C pressed until it is over: the first press stops, the others are answered once
        press_ctrl_c_until_it_ends(p)
    else:
        send(p, sig, to_group)
    _, err = p.communicate(timeout=STOP_TIMEOUT)
    assert_stopped_cleanly(p, err, sig, kids, tmp_path)
    if to_group:
        assert err.count("dflash run: still stopping") == 1, err[-3000:]  # answered once, not escalated

    again = dflash(*argv)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    store = tmp_path / "store"
    assert Store.open(str(store)).is_complete()
    got = store_samples(store)
    assert sorted(got) == sorted(reference)
    for row, arrays in reference.items():
        assert all(np.array_equal(a, b) for a, b in zip(got[row], arrays)), row
    assert [step for step, _ in losses(tmp_path / "run")] == list(range(1, MAX_STEPS + 1))
    rerun = (tmp_path / "run" / "logs" / "train.log").read_text().split("--- dflash run: starting train")[-1]
    assert " resumed " in rerun and "starting from step 0" not in rerun, rerun[-3000:]


def the_plan(pid: int) -> int | None:
    """Return the pid of the `dflash extract --dry-run` a supervisor runs first, while it runs."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"--dry-run" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                    return int(child)
            except OSError:
                continue
    return None


@pytest.mark.parametrize("sig,to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-to-the-group", "sigterm-to-the-supervisor"])
def test_a_signal_during_the_plan_starts_no_stage(tiny_qwen3, many_rows, tmp_path, sig, to_group):
    p = dflash(*run_argv(tiny_qwen3, many_rows, tmp_path / "store", tmp_path / "run", *TRAIN_FLAGS))
    deadline = time.monotonic() + 120
    while (plan := the_plan(p.pid)) is None:
        assert p.poll() is None and time.monotonic() < deadline, "the plan never ran"
        time.sleep(0.01)
    send(p, sig, to_group)
    _, err = p.communicate(timeout=STOP_TIMEOUT)
    assert p.returncode == 128 + sig, err[-3000:]
    assert err.rstrip().splitlines() == [RESUME], err[-3000:]  # the plan's own line is in plan.log only
    assert "Traceback" not in err and not processes_of({plan}, str(tmp_path))
    logs = tmp_path / "run" / "logs"
    assert not (logs / "extract.log").exists() and not (logs / "train.log").exists()
    assert "Traceback" not in (logs / "plan.log").read_text()


GROUP_LEADER = """
import subprocess, sys, time
# A worker that ignores SIGTERM (stuck, or a launcher's helper), then ready.
worker = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                           " print('ready', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
worker.stdout.readline()
print(worker.pid, flush=True)
time.sleep(300)
"""


def test_what_a_stage_leaves_in_its_process_group_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "SWEEP_S", 0.5)
    st = supervise.Stage("stage", tmp_path / "stage.log")
    st.proc = subprocess.Popen([sys.executable, "-c", GROUP_LEADER], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        worker = int(st.proc.stdout.readline())
        assert st.stop(timeout=30) == -signal.SIGTERM
        assert not processes_of({st.proc.pid}, "\0"), f"worker {worker} outlived its stage"
    finally:
        try:
            os.killpg(st.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
