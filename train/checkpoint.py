"""The one writer of a run's checkpoints: save (in the background), load, latest, prune; the RNG states they hold.

    RUN/checkpoints/step-000100/         model.safetensors + drafter_config.json (the drafter's files)
                                         trainer.pt: every stateful part's state_dict (optimizer, scheduler,
                                         loader), step, schedule length, every rank's RNGs, the config
                                         checksums.json, written last: bytes and xxh3 of every other file
A step folder is written under a temporary name and published whole (every file fsynced, then renamed), so a folder
named step-NNNNNN is always complete; a killed save leaves only a `.step-*.tmp` folder that the next save removes.
A step folder can be resumed from when it holds trainer.pt beside the drafter's files; it holds a drafter (for
export, eval and decoding, found by drafter/folders.py) when it has the drafter's files. Files that no longer match
their checksums (a flipped bit, a truncated copy) make the folder damaged: resume, export, eval and decoding of the
run then take the newest sound one, with a warning. Folders written before checksums existed load unchecked.
The run folder around them (its record, its lock, resuming it) is run_folder.py's.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

from ..runtime.atomic import publish_dir, temp_dir, write_durable
from ..drafter.folders import CHECKSUMS, damage, file_xxh3, has_drafter_files, newest_sound, step_folders
from ..errors import ConfigError, DflashError

__all__ = ["TRAINER_STATE", "Stateful", "Snapshot", "host_copy", "Checkpointer", "read_trainer_state", "rng_state",
           "set_rng_state"]

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer.pt"

class Stateful(Protocol):
    """A part of the training state: the optimizer, the scheduler, the loader."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class Snapshot:
    """Host copies of one checkpoint's content: the step, the drafter's weights and config, trainer.pt's dict."""

    step: int
    weights: dict[str, Any]
    drafter_config: dict[str, Any]
    state: dict[str, Any]


def host_copy(obj: Any) -> Any:
    """Return obj with every tensor in it (nested dicts, lists, tuples) copied to host memory."""
    if hasattr(obj, "detach") and hasattr(obj, "to"):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class Checkpointer:
    """Save, find, load and prune the step folders of one run folder."""

    def __init__(self, run: str | os.PathLike, keep: int = 3) -> None:
        self.run = Path(run)
        self.root = self.run / "checkpoints"
        self.keep = keep
        self._writer: Any = None  # the background write's thread (save_in_background)
        self._pending: Any = None  # its write in flight

    def step_dir(self, step: int) -> Path:
        """Return RUN/checkpoints/step-NNNNNN (zero-padded so listings sort)."""
        return self.root / f"step-{step:06d}"

    def folders(self) -> list[tuple[int, Path]]:
        """Return (step, folder) of every step-NNNNNN folder, oldest first."""
        return step_folders(self.root)

    def damage(self, folder: Path, names: tuple[str, ...] | None = None) -> str | None:
        """Return what is wrong with a step folder's files against its checksums (drafter/folders.py), or None."""
        return damage(folder, names)

    def latest(self) -> Path | None:
        """Return the newest sound step folder a run can resume from (drafter files and trainer.pt), or None."""
        return newest_sound(self.root, lambda f: (f / TRAINER_STATE).is_file() and has_drafter_files(f), None)

    def snapshot(self, step: int, model: Any, parts: Mapping[str, Stateful], extra: Mapping[str, Any]) -> Snapshot:
        """Return host copies of everything step-NNNNNN will hold: what a checkpoint costs the training loop."""
        from ..drafter.files import drafter_state

        weights, config = drafter_state(model)
        state = host_copy({name: part.state_dict() for name, part in parts.items()})
        state.update(host_copy(dict(extra)))
        return Snapshot(step, weights, config, state)

    def save(self, step: int, model: Any, parts: Mapping[str, Stateful], extra: Mapping[str, Any]) -> Path:
        """Publish step-NNNNNN whole: the drafter's files and trainer.pt ({part: state_dict} plus extra); return it."""
        return self.write(self.snapshot(step, model, parts, extra))

    def save_in_background(self, snap: Snapshot, on_saved: Any = None) -> None:
        """Write (then prune) a snapshot on the checkpointer's thread, then call on_saved(step) there; the previous
        write is finished first, so folders appear in order and at most one snapshot waits in memory. Its errors
        surface at `wait`."""
        from concurrent.futures import ThreadPoolExecutor

        self.wait()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="dflash-checkpoint")
        self._pending = self._writer.submit(self._write_and_prune, snap, on_saved)

    def _write_and_prune(self, snap: Snapshot, on_saved: Any) -> Path:
        folder = self.write(snap)
        self.prune()
        log.info("saved %s", folder)
        if on_saved is not None:
            on_saved(snap.step)
        return folder

    def wait(self) -> Path | None:
        """Return the folder of the background write in flight once it is published (None if there was none);
        re-raise its error (a full disk, say): the previous checkpoint is then still the newest complete one."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def finish(self) -> None:
        """Let a background write finish while an interrupt or an error unwinds the run: it is published whole, or
        its temp folder is removed and the previous checkpoint stays the newest (logged, not raised)."""
        try:
            self.wait()
        except Exception as e:  # the run's own error is the one being reported
            log.error("the checkpoint being written when the run stopped was abandoned: %s", e)

    def write(self, snap: Snapshot) -> Path:
        """Publish a snapshot as step-NNNNNN; return the folder.

        The same step saved again (after a resume) replaces the old folder whole. On the main thread SIGINT and
        SIGTERM wait until the folder is published (or abandoned on an error); a write on the checkpointer's thread
        is waited for by the trainer before it exits. A full disk is a DflashError; older folders stay intact.
        """
        import torch

        from ..drafter.files import write_drafter_files
        from ..runtime.process import deferred_signals

        final = self.step_dir(snap.step)
        tmp = temp_dir(final)
        try:
            with deferred_signals():
                self.root.mkdir(parents=True, exist_ok=True)
                write_drafter_files(snap.weights, snap.drafter_config, tmp)
                buf = io.BytesIO()
                torch.save(snap.state, buf)
                write_durable(tmp / TRAINER_STATE, buf.getbuffer())
                sums = {p.name: {"bytes": p.stat().st_size, "xxh3": file_xxh3(p)} for p in sorted(tmp.iterdir())}
                write_durable(tmp / CHECKSUMS, json.dumps({"version": 1, "files": sums}, indent=2) + "\n")
                publish_dir(tmp, final, replace=True)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise DflashError(
                f"{final}: cannot write the checkpoint, the disk is full ({e.strerror}); the older checkpoints are "
                f"intact; free space on {self.root} (or pass a lower --keep) and rerun the same command with --resume"
            ) from None
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
