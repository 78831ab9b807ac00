"""Shard claims: an exclusively created file naming host and pid, so one writer at a time fills a shard."""
from __future__ import annotations

import json
import logging
import os
import time
import uuid

from ..runtime.locks import HOST, holder_is_live, start_time_of
from .fs import StoreFS
from .layout import claim_path, dumps

__all__ = ["Claim", "acquire", "release", "claim_is_live", "read_claim", "lock_is_stale"]

log = logging.getLogger(__name__)


class Claim(dict):
    """The content of a claim file: host, pid, process start time, a unique token, time."""


def read_claim(fs: StoreFS, shard_id: int) -> Claim | None:
    """Return the claim on a shard, or None if there is none (or it is unreadable, which counts as stale)."""
    return _read_json(fs, claim_path(shard_id))


def claim_is_live(claim: Claim | None) -> bool:
    """Return True if the claim's process may still be writing: alive on this host, or on another host at all."""
    return holder_is_live(claim)


def _read_json(fs: StoreFS, rel: str) -> Claim | None:
    try:
        return Claim(json.loads(fs.read_bytes(rel)))
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        return Claim()


def acquire(fs: StoreFS, shard_id: int) -> Claim | None:
    """Return our new claim on the shard, taking over a stale one; None if a live process holds it."""
    pid = os.getpid()
    mine = Claim(host=HOST, pid=pid, start_time=start_time_of(pid), token=uuid.uuid4().hex, time=time.time())
    path = claim_path(shard_id)
    for _ in range(5):
        if fs.create_exclusive(path, dumps(mine)):
            return mine
        current = read_claim(fs, shard_id)
        if current is None:
            continue  # released between our attempt and our look: try again
        if claim_is_live(current):
            return None
        # Of several processes seeing the same stale claim, only the one that creates this lock removes it; it
        # re-reads the claim under the lock so it never removes a claim another process has just made.
        lock = f"{path}.takeover-{current.get('token')}.partial"
        if fs.create_exclusive(lock, dumps(mine)):
            try:
                again = read_claim(fs, shard_id)
                if again is not None and again.get("token") == current.get("token"):
                    log.info("taking over stale claim on shard %d (%s)", shard_id, dict(current))
                    fs.rm(path)
            finally:
                fs.rm(lock)
        else:
            # A process killed while holding the lock would leave the stale claim untakeable forever: the lock
            # names its holder, and a dead holder's lock is removed like a stale claim.
            if lock_is_stale(fs, lock):
                log.info("removing takeover lock %s of a dead process", lock)
                fs.rm(lock)
    return None


def lock_is_stale(fs: StoreFS, rel: str) -> bool:
    """Return True if a takeover lock (`*.takeover-*.partial` beside a claim) names a process that is not running."""
    holder = _read_json(fs, rel)
    return holder is not None and not claim_is_live(holder)


def release(fs: StoreFS, shard_id: int, claim: Claim) -> None:
    """Remove our claim file, unless someone else's claim has replaced it."""
    current = read_claim(fs, shard_id)
    if current is not None and current.get("token") == claim.get("token"):
        fs.rm(claim_path(shard_id))
