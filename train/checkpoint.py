"""The one owner of a run's checkpoints: save, load, latest, prune, and which folder holds the drafter a user names.

    RUN/config.json                      the TrainConfig and the facts it resolved to (store, drafter, split, world)
    RUN/train.lock                       the live trainer of this run (host, pid): one trainer per run folder
    RUN/checkpoints/step-000100/         model.safetensors + drafter_config.json (the drafter's files)
                                         trainer.pt: every stateful part's state_dict (optimizer, scheduler,
                                         loader), step, schedule length, every rank's RNGs, the config
                                         checksums.json, written last: bytes and xxh3 of every other file
A step folder is written under a temporary name and published whole (every file fsynced, then renamed), so a folder
named step-NNNNNN is always complete; a killed save leaves only a `.step-*.tmp` folder that the next save removes.
A step folder can be resumed from when it holds trainer.pt beside the drafter's files; it holds a drafter (for
export, eval and decoding) when it has the drafter's files. Files that no longer match their checksums (a flipped
bit, a truncated copy) make the folder damaged: resume, export, eval and decoding of the run then take the newest
sound one, with a warning. Folders written before checksums existed load unchecked.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

from ..atomic import publish_dir, temp_dir, write_atomic, write_durable
from ..errors import ConfigError, DflashError, InputError, ManifestMismatch
from ..nested import nested_diff

__all__ = [
    "RUN_RECORD",
    "RUN_LOCK",
    "TRAINER_STATE",
    "CHECKSUMS",
    "Stateful",
    "Snapshot",
    "host_copy",
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
RUN_LOCK = "train.lock"
TRAINER_STATE = "trainer.pt"
CHECKSUMS = "checksums.json"
_STEP = re.compile(r"^step-(\d+)$")
# TrainConfig fields that may change between a run and its resume; every other change is refused by name.
# (val_fraction and val_shards may: the split they resolve to, resolved.train_shards/val_shards, is compared instead.)
RESUMABLE_CHANGES = frozenset(
    {"resume", "epochs", "max_steps", "save_every", "save_every_minutes", "keep", "log_every", "log_every_seconds",
     "tensorboard", "skip_corrupt", "prefetch_shards", "gpus", "follow", "out", "store", "target", "val_fraction",
     "val_shards",
     "grad_accum", "compile_layers"}
)
# Resolved facts that may change with them: another GPU count keeps the batches while the slots stay the same
# (grad_accum = slots / world, see resume_grad_accum); resolved.num_slots itself is still checked.
RESUMABLE_RESOLVED = ("resolved.store.path", "resolved.val_shards_note", "resolved.world_size")


def has_drafter_files(folder: Path) -> bool:
    """Return True if folder holds a drafter's files (drafter/files.py, imported only now: it imports torch)."""
    from ..drafter.files import has_drafter_files as has

    return has(folder)


def _drafter_file_names() -> tuple[str, str]:
    from ..drafter.files import DRAFTER_CONFIG, WEIGHTS

    return WEIGHTS, DRAFTER_CONFIG


def file_xxh3(path: Path) -> str:
    """Return the xxh3-64 hex digest of a file, read in 8 MiB pieces."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            h.update(piece)
    return h.hexdigest()


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
        if not self.root.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())

    def lock(self) -> Any:
        """Return the held RUN/train.lock (a stale one of a dead process is taken over); ConfigError naming the
        live holder when another trainer has this run folder."""
        from ..locks import FileLock

        self.run.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.run / RUN_LOCK)
        holder = lock.acquire()
        if holder is not None:
            raise ConfigError(
                f"--out {self.run}: another `dflash train` (pid {holder.get('pid')} on host {holder.get('host')}) is "
                f"training this run ({self.run / RUN_LOCK}); wait for it or stop it, or train into another --out"
            )
        return lock

    def damage(self, folder: Path, names: tuple[str, ...] | None = None) -> str | None:
        """Return what is wrong with the files of a step folder against its checksums (all, or those named), or
        None when they match; a folder from before checksums is taken as it is."""
        path = folder / CHECKSUMS
        if not path.is_file():
            log.debug("%s has no %s (written before checkpoints carried checksums); loading it unchecked", folder,
                      CHECKSUMS)
            return None
        try:
            files = json.loads(path.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{CHECKSUMS} is unreadable ({e})"
        for name in names if names is not None else tuple(files):
            want, file = files.get(name), folder / name
            if want is None:
                return f"{name} is not in {CHECKSUMS}"
            if not file.is_file():
                return f"{name} is missing"
            size = file.stat().st_size
            if size != want["bytes"]:
                return f"{name} has {size} bytes, its checksum record says {want['bytes']}"
            got = file_xxh3(file)
            if got != want["xxh3"]:
                return f"{name} has xxh3 {got}, its checksum record says {want['xxh3']}"
        return None

    def latest(self) -> Path | None:
        """Return the newest sound step folder a run can resume from (drafter files and trainer.pt), or None."""
        return self._newest(lambda f: (f / TRAINER_STATE).is_file() and has_drafter_files(f), None)

    def newest_drafter(self) -> Path | None:
        """Return the newest step folder with sound drafter files (what export, eval and decoding read), or None."""
        return self._newest(has_drafter_files, _drafter_file_names())

    def _newest(self, complete: Any, names: tuple[str, ...] | None) -> Path | None:
        newer = None
        for _, folder in reversed(self.folders()):
            why = self.damage(folder, names) if complete(folder) else "incomplete"
            if why is None:
                if newer is not None:
                    log.warning("%s is damaged (%s); falling back to %s, the newest sound checkpoint", newer[0],
                                newer[1], folder.name)
                return folder
            if newer is None:
                newer = (folder, why)
            else:
                log.warning("%s is damaged (%s); ignoring it", folder, why)
        if newer is not None:
            log.warning("%s is damaged (%s) and no older checkpoint is sound", newer[0], newer[1])
        return None

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

    def write(self, snap: Snapshot) -> Path:
        """Publish a snapshot as step-NNNNNN; return the folder.

        The same step saved again (after a resume) replaces the old folder whole. On the main thread SIGINT and
        SIGTERM wait until the folder is published (or abandoned on an error); a write on the checkpointer's thread
        is waited for by the trainer before it exits. A full disk is a DflashError; older folders stay intact.
        """
        import torch

        from ..drafter.files import write_drafter_files
        from ..runtime import deferred_signals

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


def find_checkpoint(path: str | os.PathLike) -> Path:
    """Return the folder holding a drafter's files: `path` itself, or a run's newest step folder with sound ones."""
    path = Path(path)
    if has_drafter_files(path):
        why = Checkpointer(path.parent.parent).damage(path, _drafter_file_names())
        if why is not None:
            raise InputError(f"{path}: the checkpoint is damaged ({why}); pass its run folder {path.parent.parent} "
                             "(its newest sound checkpoint) or another step folder")
        return path
    ckpt = Checkpointer(path)
    folder = ckpt.newest_drafter()
    if folder is None:
        raise InputError(
            f"--run {path}: expected model.safetensors and drafter_config.json there or in {ckpt.root}/step-NNNNNN/, "
            f"found {len(ckpt.folders())} step folder(s) and none complete and sound; run `dflash train --out {path}` "
            "(with --resume) first"
        )
    return folder


def resolve_drafter(path: str | os.PathLike) -> tuple[Path, dict[str, Any] | None]:
    """Return (the folder to load the drafter from, the run record if it came from a run) for any folder a user
    passes as a drafter: an export, a checkpoint's step folder, or a run folder (its newest checkpoint)."""
    from ..drafter.files import is_export

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
    """Raise ManifestMismatch naming every field of the store, model shape, world or options that changed.

    An option the saved record lacks was added after the run was made, which then trained as the option did before
    it existed (config.LEGACY_DEFAULTS where today's default differs, else the default): only another value is a
    change.
    """
    import dataclasses

    from ..config import LEGACY_DEFAULTS, TrainConfig

    config = saved.get("config")
    if isinstance(config, dict):
        added = {f.name: LEGACY_DEFAULTS.get(f.name, f.default) for f in dataclasses.fields(TrainConfig)
                 if f.name not in config and f.default is not dataclasses.MISSING}
        saved = {**saved, "config": {**json.loads(json.dumps(added)), **config}}

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
