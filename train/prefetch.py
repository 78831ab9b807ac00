"""Whole shards read ahead on a thread, round after round, with bounded memory (pinned host buffers reused).

The reader thread reads whole shards (large sequential reads; the store decodes chunks in its own pool) in the
order this rank first needs them, at most `capacity` shards ahead of what the current steps hold; stream.py's
producer turns them into batches.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ..errors import CorruptShard

if TYPE_CHECKING:
    from ..storage import ShardData, Store

__all__ = ["ShardPrefetcher", "Stopped", "take_buffer"]

log = logging.getLogger(__name__)


class Stopped(Exception):
    """Raised in the producer when the stream is closed while it waits for a shard."""


def take_buffer(free: list[Any], n: int) -> tuple[Any, list[Any]]:
    """Return (the smallest buffer of `free` holding >= n elements or None, the others), matched by identity.

    Not `free.remove(buf)`: list.remove compares with ==, which for tensors is elementwise and raised a size
    mismatch as soon as the pool held buffers of two sizes (an H200 run on a store of uneven shards).
    """
    fits = [b for b in free if b.numel() >= n]
    if not fits:
        return None, free
    buf = min(fits, key=lambda b: b.numel())
    return buf, [b for b in free if b is not buf]


class ShardPrefetcher:
    """Reads whole shards on a thread, round after round in a fixed order, holding at most `capacity` at once.

    Round 0's order comes at construction; `extend` queues the next round's, which the thread starts on as soon as
    every read of the rounds before it has started and a slot is free: the next round's first shards are read while
    the current round's last steps are still being consumed. Shards are keyed by (round, shard id), so a shard in
    two epochs is two reads, each counted against the same bound.
    """

    def __init__(self, store: "Store", order: list[int], capacity: int, skip_corrupt: bool, pin: bool,
                 raw: bool = False) -> None:
        self.store, self.skip_corrupt, self.pin = store, skip_corrupt, pin
        self.raw = raw  # a scaled codec's shards as stored codes and scales, decoded on the training device
        self.orders: list[list[int]] = [list(order)]
        self.capacity, self.held = capacity, 0
        self.cond = threading.Condition()
        self.ready: dict[tuple[int, int], Any] = {}
        self.touched: set[tuple[int, int]] = set()
        self.started: list[tuple[int, int]] = []  # (round, shard) of every read begun, in order: what read ahead
        self.stop = False
        self.corrupt: list[int] = []
        self.buffers: dict[tuple[int, int], Any] = {}  # pinned memory of each shard held
        self.free: list[Any] = []  # pinned memory of released shards, for reuse
        self.thread = threading.Thread(target=self._run, name="dflash-prefetch", daemon=True)
        self.thread.start()
        store.read_ahead(order)  # a remote store's shard cache fetches further ahead, on disk

    def _read(self, sid: int, key: tuple[int, int]) -> "ShardData":
        if not self.pin:
            return self.store.read_shard(sid, raw=self.raw)
        rec = self.store.commit_record(sid)
        n = max(1, int(rec["num_tokens"]) * len(self.store.header["layer_ids"]) * int(self.store.header["hidden_size"]))
        # Pinning memory is slow (it maps and locks every page), so released buffers are reused for later shards.
        with self.cond:
            buf, self.free = take_buffer(self.free, n)
        if buf is None:
            buf = self._alloc(n)
        with self.cond:
            self.buffers[key] = buf
        return self.store.read_shard(sid, out=buf, raw=self.raw)

    def _alloc(self, n: int) -> Any:
        import torch

        return torch.empty(n, dtype=torch.bfloat16, pin_memory=True)

    def _slot(self, rnd: int) -> bool:
        """Wait for room to read one more shard of round `rnd`; return False once stopped."""
        with self.cond:
            while not self.stop and (self.held >= self.capacity or rnd >= len(self.orders)):
                self.cond.wait()
            if self.stop:
                return False
            self.held += 1
            return True

    def _run(self) -> None:
        rnd = 0
        while True:
            with self.cond:
                while not self.stop and rnd >= len(self.orders):
                    self.cond.wait()
                if self.stop:
                    return
                order = self.orders[rnd]
            for sid in order:
                if not self._slot(rnd):
                    return
                key = (rnd, sid)
                with self.cond:
                    self.started.append(key)
                    self.cond.notify_all()
                try:
                    data: Any = self._read(sid, key)
                except CorruptShard as e:
                    if not self.skip_corrupt:
                        data = CorruptShard(f"{e}; or rerun `dflash train --resume` with --skip-corrupt to train without it")
                    else:
                        log.warning("skipping corrupt shard (--skip-corrupt): %s", e)
                        self.corrupt.append(sid)
                        data = None
                except BaseException as e:  # handed to the consumer, which re-raises it on the training thread
                    data = e
                with self.cond:
                    self.ready[key] = data
                    self.cond.notify_all()
            rnd += 1

    def extend(self, order: list[int]) -> int:
        """Queue the next round's shards, read once this round's reads have all begun; return that round's number."""
        with self.cond:
            self.orders.append(list(order))
            self.cond.notify_all()
            n = len(self.orders) - 1
        self.store.read_ahead(order)
        return n

    def advance(self, capacity: int) -> None:
        """Take the bound of the round whose steps start now (the one before has released all its shards)."""
        with self.cond:
            self.capacity = capacity
            self.cond.notify_all()

    def get(self, sid: int, rnd: int = 0) -> "ShardData | None":
        """Return a shard of round `rnd` once read (None if it was corrupt and skipped); re-raise its read error."""
        key = (rnd, sid)
        with self.cond:
            while key not in self.ready:
                if self.stop:
                    raise Stopped()
                self.cond.wait()
            data = self.ready[key]
            self.touched.add(key)
        if isinstance(data, BaseException):
            raise data
        return data

    def release(self, sid: int, rnd: int = 0) -> None:
        """Drop a shard nobody needs any more, making room for the next read."""
        key = (rnd, sid)
        with self.cond:
            self.ready.pop(key, None)
            self.touched.discard(key)
            buf = self.buffers.pop(key, None)
            if buf is not None:
                self.free = sorted([*self.free, buf], key=lambda b: b.numel())[-4:]  # keep the largest few
            self.held -= 1
            self.cond.notify_all()

    def depth(self) -> int:
        """Return how many shards are read and waiting, not yet used by any step."""
        with self.cond:
            return sum(1 for s in self.ready if s not in self.touched)

    def begun(self, rnd: int) -> int:
        """Return how many reads of round `rnd` have begun."""
        with self.cond:
            return sum(1 for r, _ in self.started if r == rnd)

    def close(self) -> None:
        """Stop reading and wait for the thread to end (at most one shard read away)."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        # Joined, not abandoned: a daemon thread still inside a shard read (pinned allocation, decoder threads)
        # when the interpreter exits can abort the process ("terminate called without an active exception").
        if self.thread is not threading.current_thread():
            self.thread.join()
