"""The one owner of a run's checkpoints: save, load, latest, prune, and which folder holds the drafter a user names.

    RUN/config.json                      the TrainConfig and the facts it resolved to (store, drafter, split, world)
    RUN/checkpoints/step-000100/         model.safetensors + drafter_config.json (the drafter's files)
                                         trainer.pt: every stateful part's state_dict (optimizer, scheduler,
                                         loader), step, schedule length, every rank's RNGs, the config
A step folder is written under a temporary name and published whole (every file fsynced, then renamed), so a folder
named step-NNNNNN is always complete; a killed save leaves only a `.step-*.tmp` folder that the next save removes.
A step folder can be resumed from when it holds trainer.pt beside the drafter's files; it holds a drafter (for
export, eval and decoding) when it has the drafter's files.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

from ..atomic import publish_dir, temp_dir, write_atomic, write_durable
from ..drafter.files import has_drafter_files, is_export, save_drafter_files
from ..errors import ConfigError, InputError, ManifestMismatch
from ..nested import nested_diff

__all__ = [
    "RUN_RECORD",
    "TRAINER_STATE",
    "Stateful",
    "Checkpointer",
    "find_checkpoint",
    "resolve_drafter",
    "open_drafter",
    "rng_state",
    "set_rng_state",
    "write_run_record",
    "read_run_record",
    "check_resume",
]

log = logging.getLogger(__name__)

RUN_RECORD = "config.json"
TRAINER_STATE = "trainer.pt"
_STEP = re.compile(r"^step-(\d+)$")
# TrainConfig fields that may change between a run and its resume; every other change is refused by name.
RESUMABLE_CHANGES = frozenset(
    {"resume", "epochs", "max_steps", "save_every", "keep", "log_every", "tensorboard", "skip_corrupt",
     "prefetch_shards", "gpus", "follow", "out", "store", "target", "grad_accum"}
)
# Resolved facts that may change with them: another GPU count keeps the batches while the slots stay the same
# (grad_accum = slots / world, see resume_grad_accum); resolved.num_slots itself is still checked.
RESUMABLE_RESOLVED = ("resolved.store.path", "resolved.val_shards_note", "resolved.world_size")


class Stateful(Protocol):
    """A part of the training state: the optimizer, the scheduler, the loader."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Checkpointer:
    """Save, find, load and prune the step folders of one run folder."""

    def __init__(self, run: str | os.PathLike, keep: int = 3) -> None:
        self.run = Path(run)
        self.root = self.run / "checkpoints"
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        """Return RUN/checkpoints/step-NNNNNN (zero-padded so listings sort)."""
        return self.root / f"step-{step:06d}"

    def folders(self) -> list[tuple[int, Path]]:
        """Return (step, folder) of every step-NNNNNN folder, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())

    def latest(self) -> Path | None:
        """Return the newest step folder a run can resume from (drafter files and trainer.pt), or None."""
        for _, folder in reversed(self.folders()):
            if (folder / TRAINER_STATE).is_file() and has_drafter_files(folder):
                return folder
            log.warning("%s is incomplete; ignoring it", folder)
        return None

    def newest_drafter(self) -> Path | None:
        """Return the newest step folder holding the drafter's files (what export, eval and decoding read), or None."""
        for _, folder in reversed(self.folders()):
            if has_drafter_files(folder):
                return folder
            log.warning("%s is incomplete (no drafter files); trying an older one", folder)
        return None

    def save(self, step: int, model: Any, parts: Mapping[str, Stateful], extra: Mapping[str, Any]) -> Path:
        """Publish step-NNNNNN whole: the drafter's files and trainer.pt ({part: state_dict} plus extra); return it.

        The same step saved again (after a resume) replaces the old folder whole.
        """
        import torch

        final = self.step_dir(step)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(final)
        try:
            save_drafter_files(model, tmp)
            state = {name: part.state_dict() for name, part in parts.items()}
            state.update(extra)
            buf = io.BytesIO()
            torch.save(state, buf)
            write_durable(tmp / TRAINER_STATE, buf.getbuffer())
            publish_dir(tmp, final, replace=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def load(self, folder: Path, model: Any, parts: Mapping[str, Stateful]) -> dict[str, Any]:
        """Load the drafter's weights into model and each part's state; return the whole trainer state."""
        from safetensors.torch import load_file

        state = read_trainer_state(folder)
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        for name, part in parts.items():
            try:
                part.load_state_dict(state[name])
            except ConfigError as e:  # a part that cannot honour the state says why; the folder says where
                raise ConfigError(f"{folder}: {e}") from None
        return state

    def prune(self) -> list[Path]:
        """Return the folders removed: all but the newest `keep` step folders and any leftover temp folders."""
        removed = []
        steps = self.folders()
        for _, folder in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        for p in self.root.glob(".step-*.tmp*") if self.root.is_dir() else ():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        return removed


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """Return trainer.pt of a step folder."""
    import torch

    try:
        return torch.load(folder / TRAINER_STATE, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: the message matters, not its type
        raise ConfigError(f"{folder / TRAINER_STATE}: cannot read the trainer state ({e}); delete {folder} "
                          "and rerun with --resume to take the previous checkpoint") from None


def find_checkpoint(path: str | os.PathLike) -> Path:
    """Return the folder holding a drafter's files: `path` itself, or a run's newest step folder that has them."""
    path = Path(path)
    if has_drafter_files(path):
        return path
    ckpt = Checkpointer(path)
    folder = ckpt.newest_drafter()
    if folder is None:
        raise InputError(
            f"--run {path}: expected model.safetensors and drafter_config.json there or in {ckpt.root}/step-NNNNNN/, "
            f"found {len(ckpt.folders())} step folder(s) and none complete; run `dflash train --out {path}` "
            "(with --resume) first"
        )
    return folder


def resolve_drafter(path: str | os.PathLike) -> tuple[Path, dict[str, Any] | None]:
    """Return (the folder to load the drafter from, the run record if it came from a run) for any folder a user
    passes as a drafter: an export, a checkpoint's step folder, or a run folder (its newest checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"--drafter {path}: expected an export folder (`dflash export`), a run folder (`dflash train "
                         "--out`) or one of its checkpoints, found no folder; run `dflash export --run RUN --out DIR`")
    if is_export(path) and not has_drafter_files(path):
        return path, None
    folder = find_checkpoint(path)
    for run in (path, folder.parent.parent):
        record = read_run_record(run) if (run / "checkpoints").is_dir() else None
        if record is not None:
            return folder, record
    return folder, None


def open_drafter(path: str | os.PathLike, *, device: Any = "cpu", dtype: Any = None) -> Any:
    """Return the drafter (eval mode) of any folder `resolve_drafter` takes: an export, a checkpoint, a run."""
    from ..drafter.files import load_drafter

    folder, _ = resolve_drafter(path)
    return load_drafter(folder, device=device, dtype=dtype).eval()


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


def check_resume(run: str | os.PathLike, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise ManifestMismatch naming every field of the store, model shape, world or options that changed."""
    def resumable(key: str) -> bool:
        return ((key.startswith("config.") and key.split(".", 1)[1] in RESUMABLE_CHANGES)
                or key.startswith(RESUMABLE_RESOLVED))

    diffs = [f"{key}: run has {json.dumps(x)}, now {json.dumps(y)}"
             for key, x, y in nested_diff(saved, now, ignore=resumable)]
    if diffs:
        shown = "; ".join(diffs[:8]) + ("; ..." if len(diffs) > 8 else "")
        raise ManifestMismatch(
            f"{Path(run) / RUN_RECORD}: --resume refused, the run was made with other settings ({shown}); "
            "resume with the run's settings, or train into a new --out"
        )
