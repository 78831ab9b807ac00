"""`dflash run`: its options map onto both stages, a deterministic error is reported once, and a run whose extract
and train children are SIGKILLed at random moments ends with the uninterrupted store and losses."""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.cli import cli, make_config
from dflash.config import RUN_SHARED, ExtractConfig, RunConfig, TrainConfig, run_stage_options
from dflash.run import grow_gpus
from dflash.storage import Store
from test_extract_run import store_samples
from test_train_run import losses

EXTRACT = dict(gpus="cpu", shard_size=8, batch_tokens=1024, max_length=256, min_loss_tokens=4, dtype="float32")
# 3 shards, 3 slots: follow mode's one round holds every shard, so its batches are a plain run's.
TRAIN = dict(gpus="cpu", epochs=50, max_steps=14, batch_tokens=256, draft_layers=1, block_size=8, anchors=32,
             dtype="float32", val_fraction=0.0, log_every=1, save_every=2, keep=3, seed=0, grad_accum=3)


def run_argv(model: Path, data: Path, store: Path, out: Path, *more: str) -> list[str]:
    """Return `dflash run` arguments of EXTRACT and TRAIN on cpu."""
    argv = ["run", "--model", str(model), "--data", str(data), "--store", str(store), "--out", str(out),
            "--extract-gpus", "cpu", "--train-gpus", "cpu", "--progress-every", "1"]
    for stage, opts in ((ExtractConfig, EXTRACT), (TrainConfig, TRAIN)):
        names = run_stage_options(stage)
        for key, value in opts.items():
            if key != "gpus":
                argv += ["--" + names[key].replace("_", "-"), str(value)]
    return [*argv, *more]


def parse_run(argv: list[str]) -> tuple[RunConfig, ExtractConfig, TrainConfig]:
    ctx = cli.commands["run"].make_context("run", argv[1:])
    opts = ctx.params
    cfg = make_config(RunConfig, opts)
    ext = make_config(ExtractConfig, opts, run_stage_options(ExtractConfig), model=cfg.model, data=cfg.data,
                      out=cfg.store, gpus=cfg.extract_gpus)
    tr = make_config(TrainConfig, opts, run_stage_options(TrainConfig), target=cfg.model, store=cfg.store,
                     out=cfg.out, gpus=cfg.train_gpus, follow=True, resume=True)
    return cfg, ext, tr


def test_every_stage_option_is_a_run_option_and_reaches_its_stage(tmp_path):
    # hidden: former option names, still taken (tests/test_option_names.py)
    params = {p.name for p in cli.commands["run"].params if not p.hidden} - {"config"}
    run_fields = {f.name for f in dataclasses.fields(RunConfig)}
    for stage in (ExtractConfig, TrainConfig):
        names = run_stage_options(stage)
        shared = RUN_SHARED[stage.__name__]
        assert set(names) | set(shared) == {f.name for f in dataclasses.fields(stage)}
        assert set(names.values()) <= params and set(v for v in shared.values() if v) <= run_fields
    assert params == run_fields | set(run_stage_options(ExtractConfig).values()) | set(
        run_stage_options(TrainConfig).values())
    cfg, ext, tr = parse_run(run_argv("M", "D", "S", "R", "--lr", "0.001", "--codec", "fp8", "--layers", "1,3"))
    assert (ext.model, ext.data, ext.out, ext.gpus, ext.batch_tokens, ext.codec, ext.layers) == (
        "M", ("D",), "S", "cpu", 1024, "fp8", (1, 3))
    assert (tr.target, tr.store, tr.out, tr.batch_tokens, tr.lr, tr.grad_accum, tr.follow, tr.resume) == (
        "M", "S", "R", 256, 0.001, 3, True, True)
    # What the supervisor passes a stage parses back to the same config.
    for c, command in ((ext, "extract"), (tr, "train")):
        ctx = cli.commands[command].make_context(command, c.to_argv())
        assert make_config(type(c), ctx.params) == c


@pytest.mark.parametrize("train,extract,slots,want", [
    ("5,6,7", "0,1,2,3,4", 24, [5, 6, 7, 0, 1, 2, 3, 4]),
    ("5,6,7", "0,1,2,3,4", 12, [5, 6, 7, 0, 1, 2]),
    ("5,6,7", "0,1,2,3,4", 3, None),
    ("cpu", "cpu", 4, None),
    ("5,6", "0,1", 4, [5, 6, 0, 1]),
])
def test_training_grows_onto_as_many_freed_gpus_as_share_its_slots(train, extract, slots, want):
    assert grow_gpus(train, extract, slots) == want


def dflash(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "dflash.cli", *args], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_a_deterministic_error_is_reported_once_and_not_retried(tiny_qwen3, toy_data, tmp_path):
    p = dflash(*run_argv(tiny_qwen3, toy_data, tmp_path / "s", tmp_path / "r", "--layers", "1,99"))
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    lines = [x for x in err.splitlines() if "99" in x]
    assert len(lines) == 1 and "--layers" in lines[0], err
    assert not (tmp_path / "r" / "logs" / "extract.log").exists()  # the plan refused it: nothing was started


def children(pid: int) -> dict[str, int]:
    """Return {stage: pid} of a supervisor's running `dflash extract` / `dflash train` children."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            for stage in ("extract", "train"):
                if stage.encode() in argv and b"--dry-run" not in argv:
                    out[stage] = int(child)
    return out


def committed(store: Path) -> int:
    folder = store / "commits"
    return len(list(folder.glob("*.json"))) if folder.is_dir() else 0


@pytest.mark.slow
def test_sigkilled_stages_are_restarted_and_the_run_equals_uninterrupted_ones(tiny_qwen3, toy_data, tmp_path):
    from dflash import train as train_stage
    from dflash.extract import run as extract

    ref_store, ref_run = tmp_path / "ref-store", tmp_path / "ref-run"
    extract(ExtractConfig(model=str(tiny_qwen3), data=(str(toy_data),), out=str(ref_store), **EXTRACT))
    train_stage.run(TrainConfig(store=str(ref_store), target=str(tiny_qwen3), out=str(ref_run), **TRAIN))
    expected = losses(ref_run)
    assert len(expected) == TRAIN["max_steps"]

    store, run = tmp_path / "store", tmp_path / "run"
    p = dflash(*run_argv(tiny_qwen3, toy_data, store, run, "--retries", "5"))
    rng = random.Random(7)
    # Kill extract once a random number of shards is committed, then train at two random steps.
    kills = [("extract", lambda: committed(store) >= rng.choice([0, 1, 2])),
             ("train", lambda k=rng.randint(1, 5): len(losses(run)) >= k),
             ("train", lambda k=rng.randint(7, 11): len(losses(run)) >= k)]
    killed = []
    deadline = time.monotonic() + 400
    while kills and p.poll() is None and time.monotonic() < deadline:
        stage, due = kills[0]
        pid = children(p.pid).get(stage)
        if stage == "extract" and (store / "complete.json").exists():
            kills.pop(0)  # finished before the moment came
            continue
        if pid is not None and due():
            time.sleep(rng.uniform(0, 0.05))
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(stage)
            except ProcessLookupError:
                pass
            kills.pop(0)
        time.sleep(0.01)
    out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
    assert p.returncode == 0, err[-4000:]
    assert "train" in killed, err[-4000:]
    assert err.count("died (exit -9); restarting") == len(killed), err[-4000:]
    assert "dflash run: done" in err and "plan of" in err
    assert Store.open(str(store)).is_complete()
    got, want = store_samples(store), store_samples(ref_store)
    assert sorted(got) == sorted(want)
    import numpy as np

    for row, arrays in want.items():
        assert all(np.array_equal(a, b) for a, b in zip(got[row], arrays)), row
    assert losses(run) == expected
    assert (run / "logs" / "extract.log").is_file() and (run / "logs" / "train.log").is_file()
