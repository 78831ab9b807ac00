"""How dflash runs as processes: one log format, one reading of the launcher's environment, one spawn launcher with
one error protocol, one way a signal stops work (SIGINT and SIGTERM unwind like Ctrl-C, so cleanup runs), and one
progress display (a bar with rate and ETA on a terminal, periodic lines in a log)."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import errors as errors_mod
from ..errors import DflashError

__all__ = ["LOG_FORMAT", "setup_logging", "LossyStream", "guard_std_streams", "lost_output", "UNUSED_PACKAGES",
           "skip_unused_packages", "Ranks", "ranks_from_env", "Terminated", "install_signal_handlers",
           "interrupt_exit_code", "deferred_signals", "launch", "Progress", "format_eta", "window_rate",
           "prune_window", "RATE_WINDOW_S"]

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s {rank}%(name)s: %(message)s"
LOG_DATE = "%H:%M:%S"

# report(event): how a process tells the parent (or the in-process caller) about progress.
Report = Callable[[dict[str, Any]], None]


# Packages that a library dflash imports pulls in when it is imported, for features dflash never calls. transformers
# 5.17 imports scikit-learn with its generation module, for assisted generation's confidence threshold alone; on the
# lent H200, marking it absent took 1.6-3.9 s off the import set of every command that loads a model (bench/RESULTS.md,
# issue 22, fourth pass).
UNUSED_PACKAGES = ("sklearn",)


def skip_unused_packages(names: Sequence[str] = UNUSED_PACKAGES) -> list[str]:
    """Return the packages among names that this process will now treat as not installed.

    Python's own way: a None in sys.modules makes `import` raise ImportError and importlib.util.find_spec (which
    transformers' is_*_available checks call) return None, so libraries take the path they take where the package
    is absent. A package already imported stays, and so does one named in DFLASH_KEEP_PACKAGES (comma-separated),
    for code of one's own that runs in dflash's process and needs it.
    """
    keep = {n.strip() for n in os.environ.get("DFLASH_KEEP_PACKAGES", "").split(",")}
    skipped = [n for n in names if n not in sys.modules and n not in keep]
    for n in skipped:
        sys.modules[n] = None  # type: ignore[assignment]
    return skipped


def setup_logging(level: int | str, rank: int | None = None) -> None:
    """Configure the root logger: one format for every process; ranks other than 0 log warnings and worse only."""
    if isinstance(level, str):
        level = getattr(logging, level.upper())
    if rank:
        level = max(level, logging.WARNING)
    fmt = LOG_FORMAT.format(rank=f"rank{rank} " if rank is not None else "")
    logging.basicConfig(level=level, format=fmt, datefmt=LOG_DATE, force=True)


class LossyStream:
    """A text stream that drops what it cannot write, counted, instead of raising: a log or progress stream that fails
    (a full disk under a log file, `2>/dev/full`, a reader gone from a pipe) must never fail or stop the work. Every
    other attribute is the wrapped stream's."""

    def __init__(self, stream: Any, name: str) -> None:
        self._stream, self.name = stream, name
        self.dropped = 0
        self.error: BaseException | None = None

    def _lost(self, e: BaseException) -> None:
        self.dropped += 1
        self.error = self.error or e

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as e:  # ValueError: a closed stream
            self._lost(e)
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError) as e:
            self._lost(e)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_std_streams() -> None:
    """Make this process's standard streams safe to write whatever they are attached to.

    A descriptor 0-2 that is closed (`>&- 2>&-`, as a daemon runs) is opened on /dev/null first, so no file this
    process opens takes its number (a library's write to fd 2 would land in a store file), and sys.stdout / stderr,
    None then, become streams again. stderr writes through (nothing of a log line waits in a buffer for a flush that
    fails later), and both drop what cannot be written (LossyStream). Idempotent.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if not isinstance(sys.stderr, LossyStream):
        err = open(2, "w", encoding=getattr(sys.stderr, "encoding", None) or "utf-8", errors="backslashreplace",
                   closefd=False, buffering=1)
        err.reconfigure(write_through=True)
        sys.stderr = LossyStream(err, "stderr")  # type: ignore[assignment]
    if not isinstance(sys.stdout, LossyStream):
        out = sys.stdout if sys.stdout is not None else open(1, "w", closefd=False)
        sys.stdout = LossyStream(out, "stdout")  # type: ignore[assignment]


def lost_output() -> str:
    """Return a line on what the standard streams dropped ("" when nothing was), for the end of a command."""
    lost = [s for s in (sys.stdout, sys.stderr) if isinstance(s, LossyStream) and s.dropped]
    return "; ".join(f"{s.dropped:,} writes to {s.name} were lost ({s.error})" for s in lost)


@dataclass(frozen=True)
class Ranks:
    """This process's place among its peers: torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or a world of one."""

    rank: int = 0
    world: int = 1
    local_rank: int | None = None  # None: not started by a launcher

    @property
    def launched(self) -> bool:
        """Return True if a launcher (torchrun or ours) started this process as one of several ranks."""
        return self.local_rank is not None


def ranks_from_env(environ: dict[str, str] | None = None) -> Ranks:
    """Return the Ranks the environment gives (RANK and WORLD_SIZE both set), else a world of one."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return Ranks()
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return Ranks(rank, world, int(env.get("LOCAL_RANK", rank)))


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception in the main thread: work unwinds as for Ctrl-C (claims released, temp folders gone)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def install_signal_handlers() -> None:
    """Make SIGTERM raise Terminated and SIGINT KeyboardInterrupt in the main thread (no-op in another thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupt_exit_code(exc: BaseException) -> int:
    """Return the shell's exit status of a process stopped by the signal behind exc: 143 SIGTERM, 130 SIGINT."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


@contextlib.contextmanager
def deferred_signals() -> Any:
    """Hold SIGINT and SIGTERM while the block runs (a checkpoint being published), then deliver the first one.

    A block that fails delivers nothing: its own exception is the one to report. No-op outside the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if got:
        os.kill(os.getpid(), got[0])  # again, now under the handler the block had held back
        time.sleep(0.1)  # the handler runs between bytecodes: let it, here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target: Callable[..., Any], args: tuple, rank: int, env: dict[str, str], events: Any, level: int) -> None:
    """Entry point of a spawned process: run target(*args, report), send its result or its error to the parent."""
    os.environ.update(env)
    guard_std_streams()  # spawned with the parent's descriptors: a log stream that fails must not fail the work
    skip_unused_packages()  # spawned: nothing of the parent's sys.modules came along
    install_signal_handlers()
    setup_logging(level, rank if "RANK" in env else None)

    def report(event: dict[str, Any]) -> None:
        events.put({"kind": "event", "rank": rank, "event": event})

    try:
        result = target(*args, report)
    except DflashError as e:
        events.put({"kind": "error", "rank": rank, "type": type(e).__name__, "message": str(e)})
        raise SystemExit(e.exit_code)
    except KeyboardInterrupt as e:  # a signal stopped it (cleanup ran); the parent, signalled too, says so
        raise SystemExit(interrupt_exit_code(e))
    except BaseException as e:
        traceback.print_exc()
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        events.put({"kind": "error", "rank": rank, "type": None, "message": last})
        raise SystemExit(1)
    events.put({"kind": "done", "rank": rank, "result": result})


def launch(target: Callable[..., Any], args: Sequence[tuple], *, what: str, dist_env: bool = False,
           on_event: Report | None = None, stop_all_on_error: bool = True) -> list[Any]:
    """Return target(*args[i], report)'s result of each of len(args) spawned processes, in rank order.

    dist_env: set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as torchrun does. Events a process reports go
    to on_event. The first failure is raised here: a DflashError as its own class and message, anything else as a
    DflashError naming the process (its traceback is on stderr above). With stop_all_on_error the others are
    stopped then (peers in a collective would wait forever); otherwise they finish their work first.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    events = ctx.Queue()
    world, port = len(args), _free_port()
    level = logging.getLogger().getEffectiveLevel()
    procs = []
    for rank, a in enumerate(args):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)} if dist_env else {}
        procs.append(ctx.Process(target=_child, args=(target, a, rank, env, events, level), daemon=False))
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failed: dict[int, dict[str, Any]] = {}
    finished = False
    try:
        while len(results) + len(failed) < world and not (failed and stop_all_on_error):
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and r not in failed and p.exitcode is not None and events.empty():
                        failed[r] = {"type": None, "message": f"exit code {p.exitcode}"}
                continue
            if ev["kind"] == "done":
                results[ev["rank"]] = ev["result"]
            elif ev["kind"] == "error":
                failed[ev["rank"]] = ev
            elif on_event is not None:
                on_event(ev["event"])
        finished = True
    finally:
        running = [p for r, p in enumerate(procs) if r not in results and r not in failed and p.is_alive()]
        if running and (stop_all_on_error or not finished):  # a peer failed, or we were interrupted
            time.sleep(0.5)
            for p in running:
                if p.is_alive():
                    p.terminate()  # SIGTERM: the child unwinds (claims, temp folders) and exits 143
        for p in procs:
            p.join(timeout=None if finished else 60)
            if p.is_alive():  # stuck in a collective whose peer is gone: no Python code runs there
                p.kill()
                p.join()
    if failed:
        rank, ev = sorted(failed.items())[0]
        others = f" ({len(failed)} of {world} {what} processes failed)" if len(failed) > 1 else ""
        cls = getattr(errors_mod, ev["type"], DflashError) if ev["type"] else None
        if cls is not None and isinstance(cls, type) and issubclass(cls, DflashError):
            raise cls(ev["message"] + others)
        raise DflashError(f"{what} process {rank} of {world} failed with {ev['message']}{others}; its log is above; "
                          "rerun the same command to resume")
    return [results[r] for r in range(world)]


def format_eta(seconds: float) -> str:
    """Return seconds as H:MM:SS ("?" when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# Rates and ETAs are over the last RATE_WINDOW_S of progress, from the first update on.
RATE_WINDOW_S = 60.0


def prune_window(seen: deque[tuple[float, ...]], now: float) -> None:
    """Drop from `seen` (time, counter, ...) points oldest first, keeping two at least and the newest one older than
    RATE_WINDOW_S, so that what is left spans the last RATE_WINDOW_S (or all there is)."""
    while len(seen) > 2 and now - seen[1][0] >= RATE_WINDOW_S:
        seen.popleft()


def window_rate(seen: deque[tuple[float, ...]]) -> tuple[float, ...] | None:
    """Return each counter's rate a second between the oldest and the newest of `seen`'s (time, counter, ...)
    points; None before two points at different times."""
    if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
        return None
    first, last = seen[0], seen[-1]
    span = last[0] - first[0]
    return tuple((b - a) / span for a, b in zip(first[1:], last[1:]))


class Progress:
    """Progress of long work: a tqdm bar (rate, ETA) on a terminal, else a log line at most every `every_s` seconds
    (or whenever asked), with done/total, rate and ETA. Only the process that shows it creates one with show=True."""

    def __init__(self, total: int, *, unit: str, desc: str, show: bool = True, every_s: float = 10.0,
                 initial: int = 0, logger: logging.Logger | None = None) -> None:
        self.total, self.unit, self.desc, self.every_s = total, unit, desc, every_s
        self.done = initial
        self.last = time.perf_counter()
        # (time, done) where done changed: the ETA's rate. Only changes count, so a count that moves in steps (a
        # launched run's rank 0 shows the rows of committed shards, read every 5 s) is timed from step to step.
        self._seen: deque[tuple[float, int]] = deque()
        self.show = show
        self.log = logger or log
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True, file=sys.stderr)

    def eta(self) -> float:
        """Return the seconds left at the rate of the last RATE_WINDOW_S of updates, counted from the first update,
        not from the start: a start-up (a model's load, compiles, autotuning on the first batches) would hold the
        rate down and the ETA up for a long while; inf before the count moved twice."""
        rate = window_rate(self._seen)
        return (self.total - self.done) / rate[0] if rate is not None and rate[0] > 0 else float("inf")

    def set_total(self, total: int) -> None:
        """Take a new estimate of the total."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def update(self, n: int = 0, *, to: int | None = None, detail: str = "", force: bool = False) -> None:
        """Advance by n (or to `to`) and show `detail` (e.g. "1,234 tok/s"): on the bar, or in a due log line."""
        self.done = to if to is not None else self.done + n
        now = time.perf_counter()
        if not self._seen or self.done != self._seen[-1][1]:
            self._seen.append((now, self.done))
            prune_window(self._seen, now)
        if not self.show:
            return
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.set_postfix_str(detail, refresh=True)
            return
        if force or now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            self.log.info("%s: %d/%d %ss, %s%sETA %s", self.desc, self.done, self.total, self.unit, detail,
                          ", " if detail else "", format_eta(self.eta()))

    def note(self, text: str) -> None:
        """Show a state that is not progress (e.g. waiting for data)."""
        if self.bar is not None:
            self.bar.set_description_str(text)
        if self.show:
            self.log.info("%s", text)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()
