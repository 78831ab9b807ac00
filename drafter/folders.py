"""Which folder holds the drafter a user names, read without torch: an export, a checkpoint's step folder, or a run
folder (its newest step folder whose files match their checksums); and the run's record beside them.

    EXPORT/config.json + model.safetensors            a finished export (`dflash export`)
    RUN/config.json                                    the run record (`dflash train`: its options and what they resolved to)
    RUN/checkpoints/step-NNNNNN/                       model.safetensors + drafter_config.json (+ the trainer's state)
                               checksums.json          written last: bytes and xxh3 of every other file

train/checkpoint.py writes step folders; this module is how eval, export, decoding and the demo find them
(files.open_drafter loads what it finds).
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, InputError

__all__ = ["WEIGHTS", "DRAFTER_CONFIG", "EXPORT_CONFIG", "RUN_RECORD", "CHECKSUMS", "has_drafter_files", "is_export",
           "file_xxh3", "step_folders", "damage", "newest_sound", "find_checkpoint", "resolve_drafter",
           "read_run_record"]

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
DRAFTER_CONFIG = "drafter_config.json"
EXPORT_CONFIG = "config.json"
RUN_RECORD = "config.json"
CHECKSUMS = "checksums.json"
_STEP = re.compile(r"^step-(\d+)$")


def has_drafter_files(folder: str | os.PathLike) -> bool:
    """Return True if folder holds a drafter's weights and drafter_config.json (a checkpoint's drafter)."""
    folder = Path(folder)
    return (folder / WEIGHTS).is_file() and (folder / DRAFTER_CONFIG).is_file()


def is_export(folder: str | os.PathLike) -> bool:
    """Return True if folder is a finished export (config.json naming a DFlash drafter, beside the weights)."""
    folder = Path(folder)
    return (folder / EXPORT_CONFIG).is_file() and (folder / WEIGHTS).is_file()


def file_xxh3(path: Path) -> str:
    """Return the xxh3-64 hex digest of a file, read in 8 MiB pieces."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            h.update(piece)
    return h.hexdigest()


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Return (step, folder) of every step-NNNNNN folder under RUN/checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())


def damage(folder: Path, names: tuple[str, ...] | None = None) -> str | None:
    """Return what is wrong with the files of a step folder against its checksums (all, or those named), or None
    when they match; a folder from before checksums is taken as it is."""
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


def newest_sound(root: Path, complete: Callable[[Path], bool] = has_drafter_files,
                 names: tuple[str, ...] | None = (WEIGHTS, DRAFTER_CONFIG)) -> Path | None:
    """Return the newest step folder under root that is complete and whose files (all, or those named) match their
    checksums, warning about each newer damaged one; None if there is none."""
    newer = None
    for _, folder in reversed(step_folders(root)):
        why = damage(folder, names) if complete(folder) else "incomplete"
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


def find_checkpoint(path: str | os.PathLike) -> Path:
    """Return the folder holding a drafter's files: `path` itself, or a run's newest step folder with sound ones."""
    path = Path(path)
    if has_drafter_files(path):
        why = damage(path, (WEIGHTS, DRAFTER_CONFIG))
        if why is not None:
            raise InputError(f"{path}: the checkpoint is damaged ({why}); pass its run folder {path.parent.parent} "
                             "(its newest sound checkpoint) or another step folder")
        return path
    root = path / "checkpoints"
    folder = newest_sound(root)
    if folder is None:
        raise InputError(
            f"--run {path}: expected model.safetensors and drafter_config.json there or in {root}/step-NNNNNN/, "
            f"found {len(step_folders(root))} step folder(s) and none complete and sound; run `dflash train --out "
            f"{path}` (with --resume) first"
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


def read_run_record(run: str | os.PathLike) -> dict[str, Any] | None:
    """Return RUN/config.json, or None when the folder has none."""
    path = Path(run) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); it is written by `dflash train`, restore or remove it") from None
