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
    """Iterable over the shard sets of follow mode's first epoch; the rounds are recorded in the loader state.

    `ahead()` looks once (every rank together) for the round after the one being trained, so its shards can be read
    while this one ends; a round found so is recorded at once and is the next one the iteration yields.
    """

    def __init__(self, store: "Store", dist: "Dist", state: "LoaderState", train_ids: list[int], num_slots: int,
                 say: Callable[[str], None] | None = None, say_every: float = 30.0) -> None:
        self.store, self.dist, self.state = store, dist, state
        self.train, self.num_slots = set(train_ids), num_slots
        self.say, self.say_every = say, say_every
        self.used: set[int] = {s for r in state.rounds for s in r}
        self.yielded = 0
        self.poller: CommitPoller | None = None
        self.pending: list[int] = []
        self.done = False

    def _look(self) -> Any:
        """Agree through rank 0 on what the store holds now: a new round (recorded), "done" or "wait"."""
        msg: Any = "wait"
        if self.dist.rank == 0:
            if self.poller is None:
                # Shards committed but not for training (held out) count as seen, so only training shards make a round.
                self.poller = CommitPoller(self.store, self.used)
            new, complete = self.poller.look()
            self.pending += [i for i in new if i in self.train]
            # Enough new shards to give every slot one, or the last ones: otherwise a slot would have nothing.
            if len(self.pending) >= self.num_slots or (complete and self.pending):
                msg, self.pending = sorted(self.pending), []
            else:
                msg = "done" if complete else "wait"
        msg = self.dist.broadcast(msg)
        if msg == "done":
            self.done = True
        elif msg != "wait":
            self.state.rounds.append(list(msg))
            self.used |= set(msg)
        return msg

    def ahead(self) -> "list[int] | str | None":
        """Return the round after the last one yielded if known now (one look at the store, on every rank, if it is
        not), "done" if there is none, or None if the store has no round ready yet."""
        if self.yielded < len(self.state.rounds):
            return list(self.state.rounds[self.yielded])
        if self.done:
            return "done"
        msg = self._look()
        return None if msg == "wait" else msg

    def __iter__(self) -> Iterator[list[int]]:
        backoff, shown = Backoff(0.2, 2.0), 0.0
        while True:
            if self.yielded < len(self.state.rounds):
                self.yielded += 1
                backoff.reset()
                shown = 0.0
                yield list(self.state.rounds[self.yielded - 1])
                continue
            if self.done or self._look() == "done":
                return
            if self.yielded < len(self.state.rounds):
                continue
            if self.say is not None and time.monotonic() - shown > self.say_every:
                self.say(f"waiting for `dflash extract`: {len(self.used)} of {len(self.train)} training shards "
                         f"trained on, {len(self.store.committed_ids())} of {self.store.num_shards} committed")
                shown = time.monotonic()
            backoff.sleep()
