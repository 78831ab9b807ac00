"""SIGKILL `dflash extract` at random moments, rerun the same command: the store equals an uninterrupted run's.
Also: two `dflash extract` processes on one store share the shards without overlap."""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash.extract import run
from dflash.storage import Store
from test_extract_run import extract_config, one_torch_thread, store_samples, write_conversations  # noqa: F401

# A fresh interpreter that pays the torch/transformers import once, then forks one real `dflash extract` per request
# (its main(), argv and all) and reports the child's pid and later its wait status. No torch op runs before the
# fork, so the children start clean; each is killed with a real SIGKILL.
_LAUNCHER = r"""
import json, os, sys
import torch, transformers
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401  (lazy modules resolved before forking)
from transformers import AutoModelForCausalLM, AutoTokenizer, AutoConfig  # noqa: F401
import dflash.cli, dflash.storage, dflash.extract.orchestrate, dflash.extract.worker, dflash.extract.pipeline  # noqa: F401
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            dflash.cli.main(json.loads(line))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        os._exit(code)
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the one_torch_thread fixture does in this process


class Launcher:
    """Starts `dflash extract` runs as forks of one warm interpreter; see _LAUNCHER."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_ENV,
        )

    def start(self, argv: list[str]) -> int:
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def finished(self, timeout: float = 0.0) -> bool:
        return bool(select.select([self.proc.stdout], [], [], timeout)[0])

    def status(self) -> int:
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _argv(cfg) -> list[str]:
    argv = ["--log-level", "warning", "extract", "--model", cfg.model, "--out", cfg.out, "--gpus", "cpu"]
    for d in cfg.data:
        argv += ["--data", d]
    for opt in ("shard_size", "batch_tokens", "max_length", "min_loss_tokens", "dtype"):
        argv += ["--" + opt.replace("_", "-"), str(getattr(cfg, opt))]
    if cfg.offload == "cpu":  # the weights streamed from host memory by one rank
        argv += ["--shard-weights", "1", "--offload", "cpu"]
    return argv


def _commits(out: str) -> int:
    folder = Path(out) / "commits"
    return len(list(folder.glob("*.json"))) if folder.is_dir() else 0


def kill_and_resume(cfg, kills: int, seed: int) -> int:
    """Return the number of SIGKILLs delivered to `dflash extract` runs of cfg before a run finished on its own."""
    rng = random.Random(seed)
    launcher = Launcher()
    delivered = 0
    try:
        while True:
            before = _commits(cfg.out)
            pid = launcher.start(_argv(cfg))
            if delivered >= kills:
                assert launcher.status() == 0, "the resuming run failed"
                return delivered
            # A random moment: after 0-2 more shards commit (0 = during start-up), plus up to 20 ms. A tiny target
            # on an idle machine commits a one-row shard every few ms, so a longer pause would let the run finish.
            wait_for, deadline = rng.choice([0, 1, 1, 2]), time.monotonic() + 60
            while _commits(cfg.out) < before + wait_for and not launcher.finished(0.002):
                assert time.monotonic() < deadline, "extract made no progress"
            time.sleep(rng.uniform(0.0, 0.02))
            if launcher.finished():
                assert launcher.status() == 0
                return delivered  # the run completed before the kill: nothing left to interrupt
            os.kill(pid, signal.SIGKILL)
            assert launcher.status() == signal.SIGKILL
            delivered += 1
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def crash_data(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("crash") / "conv.jsonl", 40, seed=3)


@pytest.fixture(scope="module")
def reference(crash_data, tiny_qwen3, tmp_path_factory):
    """The uninterrupted run's samples."""
    cfg = extract_config(tiny_qwen3, crash_data, tmp_path_factory.mktemp("ref") / "store", shard_size=1)
    run(cfg)
    return store_samples(cfg.out)


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), "samples lost or added"
    for row, (ids, mask, bits) in want.items():
        g_ids, g_mask, g_bits = got[row]
        assert np.array_equal(g_ids, ids) and np.array_equal(g_mask, mask)
        assert np.array_equal(g_bits, bits), f"row {row}: features differ from the uninterrupted run"


def _check_killed_store(cfg, reference) -> None:
    store = Store.open(cfg.out)
    assert store.is_complete()
    assert all(store.verify(s) == [] for s in store.committed_ids())
    _assert_same(store_samples(cfg.out), reference)


@pytest.mark.parametrize("offload", ["none", "cpu"], ids=["resident", "streamed"])
def test_sigkill_then_rerun_equals_uninterrupted(offload, crash_data, tiny_qwen3, reference, tmp_path):
    cfg = extract_config(tiny_qwen3, crash_data, tmp_path / "store", shard_size=1, offload=offload)
    assert kill_and_resume(cfg, kills=3, seed=0) >= 2
    _check_killed_store(cfg, reference)


@pytest.mark.slow
def test_twenty_sigkills_then_rerun_equals_uninterrupted(crash_data, tiny_qwen3, reference, tmp_path):
    kills = 0
    for seed in range(1, 6):  # a finished store has nothing left to kill; start over until 20 kills landed
        if kills >= 20:
            break
        cfg = extract_config(tiny_qwen3, crash_data, tmp_path / f"store{seed}", shard_size=1)
        kills += kill_and_resume(cfg, kills=20 - kills, seed=seed)
        got = store_samples(cfg.out)
        assert Store.open(cfg.out).is_complete()
        _assert_same(got, reference)
    assert kills >= 20


def test_two_processes_share_one_store_without_overlap(crash_data, tiny_qwen3, reference, tmp_path):
    cfg = extract_config(tiny_qwen3, crash_data, tmp_path / "store", shard_size=1)
    cmd = [sys.executable, "-m", "dflash.cli", *_argv(cfg)]
    # Deterministic sharing: the first process commits a shard and is frozen (SIGSTOP, its claim still live),
    # the second runs to the end around that claim, then the first resumes and finishes what it holds.
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_ENV)
    deadline = time.monotonic() + 120
    while _commits(cfg.out) < 1:
        assert first.poll() is None and time.monotonic() < deadline, "the first extract made no progress"
        time.sleep(0.002)
    first.send_signal(signal.SIGSTOP)
    second = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_ENV)
    try:
        err2 = second.communicate(timeout=300)[1]
    finally:
        first.send_signal(signal.SIGCONT)
    err1 = first.communicate(timeout=300)[1]
    procs, errs = [first, second], [err1, err2]
    assert [p.returncode for p in procs] == [0, 0], errs
    store = Store.open(cfg.out)
    writers = {store.commit_record(s)["writer"]["pid"] for s in store.committed_ids()}
    assert writers == {p.pid for p in procs}, "both processes should have written shards"
    _check_killed_store(cfg, reference)  # every row exactly once (store_samples refuses duplicates)


@pytest.mark.slow
def test_spawned_workers_split_the_shards(crash_data, tiny_qwen3, reference, tmp_path, monkeypatch):
    # The multi-device path (one spawned process per device) on two CPU "devices": same store as one process.
    from transformers import AutoConfig, AutoTokenizer

    from dflash.conversations import read_rows
    from dflash.extract.header import build_header
    from dflash.extract.orchestrate import _run_spawned
    from dflash.extract.plan import make_plan, scan_rows
    from dflash.extract.progress import Progress
    from dflash.extract.template import load_template
    from dflash.extract.worker import WorkerSpec

    cfg = extract_config(tiny_qwen3, crash_data, tmp_path / "store", shard_size=1)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    rows = read_rows(cfg.data)
    scan = scan_rows(rows, cfg.max_length)
    header = build_header(cfg, AutoConfig.from_pretrained(cfg.model), tok, load_template(tok, None), scan)
    store = Store.create_or_open(cfg.out, header)
    plan = make_plan(header, rows, scan, (), cfg.out, ["cpu", "cpu"])  # the parent's plan, handed to both
    progress = Progress(40, show=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned interpreters
    results = _run_spawned(cfg, [WorkerSpec("cpu", i, store.header) for i in range(2)], plan, progress)
    assert sum(r["shards"] for r in results) == store.num_shards and all(r["shards"] > 0 for r in results)
    assert progress.samples == len(reference)
    _assert_same(store_samples(cfg.out), reference)


def _claimed_by(out: str, pid: int) -> list[int]:
    """Return the shards whose claim names pid and that are not committed."""
    held = []
    for p in (Path(out) / "claims").glob("*.json"):
        try:
            if json.loads(p.read_text()).get("pid") == pid and not (Path(out) / "commits" / p.name).exists():
                held.append(int(p.stem))
        except (ValueError, FileNotFoundError):
            continue  # being written, or just released
    return sorted(held)


def _committed_by(out: str, pid: int) -> bool:
    for p in (Path(out) / "commits").glob("*.json"):
        try:
            if json.loads(p.read_text())["writer"]["pid"] == pid:
                return True
        except (ValueError, KeyError, FileNotFoundError):
            continue
    return False


def test_three_writers_one_killed_survivors_finish_its_shards(crash_data, tiny_qwen3, reference, tmp_path):
    cfg = extract_config(tiny_qwen3, crash_data, tmp_path / "store", shard_size=1)
    cmd = [sys.executable, "-m", "dflash.cli", *_argv(cfg)]
    # Deterministic: the first writer is frozen holding a claim (live, so the others pass it by), the two others
    # start and get past it, are frozen in turn, and the first is killed: its claim is now a dead process's.
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_ENV)
    deadline = time.monotonic() + 120
    while True:
        assert first.poll() is None and time.monotonic() < deadline, "the first extract made no progress"
        if _commits(cfg.out) >= 1:
            first.send_signal(signal.SIGSTOP)
            if _claimed_by(cfg.out, first.pid):
                break
            first.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    held = _claimed_by(cfg.out, first.pid)
    others = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_ENV) for _ in range(2)]
    try:
        # Each is frozen once it has committed a shard: it has read the plan and passed the frozen writer's claims.
        waiting = list(others)
        while waiting:
            assert all(p.poll() is None for p in waiting) and time.monotonic() < deadline, "a writer finished early"
            for p in [p for p in waiting if _committed_by(cfg.out, p.pid)]:
                p.send_signal(signal.SIGSTOP)
                waiting.remove(p)
            time.sleep(0.002)
        first.kill()
        first.wait()
        assert _claimed_by(cfg.out, first.pid) == held  # still claimed by the now dead writer, not committed
    finally:
        for p in others:
            p.send_signal(signal.SIGCONT)
    errs = [p.communicate(timeout=300)[1] for p in others]
    first.stderr.close()
    assert [p.returncode for p in others] == [0, 0], errs
    _check_killed_store(cfg, reference)  # complete without a rerun, every row exactly once
