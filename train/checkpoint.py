"""Checkpoints of a run: atomic step folders (model, optimizer, scheduler, RNGs, loader), pruning, resume checks.

    RUN/config.json                      the TrainConfig and the facts it resolved to (store, drafter, split, world)
    RUN/checkpoints/step-000100/         model.safetensors + drafter_config.json (what `dflash export` reads)
                                         trainer.pt: optimizer, scheduler, step, loader state, every rank's RNGs
A step folder is written under a temporary name and renamed into place once every file is fsynced, so a folder
named step-NNNNNN is always complete; a killed save leaves only a `.step-*.tmp*` folder that the next save removes.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import write_atomic
from ..errors import ConfigError, ManifestMismatch

__all__ = [
    "RUN_RECORD",
    "TRAINER_STATE",
    "step_dir",
    "latest_checkpoint",
    "save_checkpoint",
    "load_trainer_state",
    "prune",
    "rng_state",
    "set_rng_state",
    "write_run_record",
    "read_run_record",
    "check_resume",
]

log = logging.getLogger(__name__)

RUN_RECORD = "config.json"
TRAINER_STATE = "trainer.pt"
# TrainConfig fields that may change between a run and its resume; every other change is refused by name.
RESUMABLE_CHANGES = frozenset(
    {"resume", "epochs", "max_steps", "save_every", "keep", "log_every", "tensorboard", "skip_corrupt",
     "prefetch_shards", "gpus", "follow", "out", "store", "target"}
)


def step_dir(run: str | os.PathLike, step: int) -> Path:
    """Return RUN/checkpoints/step-NNNNNN (zero-padded so listings sort)."""
    return Path(run) / "checkpoints" / f"step-{step:06d}"


def latest_checkpoint(run: str | os.PathLike) -> Path | None:
    """Return the newest complete step folder of a run (one holding trainer.pt and the model), or None."""
    from .export import step_folders

    for _, folder in reversed(step_folders(run)):
        if (folder / TRAINER_STATE).is_file() and (folder / "model.safetensors").is_file():
            return folder
        log.warning("%s is incomplete; ignoring it", folder)
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(run: str | os.PathLike, step: int, model: Any, state: dict[str, Any]) -> Path:
    """Write step-NNNNNN atomically (temp folder, fsync, rename) with the model files and trainer.pt; return it."""
    import torch

    from .export import save_checkpoint_files

    final = step_dir(run, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint_files(model, tmp)
    buf = io.BytesIO()
    torch.save(state, buf)
    _write_file(tmp / TRAINER_STATE, buf.getvalue())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a resume: the new one replaces it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def load_trainer_state(folder: Path) -> dict[str, Any]:
    """Return trainer.pt of a step folder."""
    import torch

    try:
        return torch.load(folder / TRAINER_STATE, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: the message matters, not its type
        raise ConfigError(f"{folder / TRAINER_STATE}: cannot read the trainer state ({e}); delete {folder} "
                          "and rerun with --resume to take the previous checkpoint") from None


def prune(run: str | os.PathLike, keep: int) -> list[Path]:
    """Return the folders removed: all but the newest `keep` step folders and any leftover temp folders."""
    from .export import step_folders

    removed = []
    steps = step_folders(run)
    for _, folder in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    parent = Path(run) / "checkpoints"
    for p in parent.glob(".step-*.tmp*") if parent.is_dir() else ():
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def rng_state() -> dict[str, Any]:
    """Return the states of Python's, NumPy's and torch's (CPU and current CUDA device) generators."""
    import torch

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators saved by rng_state."""
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_run_record(run: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write RUN/config.json atomically: {"config": TrainConfig fields, "resolved": facts of the run}."""
    write_atomic(Path(run) / RUN_RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_run_record(run: str | os.PathLike) -> dict[str, Any] | None:
    """Return RUN/config.json, or None when the folder has none."""
    path = Path(run) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); it is written by `dflash train`, restore or remove it") from None


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def check_resume(run: str | os.PathLike, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise ManifestMismatch naming every field of the store, model shape, world or options that changed."""
    a, b = _flat(saved), _flat(now)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key.startswith("config.") and key.split(".", 1)[1] in RESUMABLE_CHANGES:
            continue
        if key.startswith("resolved.store.path") or key.startswith("resolved.val_shards_note"):
            continue
        if json.dumps(a.get(key), sort_keys=True) != json.dumps(b.get(key), sort_keys=True):
            diffs.append(f"{key}: run has {json.dumps(a.get(key))}, now {json.dumps(b.get(key))}")
    if diffs:
        shown = "; ".join(diffs[:8]) + ("; ..." if len(diffs) > 8 else "")
        raise ManifestMismatch(
            f"{Path(run) / RUN_RECORD}: --resume refused, the run was made with other settings ({shown}); "
            "resume with the run's settings, or train into a new --out"
        )
