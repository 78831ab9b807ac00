"""The timeline of one extract worker: seconds per stage, per shard and per thread, from the process's start.

The worker's main thread (start-up, then per shard: waiting for the tokenised shard, packing, the forward, waiting
for a free host buffer) is timed in intervals that do not overlap, so its parts add up to the worker's wall time:
what they miss shows as `unaccounted_s`. The threads beside it (the target's load during start-up, the tokeniser,
the writer, the store's compression pool) are timed as well, per shard where they work on one; their seconds
overlap the main thread's and are reported apart, as background.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Iterator

__all__ = ["Timeline", "process_start", "MAIN_ORDER", "MAX_BATCHES", "STARTUP_BACKGROUND", "format_line",
           "write_profile"]

log = logging.getLogger(__name__)

# The main thread's parts in the order they happen (start-up, the shards, the end); others follow in name order.
# The command's imports are split by what they bring in (orchestrate._timed_imports); `python` is all before.
MAIN_ORDER = ("python", "import_torch", "import_transformers", "import_storage", "import_dflash", "model_config",
              "devices", "read", "plan", "store", "tokenizer", "device_init", "model_wait", "model_load", "runner",
              "host_buffers", "claim", "wait_tokenise", "pack", "forward", "wait_buffer", "drain", "summary")
# The per-forward rows a --profile timeline keeps (170-270 bytes each in the profile's JSON: 17-27 MB at most).
MAX_BATCHES = 100_000
# Per-shard parts of the main thread (these sum to wall with the start-up ones) and of the threads beside it.
SHARD_MAIN = ("claim", "wait_tokenise", "pack", "forward", "wait_buffer")
# Start-up work beside the main thread: the target's weight files read into the page cache from the start
# (target.WeightPrefetch), the target loaded on its own thread (extract/loader.py).
STARTUP_BACKGROUND = ("model_prefetch", "model_imports", "model_check", "device_init", "model_load")


def process_start() -> float:
    """Return this process's start as a time.perf_counter() value (from /proc; now where /proc cannot say)."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    return now - max(0.0, uptime - started)


class Timeline:
    """Seconds per stage of one worker; `main` parts (one thread, no overlap), per-shard rows and start-up work
    beside the main thread (`side`). Thread-safe."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_start() if origin is None else origin
        self.main: dict[str, float] = {}
        self.shards: dict[int, dict[str, float]] = {}
        self.side: dict[str, float] = {}
        # One row a forward (add_batch): its shape and seconds, so a run's slow batches can be found and each batch
        # set beside the same batch's bare forward (bench/forward_kernels.py); the first MAX_BATCHES are kept.
        self.batches: list[dict[str, Any]] = []
        self.batches_dropped = 0
        self._lock = threading.Lock()
        self._last = time.perf_counter()
        self.add("python", self._last - self.origin)  # interpreter start and the command line's own imports

    def add(self, name: str, seconds: float, shard: int | None = None, *, main: bool = True) -> None:
        """Add seconds to a stage (of the shard's row when given; to the main thread's parts when main; to the
        start-up work beside the main thread when neither)."""
        with self._lock:
            if shard is None and not main:
                self.side[name] = self.side.get(name, 0.0) + seconds
            if shard is not None:
                row = self.shards.setdefault(int(shard), {})
                row[name] = row.get(name, 0.0) + seconds
            if main and (shard is None or name in SHARD_MAIN):
                self.main[name] = self.main.get(name, 0.0) + seconds

    def add_batch(self, **row: Any) -> None:
        """Record one forward's row (shard, rows, length, tokens, its seconds: see FeaturePipeline._write_loop)."""
        with self._lock:
            if len(self.batches) < MAX_BATCHES:
                self.batches.append({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})
            else:
                self.batches_dropped += 1

    def add_many(self, shard: int, seconds: dict[str, float]) -> None:
        """Add background seconds (name -> s) to a shard's row."""
        for name, s in seconds.items():
            self.add(name, s, shard, main=False)

    @contextlib.contextmanager
    def stage(self, name: str, shard: int | None = None, *, main: bool = True) -> Iterator[None]:
        """Time the block as one interval of the stage."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, shard, main=main)

    def to_dict(self, end: float | None = None, **extra: Any) -> dict[str, Any]:
        """Return the timeline as JSON-ready numbers: parts, their sum, the wall, per-shard rows, background totals
        (start-up work beside the main thread, then the shards' threads)."""
        end = time.perf_counter() if end is None else end
        with self._lock:
            main = dict(self.main)
            shards = {k: dict(v) for k, v in self.shards.items()}
            side = dict(self.side)
            batches, dropped = list(self.batches), self.batches_dropped
        wall = end - self.origin
        names = [n for n in MAIN_ORDER if n in main] + sorted(set(main) - set(MAIN_ORDER))
        parts = {n: round(main[n], 4) for n in names}
        total = sum(main.values())
        background: dict[str, float] = dict(side)
        for row in shards.values():
            for n, s in row.items():
                if n not in SHARD_MAIN:
                    background[n] = background.get(n, 0.0) + s
        rows = [{"shard": sid, **{n: round(s, 4) for n, s in sorted(row.items())}} for sid, row in sorted(shards.items())]
        return {**extra, "wall_s": round(wall, 4), "parts_sum_s": round(total, 4),
                "unaccounted_s": round(wall - total, 4), "parts": parts,
                "background": {n: round(s, 4) for n, s in sorted(background.items())}, "shards": rows,
                "batches": batches, **({"batches_dropped": dropped} if dropped else {})}


def _group(parts: dict[str, float]) -> tuple[float, float, float]:
    start = sum(s for n, s in parts.items() if n not in SHARD_MAIN and n not in ("drain", "summary"))
    shards = sum(parts.get(n, 0.0) for n in SHARD_MAIN)
    return start, shards, parts.get("drain", 0.0) + parts.get("summary", 0.0)


def format_line(worker: dict[str, Any]) -> str:
    """Return the one-line summary of a worker's timeline (what the log shows at the end of a run)."""
    from .perf import perf_line

    p = worker["parts"]
    start, shards, end = _group(p)
    n = max(1, len(worker["shards"]))
    ups = ", ".join(f"{k} {p[k]:.1f}" for k in p if k not in SHARD_MAIN and k not in ("drain", "summary"))
    per = ", ".join(f"{k} {p[k]:.2f}" for k in SHARD_MAIN if k in p)
    side = ", ".join(f"{k} {worker['background'][k]:.1f}" for k in STARTUP_BACKGROUND if k in worker["background"])
    bg = ", ".join(f"{k} {v:.2f}" for k, v in worker["background"].items() if k not in STARTUP_BACKGROUND)
    return (f"timeline {worker.get('device', '')}: wall {worker['wall_s']:.1f} s = start-up {start:.1f} ({ups}) + "
            f"{len(worker['shards'])} shards {shards:.1f} ({per}; {shards / n:.2f} s/shard) + drain/summary "
            f"{end:.1f} + unaccounted {worker['unaccounted_s']:.2f}; beside it: "
            + (f"target load ({side}), " if side else "") + f"{bg} s"
            + (f"; {perf_line(worker['perf'])}" if worker.get("perf") else ""))


def write_profile(path: str, workers: list[dict[str, Any]], **extra: Any) -> None:
    """Write the timelines as one JSON file, atomically (per-worker parts, shard rows and background totals)."""
    import json

    from ..runtime.atomic import write_atomic
    from ..errors import InputError

    doc = {"version": 1, **extra, "workers": workers}
    try:
        write_atomic(path, json.dumps(doc, indent=1) + "\n")
    except OSError as e:
        raise InputError(f"--profile {path}: cannot write the timeline there ({e.strerror or e})") from None
