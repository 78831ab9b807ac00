"""What `dflash run` shows of its stages, read from the files they write: the store's commit records (extract) and
the run's metrics.jsonl (train)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ..runtime.process import format_eta

__all__ = ["Metrics", "StoreView", "METRICS"]

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"  # written by `dflash train` in its run folder


class Metrics:
    """Reads the run's metrics.jsonl as it grows (and after a resume rewrites it): last step record, checkpoints."""

    def __init__(self, run: Path) -> None:
        self.path, self.offset, self.ino = run / METRICS, 0, None
        self.last: dict[str, Any] | None = None
        self.checkpoint = -1  # newest step a checkpoint event was seen for

    def poll(self) -> None:
        """Read what was appended since the last call."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_ino != self.ino or st.st_size < self.offset:  # replaced by a resume's truncation
            self.ino, self.offset = st.st_ino, 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a torn last line is read once it is whole
        self.offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("split") == "train":
                self.last = rec
            elif rec.get("event") == "checkpoint":
                self.checkpoint = max(self.checkpoint, int(rec["step"]))


class StoreView:
    """The store as its commit records show it: shards committed, their tokens, completeness, rate since start."""

    def __init__(self, url: str) -> None:
        self.url, self.store = url, None
        self.tokens: dict[int, int] = {}
        self.t0, self.base = time.monotonic(), None

    def poll(self) -> None:
        """Read the commit records written since the last call."""
        from ..errors import DflashError
        from ..storage import Store

        if self.store is None:
            try:
                self.store = Store.open(self.url)
            except DflashError:
                return
        for sid in self.store.committed_ids():
            if sid not in self.tokens:
                try:
                    self.tokens[sid] = int(self.store.commit_record(sid)["num_tokens"])
                except DflashError:
                    self.tokens[sid] = 0
        if self.base is None:
            self.base = (len(self.tokens), sum(self.tokens.values()))

    @property
    def complete(self) -> bool:
        """Return True once extract has marked the store complete."""
        return self.store is not None and self.store.is_complete()

    def line(self) -> tuple[str, float]:
        """Return the progress text and the seconds left (inf when unknown)."""
        if self.store is None:
            return "extract: starting", float("inf")
        total, done = self.store.num_shards, len(self.tokens)
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        shards = done - (self.base or (0, 0))[0]
        rate = (sum(self.tokens.values()) - (self.base or (0, 0))[1]) / elapsed
        eta = (total - done) * elapsed / shards if shards else (0.0 if done >= total else float("inf"))
        return f"extract {done}/{total} shards, {rate:,.0f} tok/s, ETA {format_eta(eta)}", eta
