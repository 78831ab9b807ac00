"""Durable writes on a local file system, in one place: a file whole or not at all, a folder published whole,
lines appended durably, and a torn last line repaired.

Every write here ends with fsync of the data and of the folder that names it, so what a crash leaves is the old
state or the new one, never a mix. Temporary names start with a dot and carry the pid, so concurrent writers never
share one and a listing of finished things can skip them.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Iterable

__all__ = [
    "write_atomic",
    "write_durable",
    "fsync_dir",
    "fsync_tree",
    "temp_dir",
    "publish_dir",
    "append_lines",
    "repair_torn_tail",
]


def fsync_dir(path: str | os.PathLike) -> None:
    """Fsync a folder so the names created or renamed in it survive a power loss.

    Some file systems (certain network mounts) refuse fsync on folders; that is not an error.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike, data: bytes | str | memoryview) -> None:
    """Write `data` to `path` (created or truncated) and fsync it; not atomic: for files inside a temp folder."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | str | memoryview) -> None:
    """Write all of data (str as UTF-8) to fd, however many writes it takes."""
    view = memoryview(data.encode("utf-8") if isinstance(data, str) else data).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def write_atomic(path: str | os.PathLike, data: bytes | str, *, suffix: str = ".tmp", tag: str | None = None) -> None:
    """Replace `path` with `data` (str is written as UTF-8); a crash leaves the old file or the new one, never half.

    The temp file sits beside `path` (`.NAME.TAG.RANDOM` + suffix, TAG the pid unless given) and is removed if the
    write fails. Where `path` is a symbolic link, the file it names is replaced and the link kept; where it is a
    device, a pipe or a socket (`--profile /dev/stdout`), the data is written to it, which is never replaced.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        # A device, a pipe or a socket (/dev/null, /dev/stdout, a FIFO): written to, never replaced by a file,
        # which as root would have put a regular file where /dev/null was.
        _write_through(path, data)
        return
    if path.is_symlink():
        path = Path(os.path.realpath(path))  # the file a link names is replaced, the link kept
    tmp = path.with_name(f".{path.name}.{tag or os.getpid()}.{uuid.uuid4().hex[:8]}{suffix}")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _write_through(path: Path, data: bytes | str) -> None:
    """Write data to an existing device, pipe or socket as it is (no temp file: there is nothing to replace)."""
    fd = os.open(os.fspath(path), os.O_WRONLY)
    try:
        _write_all(fd, data)
        try:
            os.fsync(fd)
        except OSError as e:  # a device or pipe without a notion of durability
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EROFS):
                raise
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Fsync every file and folder below root (root included), deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def temp_dir(final: str | os.PathLike) -> Path:
    """Return a fresh private temp folder name beside `final` (`.NAME.PID.RANDOM.tmp`), not yet created."""
    final = Path(final)
    return final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike, *, replace: bool = False) -> bool:
    """Make the finished folder `tmp` appear as `final`, whole: fsync its tree, rename, fsync the parent.

    Return True if `tmp` was published. If `final` exists: with replace, the old folder is removed first (a reader
    in between sees neither); without, the rename fails atomically (another writer published first), `tmp` is
    removed and False is returned.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if replace and final.exists():
        shutil.rmtree(final)
    try:
        os.rename(tmp, final)
    except OSError as e:
        if replace or not final.exists() or e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    fsync_dir(final.parent)
    return True


def append_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Append lines (each given without its newline) and fsync: on disk whole, or ending in a torn last line."""
    payload = "".join(line + "\n" for line in lines).encode("utf-8")
    if not payload:
        return
    with open(path, "ab") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def repair_torn_tail(path: str | os.PathLike) -> int:
    """Cut a last line that has no newline (a write interrupted by a kill) off a line file; return bytes dropped.

    Every line is written with its newline, so a last line without one is torn even when it happens to parse.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    end = data.rfind(b"\n") + 1
    if end == len(data):
        return 0
    with open(path, "r+b") as f:
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())
    return len(data) - end
