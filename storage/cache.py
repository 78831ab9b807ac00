"""A bounded local cache of a remote store's shards: each shard fetched whole (its objects concurrently), checked
against its commit record, renamed into place, evicted least recently used; shards fetched ahead on a thread.

A cached shard is a folder `NNNNN-RECORDXXH3-BYTES` holding the shard's files at their store paths, so the store's
own reader reads it as a LocalFS (every chunk checksummed again on every read). The name binds the copy to one
commit record: a shard withdrawn and redone is fetched anew. Several processes may share one cache folder: a
shard appears by an atomic rename, and a read that finds its copy gone or damaged fetches it again.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import CorruptShard, StoreError
from .fs import LocalFS, StoreFS
from .layout import dumps, shard_dir

__all__ = ["ShardCache", "cache_key"]

log = logging.getLogger(__name__)

# Shards fetched ahead of the reader and not yet read, at most.
DEFAULT_AHEAD = 2


def cache_key(url: str, header_xxh3: str) -> str:
    """Return the cache subfolder of a store: its URL made a name, plus its header digest."""
    import xxhash

    tail = "".join(c if c.isalnum() or c in "-_" else "_" for c in url.split("://", 1)[-1])[-60:]
    return f"{tail}-{xxhash.xxh3_64_hexdigest((url + header_xxh3).encode())[:12]}"


def _record_id(record: dict) -> str:
    import xxhash

    return str(record.get("record_xxh3") or xxhash.xxh3_64_hexdigest(dumps(record)))


class ShardCache:
    """Local copies of shards of one remote store under `folder`, at most `max_bytes` of them (LRU)."""

    def __init__(self, folder: str, key: str, max_bytes: int, ahead: int = DEFAULT_AHEAD) -> None:
        self.root = os.path.join(os.path.abspath(folder), key)
        self.max_bytes, self.ahead = int(max_bytes), ahead
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot create the shard cache ({e.strerror or e}); pass another "
                             "--cache-dir") from None
        self.stats = {"fetched": 0, "hits": 0, "evicted": 0, "fetched_bytes": 0, "refetched": 0}
        self._cond = threading.Condition()
        self._inflight: set[str] = set()
        self._unread: set[str] = set()  # fetched ahead, not read yet: never evicted to make room for more ahead
        self._queue: deque[tuple[StoreFS, int, dict]] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        for name in os.listdir(self.root):  # a fetch killed halfway
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # -- what is cached ------------------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[float, str, int]]:
        """Return (last use, name, bytes) of every cached shard, oldest first."""
        out = []
        for name in os.listdir(self.root):
            parts = name.split("-")
            if name.startswith(".") or len(parts) != 3 or not parts[2].isdigit():
                continue
            try:
                out.append((os.stat(os.path.join(self.root, name)).st_mtime, name, int(parts[2])))
            except FileNotFoundError:
                continue
        return sorted(out)

    def used_bytes(self) -> int:
        """Return the bytes the cached shards hold."""
        return sum(n for _, _, n in self._entries())

    @staticmethod
    def _name(shard_id: int, record: dict) -> str:
        return f"{shard_id:05d}-{_record_id(record)}-{int(record['bytes'])}"

    # -- reading -------------------------------------------------------------------------------------------------
    @contextmanager
    def local(self, fs: StoreFS, shard_id: int, record: dict) -> Iterator[LocalFS]:
        """Yield a LocalFS over the cached copy of a committed shard, fetched (and checked) first if needed; this
        process evicts no copy while it is being read."""
        name = self._name(shard_id, record)
        path = os.path.join(self.root, name)
        with self._cond:
            while name in self._inflight:
                self._cond.wait()
            self._unread.discard(name)
            self._inflight.add(name)  # also what keeps it from eviction while read
            hit = os.path.isdir(path)
        try:
            if hit:
                self.stats["hits"] += 1
                _touch(path)
            else:
                self._fetch(fs, shard_id, record, name)
            yield LocalFS(path)
        finally:
            with self._cond:
                self._inflight.discard(name)
                self._cond.notify_all()

    def drop(self, shard_id: int, record: dict) -> None:
        """Remove the cached copy of a shard (found damaged or gone), so the next read fetches it again."""
        shutil.rmtree(os.path.join(self.root, self._name(shard_id, record)), ignore_errors=True)
        self.stats["refetched"] += 1

    def _fetch(self, fs: StoreFS, shard_id: int, record: dict, name: str, ahead: bool = False) -> bool:
        """Fetch a shard into the cache; return False (fetching nothing) when ahead and there is no room."""
        size = int(record["bytes"])
        if not self._make_room(size, ahead):
            return False
        import xxhash

        tmp = os.path.join(self.root, f".tmp-{uuid.uuid4().hex[:8]}")
        sdir = shard_dir(shard_id)
        rels = sorted(record["files"])
        dests = [os.path.join(tmp, sdir, rel) for rel in rels]
        for d in {os.path.dirname(d) for d in dests}:
            os.makedirs(d, exist_ok=True)
        try:
            try:
                fs.download([f"{sdir}/{rel}" for rel in rels], dests)
            except FileNotFoundError as e:
                raise CorruptShard(f"{fs.display(sdir)}: shard {shard_id}: a file of its commit record is missing "
                                   f"({e}); run `dflash verify {fs.url} --repair` and rerun extract") from None
            for rel, dest in zip(rels, dests):
                entry = record["files"][rel]
                with open(dest, "rb") as f:
                    data = f.read()
                if len(data) != entry["bytes"] or xxhash.xxh3_64_hexdigest(data) != entry["xxh3"]:
                    raise CorruptShard(
                        f"{fs.display(f'{sdir}/{rel}')}: shard {shard_id}: fetched {len(data)} bytes that do not match "
                        f"its commit record ({entry['bytes']} bytes, xxh3 {entry['xxh3']}); run "
                        f"`dflash verify {fs.url} --repair` and rerun extract")
            try:
                os.rename(tmp, os.path.join(self.root, name))
            except OSError:  # another process sharing the folder put the same copy in place first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        with self._cond:
            self.stats["fetched"] += 1
            self.stats["fetched_bytes"] += size
            if ahead:
                self._unread.add(name)
        return True

    def _make_room(self, size: int, ahead: bool) -> bool:
        """Evict least recently used shards until `size` more bytes fit; ahead: only shards already read."""
        entries = self._entries()
        used = sum(n for _, _, n in entries)
        with self._cond:
            keep = set(self._inflight) | set(self._unread)
        if ahead and (len(self._unread) >= self.ahead or size > self.max_bytes):
            return False
        for _, name, n in entries:
            if used + size <= self.max_bytes:
                break
            if name in keep:
                continue
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            used -= n
            self.stats["evicted"] += 1
        if used + size > self.max_bytes:
            if ahead:
                return False
            log.warning("shard cache %s: %d bytes held by shards in use, shard of %d bytes exceeds --cache-gb",
                        self.root, used, size)
        return True

    # -- read-ahead ----------------------------------------------------------------------------------------------
    def read_ahead(self, fs: StoreFS, shard_ids: list[int], record_of: Any) -> None:
        """Queue shards to fetch on a thread, in order, while the cache has room for them; record_of(id) gives a
        shard's commit record (read when its turn comes, not all at once)."""
        with self._cond:
            self._queue.extend((fs, sid, record_of) for sid in shard_ids)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dflash-cache", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._queue or len(self._unread) >= self.ahead):
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    return
                fs, sid, record_of = self._queue[0]
            name, done, mine = "", True, False
            try:
                rec = record_of(sid)
                name = self._name(sid, rec)
                with self._cond:
                    mine = not (os.path.isdir(os.path.join(self.root, name)) or name in self._inflight)
                    if mine:
                        self._inflight.add(name)
                if mine:
                    done = self._fetch(fs, sid, rec, name, ahead=True)
            except Exception as e:  # the reader meets the same problem and reports it where it can be acted on
                log.debug("read-ahead of shard %d failed: %s", sid, e)
            finally:
                with self._cond:
                    if mine:
                        self._inflight.discard(name)
                    self._cond.notify_all()
            with self._cond:
                if done and self._queue and self._queue[0][1] == sid:
                    self._queue.popleft()
            if not done:
                time.sleep(0.2)  # full of shards not yet read: wait for the reader

    def close(self) -> None:
        """Stop fetching ahead and log what the cache did."""
        st = self.stats
        log.info("shard cache %s: fetched %d shards (%.1f MB), %d reads from local disk, %d evicted, %d fetched again",
                 self.root, st["fetched"], st["fetched_bytes"] / 1e6, st["hits"], st["evicted"], st["refetched"])
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
