"""Follow mode: yield each shard of a store once as it commits, waiting with backoff, until the store is complete."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterator

from ..errors import StoreError

if TYPE_CHECKING:
    from .store import Store

__all__ = ["follow_commits"]

log = logging.getLogger(__name__)


def follow_commits(
    store: "Store",
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
    seen: set[int] = set() if include_existing else set(store.committed_ids())
    wait = poll
    last_new = time.monotonic()
    while True:
        # Read completeness before listing: a store complete now has all its commits in the listing that follows.
        complete = store.is_complete()
        new = [i for i in store.committed_ids() if i not in seen]
        for i in new:
            seen.add(i)
            yield i
        if new:
            wait, last_new = poll, time.monotonic()
            continue
        if complete:
            return
        if timeout is not None and time.monotonic() - last_new > timeout:
            raise StoreError(
                f"{store.fs.display()}: no shard committed for {timeout:.0f} s ({len(seen)} of {store.num_shards} "
                "seen); is `dflash extract` still running? rerun it to finish the store"
            )
        time.sleep(wait)
        wait = min(max_poll, wait * 1.5)
