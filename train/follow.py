"""Follow mode's first epoch: training rounds over the shards `dflash extract` commits, agreed through rank 0.

Each round takes the training shards committed (and not yet trained on) when it starts, once there are enough to
give every slot one, or the last ones once the store is complete. A resumed run replays the rounds it had. The
run's length is unknown until the store is complete: it is estimated from the first round.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..storage.follow import Backoff, CommitPoller

if TYPE_CHECKING:
    from ..storage import Store
    from .dist import Dist
    from .plan import LoaderState

__all__ = ["FollowRounds", "estimate_total"]

log = logging.getLogger(__name__)


def estimate_total(round_steps: int, round_shards: int, train_shards: int, epochs: int, max_steps: int | None) -> int:
    """Return the run's estimated steps: the first round's steps per shard, over every training shard and epoch."""
    per_epoch = math.ceil(round_steps * train_shards / max(1, round_shards))
    total = per_epoch * epochs
    return min(total, max_steps) if max_steps else max(1, total)


class FollowRounds:
    """Iterable over the shard sets of follow mode's first epoch; the rounds are recorded in the loader state."""

    def __init__(self, store: "Store", dist: "Dist", state: "LoaderState", train_ids: list[int], num_slots: int,
                 say: Callable[[str], None] | None = None, say_every: float = 30.0) -> None:
        self.store, self.dist, self.state = store, dist, state
        self.train, self.num_slots = set(train_ids), num_slots
        self.say, self.say_every = say, say_every

    def __iter__(self) -> Iterator[list[int]]:
        used: set[int] = set()
        for r in list(self.state.rounds):
            used |= set(r)
            yield r
        # Shards committed but not for training (held out) count as seen, so only training shards make a round.
        poller = CommitPoller(self.store, used)
        pending: list[int] = []
        backoff, shown = Backoff(0.2, 2.0), 0.0
        while True:
            msg: Any = "wait"
            if self.dist.rank == 0:
                new, complete = poller.look()
                pending += [i for i in new if i in self.train]
                # Enough new shards to give every slot one, or the last ones: otherwise a slot would have nothing.
                if len(pending) >= self.num_slots or (complete and pending):
                    msg, pending = sorted(pending), []
                else:
                    msg = "done" if complete else "wait"
            msg = self.dist.broadcast(msg)
            if msg == "done":
                return
            if msg == "wait":
                if self.say is not None and time.monotonic() - shown > self.say_every:
                    self.say(f"waiting for `dflash extract`: {len(used)} of {len(self.train)} training shards "
                             f"trained on, {len(self.store.committed_ids())} of {self.store.num_shards} committed")
                    shown = time.monotonic()
                backoff.sleep()
                continue
            backoff.reset()
            shown = 0.0
            self.state.rounds.append(list(msg))
            used |= set(msg)
            yield list(msg)
