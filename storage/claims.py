"""Shard claims: an exclusively created file naming host and pid, so one writer at a time fills a shard.

A claim also carries a lease: its writer renews the claim's `time` while it writes (Heartbeat), so a claim of
another host is live while it was renewed within `lease_s` seconds. A process on this host is judged by its pid
(alive, with the recorded start time); a machine that died, or a pod that came back under another name, cannot be
seen from here, and its claims are taken over once their lease has run out.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

from ..errors import ClaimLost, ConfigError
from ..runtime.locks import HOST, holder_is_live, start_time_of
from .fs import StoreFS
from .layout import claim_path, dumps

__all__ = ["Claim", "Heartbeat", "LEASE_ENV", "acquire", "release", "renew", "claim_is_live", "read_claim",
           "lock_is_stale", "lease_seconds"]

log = logging.getLogger(__name__)

# A claim of another host that was not renewed for this long is a dead writer's. Renewals come every lease / 5,
# so a writer must miss four in a row (a stalled file system, a paused VM) before a peer takes its shard over.
LEASE_ENV = "DFLASH_CLAIM_LEASE_S"
DEFAULT_LEASE_S = 600.0


def lease_seconds() -> float:
    """Return the lease new claims carry: $DFLASH_CLAIM_LEASE_S, or 600 s."""
    raw = os.environ.get(LEASE_ENV)
    if raw is None or raw == "":
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{LEASE_ENV}={raw!r}: expected a number of seconds > 0, found {raw!r}; unset it (600 s) "
                          f"or export {LEASE_ENV}=600")
    return value


class Claim(dict):
    """The content of a claim file: host, pid, process start time, a unique token, time (renewed), lease_s."""


def read_claim(fs: StoreFS, shard_id: int) -> Claim | None:
    """Return the claim on a shard, or None if there is none (or it is unreadable, which counts as stale)."""
    return _read_json(fs, claim_path(shard_id))


def claim_is_live(claim: Claim | None, now: float | None = None) -> bool:
    """Return True if the claim's process may still be writing: alive on this host, or on another host while its
    lease runs (renewed within `lease_s`; a claim of a dflash that wrote no lease is live until an operator says)."""
    if not claim or "pid" not in claim or "host" not in claim:
        return False
    if claim["host"] == HOST:
        return holder_is_live(claim)
    if "lease_s" not in claim:
        return True
    try:
        return (time.time() if now is None else now) - float(claim["time"]) <= float(claim["lease_s"])
    except (KeyError, TypeError, ValueError):
        return False  # a claim whose time or lease cannot be read is torn: stale


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
    mine = Claim(host=HOST, pid=pid, start_time=start_time_of(pid), token=uuid.uuid4().hex, time=time.time(),
                 lease_s=lease_seconds())
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
                    if current.get("host") not in (None, HOST) and "lease_s" in current:
                        log.warning("taking over shard %d from %s (pid %s): its claim was last renewed %.0f s ago, "
                                    "past its %g s lease", shard_id, current.get("host"), current.get("pid"),
                                    time.time() - float(current.get("time", 0)), float(current["lease_s"]))
                    else:
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
    if still_ours(fs, shard_id, claim):
        fs.rm(claim_path(shard_id))


def renew(fs: StoreFS, shard_id: int, claim: Claim) -> bool:
    """Return True after renewing our claim's time; False if the claim is no longer ours (taken over, or gone).

    The look and the write are two steps; a peer takes a claim over only after a whole lease without renewal,
    and ShardWriter checks the claim again before its commit record (still_ours), so a writer that lost its
    shard never commits it."""
    if not still_ours(fs, shard_id, claim):
        return False
    claim["time"] = time.time()
    fs.write_atomic(claim_path(shard_id), dumps(claim))
    return True


def still_ours(fs: StoreFS, shard_id: int, claim: Claim) -> bool:
    """Return True if the shard's claim is the one we made (same token)."""
    current = read_claim(fs, shard_id)
    return current is not None and current.get("token") == claim.get("token")


class Heartbeat:
    """A thread renewing one claim every `interval` seconds (lease / 5) until stop(); `lost` says it found the claim
    taken over. A failed renewal (a store briefly unreachable) is logged and tried again: the lease absorbs it."""

    def __init__(self, fs: StoreFS, shard_id: int, claim: Claim, interval: float | None = None) -> None:
        self.fs, self.shard_id, self.claim = fs, shard_id, claim
        self.interval = interval if interval is not None else float(claim.get("lease_s", DEFAULT_LEASE_S)) / 5
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dflash-claim{shard_id}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not renew(self.fs, self.shard_id, self.claim):
                    self.lost = True
                    log.warning("claim on shard %d was taken over by another writer; this process will not "
                                "commit it", self.shard_id)
                    return
            except Exception as e:  # noqa: BLE001 - a renewal that failed is retried at the next beat
                log.warning("could not renew the claim on shard %d (%s: %s); retrying in %g s", self.shard_id,
                            type(e).__name__, e, self.interval)

    def stop(self) -> None:
        """Stop renewing; returns once no renewal is in flight (a late one must not re-create a released claim)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def check_still_ours(fs: StoreFS, shard_id: int, claim: Claim) -> None:
    """Raise ClaimLost unless the shard's claim is still ours (called just before a commit record is written)."""
    current = read_claim(fs, shard_id)
    if current is None or current.get("token") != claim.get("token"):
        holder = "nobody" if current is None else f"{current.get('host')} (pid {current.get('pid')})"
        raise ClaimLost(
            f"{fs.display(claim_path(shard_id))}: expected this process's claim on shard {shard_id} before its commit, "
            f"found it held by {holder} (this process stalled past its {claim.get('lease_s')} s lease); the shard "
            "is that writer's now, nothing to do: rerun `dflash extract` to check the store is complete"
        )
