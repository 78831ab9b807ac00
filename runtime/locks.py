"""A lock file naming its holder (host, pid, process start time): one process at a time owns a folder on a local or
shared file system, and a lock whose holder died on this host is taken over.

The idea is the store's shard claims' (storage/claims.py), for plain paths: a holder is live while its pid runs on
this host with the recorded start time (a reused pid is another process); a holder on another host is taken as live,
since its processes cannot be seen from here.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["HOST", "start_time_of", "pid_alive", "holder_is_live", "FileLock"]

log = logging.getLogger(__name__)

HOST = socket.gethostname()


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields resume after the last ')'.
    return stat.rsplit(")", 1)[-1].split()


def start_time_of(pid: int) -> int | None:
    """Return a local process's start time (clock ticks since boot) from /proc, or None if unknown or gone."""
    try:
        return int((_stat_fields(pid) or [])[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Return True if a local process runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    fields = _stat_fields(pid)
    return not (fields and fields[0] in ("Z", "X"))


def holder_is_live(holder: dict[str, Any] | None) -> bool:
    """Return True if the process a lock names may still run: on another host, or alive here as the same process."""
    if not holder or "pid" not in holder or "host" not in holder:
        return False
    if holder["host"] != HOST:
        # Another machine's processes cannot be seen from here: only an operator removes its lock.
        return True
    pid = int(holder["pid"])
    if not pid_alive(pid):
        return False
    started = holder.get("start_time")
    # A reused pid is a different process: its start time differs from the one recorded.
    return started is None or start_time_of(pid) == started


def _create(path: Path, record: dict[str, Any]) -> bool:
    """Create path holding record (exclusively, fsynced); return False if it already exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(record, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _read(path: Path) -> dict[str, Any] | None:
    """Return the record of a lock file, None if there is none, {} if it is unreadable (a torn write: stale)."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


class FileLock:
    """An exclusively created lock file; `acquire()` takes it (or a stale one), `release()` removes it if ours."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        pid = os.getpid()
        self.record = {"host": HOST, "pid": pid, "start_time": start_time_of(pid), "token": uuid.uuid4().hex,
                       "time": time.time()}

    def acquire(self) -> dict[str, Any] | None:
        """Take the lock; return None when taken, else the live holder's record."""
        holder: dict[str, Any] = {}
        for _ in range(5):
            if _create(self.path, self.record):
                return None
            holder = _read(self.path)
            if holder is None:
                continue  # released between our attempt and our look
            if holder_is_live(holder):
                return holder
            # Of several processes that see the same stale lock, only the one creating this marker removes it, and
            # it re-reads the lock under the marker so it never removes a lock just made by someone else.
            marker = self.path.with_name(f"{self.path.name}.takeover-{holder.get('token')}")
            if _create(marker, self.record):
                try:
                    if (_read(self.path) or {}).get("token") == holder.get("token"):
                        log.info("taking over the stale lock %s of a dead process (%s)", self.path, holder)
                        self.path.unlink(missing_ok=True)
                finally:
                    marker.unlink(missing_ok=True)
            elif not holder_is_live(_read(marker)):
                marker.unlink(missing_ok=True)  # its maker died holding it
        return holder

    def release(self) -> None:
        """Remove the lock file, unless another process's lock has replaced it."""
        if (_read(self.path) or {}).get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)
