"""`dflash train` under the things that go wrong: damaged checkpoints, a full disk, signals, kills before the first
checkpoint, two trainers on one run, slow CPU steps, default splits, and bad options that need no model."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_run import cli, dflash_main, flags, losses, opts, train

from dflash.drafter.folders import CHECKSUMS
from dflash.train.checkpoint import TRAINER_STATE, Checkpointer
from dflash.train.run_folder import RUN_LOCK
from dflash.train.metrics import read_metrics

INTERRUPTED = "dflash: interrupted; rerun the same command to resume"
# A run that keeps going until it is stopped (and never checkpoints by steps).
LONG = dict(epochs=100_000, save_every=100_000, log_every=1)


def wait_until(cond, p: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def temp_folders(run: Path) -> list[Path]:
    return list((run / "checkpoints").glob(".step-*")) if (run / "checkpoints").is_dir() else []


def test_a_damaged_checkpoint_is_refused_and_the_previous_sound_one_is_taken(store, tiny_qwen3, tmp_path, capsys,
                                                                               caplog):
    run = tmp_path / "run"
    kw = dict(epochs=1, save_every=2, keep=3, val_fraction=0.0)
    train(**opts(store, tiny_qwen3, run, **kw))
    ck = Checkpointer(run)
    (_, older), (_, newest) = ck.folders()[-2:]
    assert json.loads((newest / CHECKSUMS).read_text())["files"].keys() == {
        "model.safetensors", "drafter_config.json", TRAINER_STATE}
    good = (newest / "model.safetensors").read_bytes()
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x01
    (newest / "model.safetensors").write_bytes(bytes(damaged))
    # eval and decoding (resolve_drafter) and export take the older sound checkpoint, with a warning.
    from dflash.drafter.folders import resolve_drafter

    assert resolve_drafter(run)[0] == older
    assert any("damaged" in r.message and older.name in r.message for r in caplog.records)
    legacy = tmp_path / "legacy" / "checkpoints" / older.name
    shutil.copytree(older, legacy)
    (legacy / CHECKSUMS).unlink()
    with caplog.at_level(logging.DEBUG, logger="dflash.drafter.folders"):
        assert Checkpointer(tmp_path / "legacy").latest() == legacy
    assert any("before checkpoints carried checksums" in r.message for r in caplog.records)
    # (the CLI's logging setup replaces caplog's handler: every in-process CLI call comes after the log checks)
    code, out, err = dflash_main(capsys, "export", "--run", str(run), "--out", str(tmp_path / "export"))
    assert code == 0, err
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert f.metadata()["source"] == str(older)
    code, _, err = dflash_main(capsys, "export", "--run", str(newest), "--out", str(tmp_path / "export2"))
    assert code == 2 and "damaged" in err and "model.safetensors has xxh3" in err and err.count("\n") == 1
    # resume falls back to the older checkpoint and retakes the lost steps: the same bytes as before the damage.
    train(**opts(store, tiny_qwen3, run, resume=True, **kw))
    assert (newest / "model.safetensors").read_bytes() == good
    steps = [r["step"] for r in read_metrics(run) if r.get("split") == "train"]
    assert steps == list(range(1, len(steps) + 1))
    # A truncated trainer.pt (a partial copy) is damage too: resume takes the older one instead of stopping.
    state = newest / TRAINER_STATE
    state.write_bytes(state.read_bytes()[:100])
    assert ck.latest() == older
    train(**opts(store, tiny_qwen3, run, resume=True, **kw))
    assert (newest / "model.safetensors").read_bytes() == good and ck.damage(newest) is None
    # A checkpoint from before checksums keeps loading (with a debug line).
    (newest / CHECKSUMS).unlink()
    assert ck.latest() == newest


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs mounted in tmp_path (needs root and mount permission)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Fill the file system of `disk`, then give `leave` bytes back."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        block = b"\0" * 65536
        while True:
            try:
                os.write(fd, block)
            except OSError:
                break
        size = os.fstat(fd).st_size
        os.ftruncate(fd, max(0, size - leave))
    finally:
        os.close(fd)


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_older_checkpoints(store, tiny_qwen3, small_disk):
    run = small_disk / "run"
    # DFlash 1: its checkpoints fit the 3 MiB disk twice over (the mechanism is the drafter's, not the format's).
    kw = dict(epochs=100, save_every=2, keep=5, val_fraction=0.0, drafter="dflash")
    train(**opts(store, tiny_qwen3, run, max_steps=2, **kw))
    ck = Checkpointer(run)
    first = ck.latest()
    size = sum(p.stat().st_size for p in first.iterdir())
    fill(small_disk, leave=size // 4)  # room for the log lines, not for a checkpoint
    p = cli("train", *flags(opts(store, tiny_qwen3, run, max_steps=4, resume=True, **kw)), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=300)
    errors = [line for line in err.splitlines() if line.startswith("dflash: error:")]
    assert p.returncode == 2, err[-3000:]
    assert "Traceback" not in err and len(errors) == 1 and "disk is full" in errors[0], err[-3000:]
    assert "step-000004" in errors[0] and "--resume" in errors[0]
    assert [f for _, f in ck.folders()] == [first] and ck.damage(first) is None and not temp_folders(run)
    # Space freed, the same command resumes from the kept checkpoint.
    (small_disk / "filler").unlink()
    train(**opts(store, tiny_qwen3, run, max_steps=4, resume=True, **kw))
    assert ck.latest().name == "step-000004"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_train_with_one_line_and_the_lock_released(store, tiny_qwen3, tmp_path, sig):
    run = tmp_path / "run"
    p = cli("train", *flags(opts(store, tiny_qwen3, run, **LONG)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    wait_until(lambda: len(losses(run)) >= 2, p, "two steps")
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-3000:]
    assert err.rstrip().splitlines()[-1] == INTERRUPTED, err[-3000:]
    assert "Traceback" not in err and "Aborted" not in err
    assert not (run / RUN_LOCK).exists() and not temp_folders(run)


def test_a_signal_during_a_checkpoint_waits_for_it(tmp_path):
    # SIGTERM in the middle of a save is held until the folder is published, then stops the process.
    from dflash.runtime.process import Terminated, deferred_signals, install_signal_handlers

    install_signal_handlers()
    try:
        done = []
        with pytest.raises(Terminated):
            with deferred_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append("published")
        assert done == ["published"]
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_extract_with_one_line_and_every_claim_released(tiny_qwen3, tmp_path, sig):
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i in range(2000):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": "one two three four " * 3}]}) + "\n")
    out = tmp_path / "store"
    p = cli("extract", "--model", str(tiny_qwen3), "--data", str(rows), "--out", str(out), "--gpus", "cpu",
            "--shard-size", "4", "--batch-tokens", "1024", "--max-length", "256", "--min-loss-tokens", "4",
            "--dtype", "float32", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    commits = out / "commits"
    wait_until(lambda: commits.is_dir() and any(commits.iterdir()), p, "a first commit")
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-3000:]
    assert err.rstrip().splitlines()[-1] == INTERRUPTED, err[-3000:]
    assert "Traceback" not in err and "Aborted" not in err
    claims = out / "claims"
    assert not claims.is_dir() or not [c for c in claims.iterdir()], list(claims.iterdir())


@pytest.mark.slow
def test_kills_before_the_first_checkpoint_leave_no_steps_behind(store, tiny_qwen3, tmp_path):
    run = tmp_path / "run"
    for _ in range(2):
        p = cli("train", *flags(opts(store, tiny_qwen3, run, resume=True, **LONG)), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        wait_until(lambda: len(losses(run)) >= 1, p, "a first step")
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        assert len(losses(run)) >= 1 and not Checkpointer(run).folders()
    train(**opts(store, tiny_qwen3, run, resume=True, **{**LONG, "max_steps": 3, "save_every": 3}))
    assert [s for s, _ in losses(run)] == [1, 2, 3]


@pytest.mark.slow
def test_one_trainer_per_run_folder_and_a_dead_ones_lock_is_taken_over(store, tiny_qwen3, tmp_path, capsys):
    run = tmp_path / "run"
    first = cli("train", *flags(opts(store, tiny_qwen3, run, **LONG)), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(losses(run)) >= 1, first, "a first step")
        # The second trainer is the CLI in this process: another process of its own would only add its start-up.
        code, _, err = dflash_main(capsys, "train", *flags(opts(store, tiny_qwen3, run, resume=True, **LONG)))
        assert code == 2, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("dflash: error:")]
        assert len(errors) == 1 and f"pid {first.pid}" in errors[0] and str(run / RUN_LOCK) in errors[0]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert (run / RUN_LOCK).exists()  # a SIGKILL leaves the lock: its holder is dead, so it is taken over
    train(**opts(store, tiny_qwen3, run, resume=True, **{**LONG, "max_steps": 2, "save_every": 2}))
    assert not (run / RUN_LOCK).exists() and Checkpointer(run).latest().name == "step-000002"


def test_the_first_step_is_logged_at_once_and_logs_and_checkpoints_come_by_time_too(store, tiny_qwen3, tmp_path,
                                                                                      caplog):
    run = tmp_path / "slow"
    with caplog.at_level(logging.INFO):
        train(**opts(store, tiny_qwen3, run, epochs=100, max_steps=4, log_every=1000, save_every=1000))
    assert [s for s, _ in losses(run)] == [1]  # at once; the next by steps or by a minute would be later
    assert not [r for r in caplog.records if "sized for GPUs" in r.message]
    # A line and a checkpoint by time: tiny intervals make both due at every step.
    run = tmp_path / "timed"
    train(**opts(store, tiny_qwen3, run, epochs=100, max_steps=5, log_every=1000, save_every=1000, keep=10,
                 log_every_seconds=1e-6, save_every_minutes=1e-7))
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5]
    assert [s for s, _ in Checkpointer(run).folders()] == [2, 3, 4, 5]  # step 1 only measures the step time
    # Options sized for GPUs on a CPU get one warning line.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(**opts(store, tiny_qwen3, tmp_path / "big", max_steps=1, batch_tokens=8192))
    warned = [r for r in caplog.records if "sized for GPUs" in r.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and "--batch-tokens 8192" in warned[0].message


def test_default_split_and_eval_agree(store, tiny_qwen3, tmp_path, capsys):
    from dflash.train.plan import split_shards

    assert split_shards(6, None) == (list(range(6)), [])  # a tiny store trains on everything
    assert len(split_shards(20, None)[1]) == 1 and len(split_shards(100, None)[1]) == 2
    assert len(split_shards(10_000, None)[1]) == 8
    run = tmp_path / "run"
    kw = opts(store, tiny_qwen3, run, epochs=1)
    del kw["val_fraction"]
    train(**kw)
    assert json.loads((run / "config.json").read_text())["resolved"]["val_shards"] == []
    code, out, err = dflash_main(capsys, "eval", "--drafter", str(run), "--store", store, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["shards"] == list(range(6)) and "held out none" in result["split"]


def test_val_shards_hold_out_exactly_the_named_shards_and_eval_scores_them(store, tiny_qwen3, tmp_path, capsys):
    from dflash.config import TrainConfig
    from dflash.errors import ConfigError
    from dflash.train.plan import split_shards

    assert split_shards(6, None, (4, 1)) == ([0, 2, 3, 5], [1, 4])
    with pytest.raises(ConfigError, match="shards 0..5"):
        split_shards(6, None, (6,))
    with pytest.raises(ConfigError, match="leaving none to train on"):
        split_shards(2, None, (0, 1))
    with pytest.raises(ConfigError, match="pass one of them"):
        TrainConfig(store="s", target="t", out="o", val_shards=(1,), val_fraction=0.5)
    run = tmp_path / "run"
    kw = opts(store, tiny_qwen3, run, epochs=1)
    del kw["val_fraction"]
    code, _, err = dflash_main(capsys, "train", *flags(kw), "--val-shards", "2,5")
    assert code == 0, err
    assert json.loads((run / "config.json").read_text())["resolved"]["val_shards"] == [2, 5]
    code, out, err = dflash_main(capsys, "eval", "--drafter", str(run), "--store", store, "--json")
    assert code == 0, err
    assert json.loads(out)["shards"] == [2, 5]


def test_a_fresh_run_with_resume_is_quiet(store, tiny_qwen3, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        train(**opts(store, tiny_qwen3, tmp_path / "run", resume=True, max_steps=1))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.message for r in caplog.records]


@pytest.mark.parametrize("args", [["--epochs", "0"], ["--store", "/nonexistent/store"],
                                  ["--val-fraction", "half"]])
def test_a_bad_option_fails_before_torch_is_imported(tmp_path, args):
    base = {"--store": str(tmp_path), "--target": str(tmp_path), "--out": str(tmp_path / "run"), "--gpus": "cpu"}
    base.update(zip(args[::2], args[1::2]))
    argv = [x for kv in base.items() for x in kv]
    code = ("import sys\nfrom dflash.cli import main\ntry:\n    main(['train', *sys.argv[1:]])\nexcept SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 []", done.stderr[-3000:]
    assert done.stderr.startswith("dflash: error:") and done.stderr.count("\n") == 1, done.stderr


def test_a_step_or_an_eval_batch_that_runs_out_of_memory_is_one_line_naming_what_shrinks_it(
        store, tiny_qwen3, tmp_path, capsys, monkeypatch):
    import torch

    import dflash.train.objective

    def oom(*args, **kwargs):  # what a GPU too small for the batch raises (no GPU here)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.20 GiB")

    run = tmp_path / "run"
    train(**opts(store, tiny_qwen3, run, epochs=1))  # a run to evaluate, before the step breaks
    monkeypatch.setattr(dflash.train.objective, "drafter_loss", oom)
    code, _, err = dflash_main(capsys, "train", *flags(opts(store, tiny_qwen3, tmp_path / "run2", epochs=1)))
    lines = [ln for ln in err.splitlines() if ln.startswith("dflash: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "dflash train (rank 0) ran out of memory" in lines[0] and "--batch-tokens" in lines[0], lines[0]
    assert "--anchors" in lines[0] and "available" in lines[0], lines[0]
    monkeypatch.setattr(dflash.train.objective, "predict", oom)
    code, _, err = dflash_main(capsys, "eval", "--drafter", str(run), "--store", store)
    lines = [ln for ln in err.splitlines() if ln.startswith("dflash: error: ")]
    assert code == 2 and len(lines) == 1 and "dflash eval ran out of memory" in lines[0], err[-2000:]
    assert "--batch-tokens" in lines[0] and "Traceback" not in err, lines[0]
