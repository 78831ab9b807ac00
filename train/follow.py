"""Follow mode: the rounds interface (rounds.py) over a store `dflash extract` is still writing. Its first epoch trains
in rounds over the shards extract commits, agreed through rank 0; the next epochs are plain mode's.

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
from .plan import Round, planned_total
from .rounds import Rounds

if TYPE_CHECKING:
    from ..storage import Store
    from .dist import Dist
    from .plan import LoaderState

__all__ = ["FollowedRounds", "CommitWatch", "estimate_total", "FOLLOW_AHEAD_STEPS"]

log = logging.getLogger(__name__)

# Follow mode decides the next round (the shards committed by then) once the current one has this many steps left,
# so its first shards are read while these steps train; earlier would leave later commits to the round after.
FOLLOW_AHEAD_STEPS = 4


def estimate_total(round_steps: int, round_shards: int, train_shards: int, epochs: int, max_steps: int | None) -> int:
    """Return the run's estimated steps: the first round's steps per shard, over every training shard and epoch."""
    per_epoch = math.ceil(round_steps * train_shards / max(1, round_shards))
    total = per_epoch * epochs
    return min(total, max_steps) if max_steps else max(1, total)


class CommitWatch:
    """Iterable over the shard sets of follow mode's first epoch as extract commits them; the rounds are recorded
    in the loader state.

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


class FollowedRounds(Rounds):
    """Follow mode's rounds: the first epoch's come from the store as extract commits them (CommitWatch), the
    run's length is estimated from the first and settled at the end of that epoch; later epochs are plain mode's."""

    watch: CommitWatch

    @property
    def following(self) -> bool:
        """Return True while the run is in its first epoch, of rounds of newly committed shards."""
        return self.state.epoch == 0 and not self.state.follow_done

    def fresh_total(self) -> int:
        return self.cfg.max_steps or 1  # re-estimated once the first shards arrive

    def resumed_total(self, total: int) -> int:
        if self.state.rounds and not self.state.follow_done:
            return total  # still in the first epoch: its estimate stands
        return super().resumed_total(total)

    def first_epoch_steps(self) -> int:
        if not self.state.rounds:
            return super().first_epoch_steps()
        return sum(self.plan(r, 0, i).steps for i, r in enumerate(self.state.rounds))

    def of_epoch(self, epoch: int, resumed: bool) -> Iterator[tuple[int, Round]]:
        if not self.following:
            yield from super().of_epoch(epoch, resumed)
            return
        self.watch = CommitWatch(self.store, self.dist, self.state, self.train_ids, self.num_slots, self.say)
        for index, ids in enumerate(self.watch):
            plan = self.plan_of(ids, epoch, index)
            if not self.cfg.max_steps and not resumed and index == 0:
                self.set_total(estimate_total(plan.steps, len(ids), len(self.train_ids), self.cfg.epochs,
                                              self.cfg.max_steps))
            yield index, plan

    def upcoming(self, epoch: int, index: int) -> Round | None:
        """Following, this looks at the store once, on every rank together (CommitWatch.ahead)."""
        if not self.following:
            return super().upcoming(epoch, index)
        nxt = self.watch.ahead()
        if nxt is None:
            return None
        if nxt != "done":
            return self.plan_of(nxt, epoch, index + 1)
        shards = sorted({s for r in self.state.rounds for s in r})  # what end_epoch takes for the next epochs
        return self.plan_of(shards, epoch + 1, 0) if epoch + 1 < self.cfg.epochs else None

    def ahead_now(self, left: int) -> bool:
        return not self.following or left <= FOLLOW_AHEAD_STEPS

    def waiting(self) -> bool:
        return self.following

    def end_epoch(self, step: int) -> list[list[int]]:
        if not self.following:
            return super().end_epoch(step)
        self.state.follow_done = True
        self.state.shards = sorted({s for r in self.state.rounds for s in r})
        if not self.cfg.max_steps:
            self.set_total(planned_total(self.epoch_steps, 1, self.cfg.epochs, 0, done=step))
        return [list(r) for r in self.state.rounds]
