"""One stage of `dflash run`: a `dflash` subprocess in its own process group and session, its log, and a stop that
signals the whole group, waits, and kills what it leaves behind."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["Stage", "STOP_TIMEOUT_S", "SWEEP_S"]

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0
SWEEP_S = 5.0  # how long what a stage left in its process group may take to end by itself (a resource tracker)


class Stage:
    """One child `dflash` command in its own process group, its output appended to RUN/logs/NAME.log."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self.proc: subprocess.Popen | None = None
        self.failures = 0  # deaths since the stage last made progress
        self.restart_at: float | None = None
        self.stop_asked = False
        self.log_start = 0

    def start(self, argv: list[str]) -> None:
        """Start `python -m dflash.cli ARGV` with its output appended to the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab", buffering=0) as f:
            self.log_start = f.tell()
            try:
                f.write(f"--- dflash run: starting {self.name}: dflash {' '.join(argv)}\n".encode())
            except OSError as e:  # the log's disk, not the store's: the stage drops what it cannot log and runs on
                log.warning("dflash run: %s: cannot write the %s stage's log (%s); the stage runs on and its log "
                            "lines are lost until that disk has room", self.log_path, self.name, e.strerror or e)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.stop_asked, self.restart_at = False, None

    @property
    def running(self) -> bool:
        """Return True while the child runs."""
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> int | None:
        """Return the child's exit code once it has ended (None while it runs or when none was started)."""
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """Send sig to the child's whole process group (its ranks and workers too)."""
        if self.running:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Stop the child (SIGTERM to its group, SIGKILL after timeout); return its exit code."""
        if self.proc is None:
            return None
        self.stop_asked = True
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()
        self.sweep()
        return self.proc.returncode

    def group_gone(self, timeout: float) -> bool:
        """Return True once no process of the child's group lives (its pid stays reserved while one does); False
        if one still does after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def sweep(self) -> None:
        """Once the child has ended, kill what it left in its process group (a worker, a rank) after SWEEP_S."""
        if self.proc is None or self.proc.poll() is None or self.group_gone(SWEEP_S):
            return
        log.warning("dflash run: %s left processes in its process group %d; killing them", self.name, self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.group_gone(SWEEP_S)

    def last_line(self) -> str:
        """Return the last non-empty line the child wrote (its error, for a deterministic failure)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""
