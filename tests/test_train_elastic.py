"""Elastic resume: a run checkpointed on 2 ranks continues on 1 or 4 with the same batches and losses, as long as the
slots (ranks x grad-accum) stay the same; a GPU count that cannot share the slots is refused with the ones that can."""
from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.config import TrainConfig
from dflash.errors import ConfigError
from dflash.drafter.folders import read_run_record
from dflash.train.run_folder import resume_grad_accum, write_run_record
from test_train_run import flags, losses, opts, train

KW = dict(epochs=3, batch_tokens=256, save_every=2, keep=5)


def torchrun(n: int, run: Path, store: str, target: Path, **over) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m",
           "dflash.cli", "train", *flags(opts(store, target, run, **KW, **over))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def two_rank_run(store, tiny_qwen3, tmp_path_factory) -> list[tuple[int, float]]:
    """The uninterrupted run on 2 ranks accumulating 2 (4 slots)."""
    run = tmp_path_factory.mktemp("elastic") / "ref"
    p = torchrun(2, run, store, tiny_qwen3, grad_accum=2)
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 0, err[-3000:]
    return losses(run)


def test_resume_takes_grad_accum_from_the_recorded_slots(tmp_path):
    cfg = TrainConfig(store="s", target="t", out=str(tmp_path), resume=True, grad_accum=1)
    write_run_record(tmp_path, {"config": {}, "resolved": {"num_slots": 4, "world_size": 2}})
    saved = read_run_record(tmp_path)
    assert resume_grad_accum(cfg, 1, saved).grad_accum == 4
    assert resume_grad_accum(cfg, 4, saved).grad_accum == 1
    assert resume_grad_accum(cfg, 2, saved).grad_accum == 2
    with pytest.raises(ConfigError, match="4 slots .* 3 GPU.* resume on 1, 2, 4 GPU"):
        resume_grad_accum(cfg, 3, saved)
    # A --grad-accum asked for (not the default 1) that makes other slots is refused, not quietly replaced.
    asked = dataclasses.replace(cfg, grad_accum=2)
    assert resume_grad_accum(asked, 2, saved) is asked
    with pytest.raises(ConfigError, match="--grad-accum 2 on 1 GPU.* makes 2 slots, the run has 4; leave --grad-accum out"):
        resume_grad_accum(asked, 1, saved)
    fresh = TrainConfig(store="s", target="t", out=str(tmp_path / "new"), resume=True, grad_accum=3)
    assert resume_grad_accum(fresh, 3, read_run_record(fresh.out)) is fresh  # nothing recorded yet: the options decide


@pytest.fixture(scope="module")
def killed_two_rank_run(store, tiny_qwen3, tmp_path_factory) -> Path:
    """The same 2-rank run SIGKILLed once it has its step-4 checkpoint (each test resumes a copy)."""
    run = tmp_path_factory.mktemp("elastic-killed") / "run"
    p = torchrun(2, run, store, tiny_qwen3, grad_accum=2)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-000004").is_dir():
        assert p.poll() is None and time.monotonic() < deadline, "the 2-rank run ended before its checkpoint"
        time.sleep(0.01)
    import os

    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    # The ranks die with the group, but a rank inside a system call (an fsync of its background checkpoint) dies
    # when the call returns: until then it holds the run's lock, rightly. Resume once it is gone.
    from dflash.runtime.locks import pid_alive

    lock = run / "train.lock"
    holder = json.loads(lock.read_text())["pid"] if lock.is_file() else None
    while holder is not None and pid_alive(holder) and time.monotonic() < deadline:
        time.sleep(0.05)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_two_ranks_resumed_on_another_count_give_the_uninterrupted_losses(store, tiny_qwen3, tmp_path, two_rank_run,
                                                                          killed_two_rank_run, world):
    expected = two_rank_run
    assert len(expected) >= 8
    run = tmp_path / "run"
    shutil.copytree(killed_two_rank_run, run)
    if world == 1:
        train(**opts(store, tiny_qwen3, run, resume=True, **KW))  # --grad-accum left at 1: the run's slots decide
    else:
        q = torchrun(world, run, store, tiny_qwen3, resume=True)
        err = q.communicate(timeout=300)[1]
        assert q.returncode == 0, err[-3000:]
    got = losses(run)
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [x for _, x in got] == pytest.approx([x for _, x in expected], rel=1e-5)
    record = json.loads((run / "config.json").read_text())
    assert record["resolved"]["world_size"] == world and record["resolved"]["num_slots"] == 4
    assert record["config"]["grad_accum"] == 4 // world
