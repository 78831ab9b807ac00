"""Following a store that `dflash extract` is still writing: wait for it to exist, then see each commit once.

One poller with one backoff rule serves both the trainer's follow mode and `follow_commits`.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

from ..errors import StoreError
from .backends import open_fs
from .layout import ROOT_META
from .store import Store

__all__ = ["Backoff", "CommitPoller", "wait_for_store", "follow_commits"]

log = logging.getLogger(__name__)


class Backoff:
    """Sleeps that grow 1.5x from `first` up to `most` while nothing happens, and start over when something does."""

    def __init__(self, first: float = 0.5, most: float = 5.0) -> None:
        self.first, self.most = first, most
        self.wait = first

    def sleep(self) -> None:
        """Sleep the current wait, then lengthen it."""
        time.sleep(self.wait)
        self.wait = min(self.most, self.wait * 1.5)

    def reset(self) -> None:
        """Start over from the shortest wait."""
        self.wait = self.first


class CommitPoller:
    """Looks at a store for shards committed since the last look."""

    def __init__(self, store: Store, seen: set[int] | None = None) -> None:
        self.store = store
        self.seen: set[int] = set(seen or ())

    def look(self) -> tuple[list[int], bool]:
        """Return (ids committed and not seen before, ascending; whether the store was complete before listing).

        Completeness is read before the listing: a store complete then has all its commits in the listing.
        The new ids count as seen from now on.
        """
        complete = self.store.is_complete()
        new = [i for i in self.store.committed_ids() if i not in self.seen]
        self.seen.update(new)
        return new, complete


def wait_for_store(url: str, *, backoff: Backoff | None = None, say_every: float = 30.0) -> Store:
    """Return the store at url once `dflash extract` has created it, logging the wait every `say_every` seconds."""
    fs, shown = open_fs(url), float("-inf")
    backoff = backoff or Backoff(0.5, 1.0)
    while not fs.exists(ROOT_META):
        if time.monotonic() - shown > say_every:
            log.info("waiting for `dflash extract` to create the store %s", url)
            shown = time.monotonic()
        backoff.sleep()
    return Store.open(url)


def follow_commits(
    store: Store,
    *,
    poll: float = 0.5,
    max_poll: float = 5.0,
    include_existing: bool = True,
    timeout: float | None = None,
) -> Iterator[int]:
    """Yield committed shard ids, each once, in commit-discovery order (ascending within one look).

    Waits `poll` seconds between looks, growing 1.5x up to `max_poll` while nothing new appears and resetting
    when something does. Ends once the store is complete and every shard has been yielded; raises StoreError
    if `timeout` seconds pass without a new commit.
    """
    poller = CommitPoller(store, None if include_existing else set(store.committed_ids()))
    backoff = Backoff(poll, max_poll)
    last_new = time.monotonic()
    while True:
        new, complete = poller.look()
        yield from new
        if new:
            backoff.reset()
            last_new = time.monotonic()
            continue
        if complete:
            return
        if timeout is not None and time.monotonic() - last_new > timeout:
            raise StoreError(
                f"{store.fs.display()}: no shard committed for {timeout:.0f} s ({len(poller.seen)} of "
                f"{store.num_shards} seen); is `dflash extract` still running? rerun it to finish the store"
            )
        backoff.sleep()
