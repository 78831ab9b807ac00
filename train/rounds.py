"""The rounds of shards the training loop asks for, epoch by epoch, and their plans and the run's length.

`Rounds` is plain mode: a finished store, one round of every committed training shard an epoch. Follow mode
(follow.py's `FollowedRounds`) is the same interface over a store that `dflash extract` is still writing. The loop
asks `of_epoch(epoch)` for the plans to train, `upcoming` for the one to read ahead, and `end_epoch` once an epoch
is done; the plans are made here, once each (plan.py's pure planning over plan.py's ShardLengths).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..errors import ConfigError, StoreError
from .plan import LoaderState, Round, ShardLengths, plan_round, planned_total

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..storage import Store
    from .dist import Dist

__all__ = ["Rounds"]

log = logging.getLogger(__name__)


class Rounds:
    """Plain mode's rounds: every epoch one round over the committed training shards taken at the start."""

    def __init__(self, cfg: "TrainConfig", store: "Store", dist: "Dist", state: LoaderState, train_ids: list[int],
                 num_slots: int, set_total: Callable[[int], None], say: Callable[[str], None] | None) -> None:
        self.cfg, self.store, self.dist, self.state = cfg, store, dist, state
        self.train_ids, self.num_slots = train_ids, num_slots
        self.set_total, self.say = set_total, say
        self.lengths = ShardLengths(store, cfg.skip_corrupt)
        self.plan_kw = dict(num_slots=num_slots, seed=cfg.seed, batch_tokens=cfg.batch_tokens,
                            buffer_tokens=4 * cfg.batch_tokens)
        self.planned: dict[tuple[Any, ...], Round] = {}  # the plans of this round and the next one

    def plan(self, ids: list[int], epoch: int, round_index: int) -> Round:
        """Return the plan of one round of shards."""
        return plan_round(self.lengths.load(ids), ids, epoch=epoch, round_index=round_index, **self.plan_kw)

    def plan_of(self, ids: list[int], epoch: int, round_index: int) -> Round:
        """Return `plan`, made once for the round that is read ahead and then trained."""
        key = (tuple(ids), epoch, round_index)
        if key not in self.planned:
            self.planned = {k: v for k, v in self.planned.items() if k[1:] >= (epoch, round_index)}
            self.planned[key] = self.plan(ids, epoch, round_index)
        return self.planned[key]

    def epoch_steps(self, epoch: int) -> int:
        """Return the steps of a full epoch over the run's training shards."""
        return self.plan(self.state.shards, epoch, 0).steps

    def fresh_total(self) -> int:
        """Take the committed training shards and return the run's planned steps; an error when they plan none."""
        cfg = self.cfg
        committed = set(self.store.committed_ids())
        self.state.shards = [s for s in self.train_ids if s in committed]
        if not self.state.shards:
            raise ConfigError(f"--store {cfg.store}: none of its {len(self.train_ids)} training shards is committed "
                              "yet; run `dflash extract` first, or pass --follow to train while it writes")
        if len(self.state.shards) < len(self.train_ids):
            log.warning("%s: %d of %d training shards are committed; training on those (--follow waits for all)",
                        cfg.store, len(self.state.shards), len(self.train_ids))
        lengths = self.lengths.load(self.state.shards)
        if not any(len(v) for v in lengths.values()):
            # An "untrained checkpoint after 0 steps" would look like success; an empty store is a data problem.
            raise StoreError(
                f"--store {cfg.store}: its {len(self.state.shards)} committed training shards hold 0 samples (0 "
                f"tokens), nothing to train on; re-extract from data with usable rows (`dflash inspect {cfg.store}`)"
            )
        total = planned_total(self.epoch_steps, 0, cfg.epochs, cfg.max_steps)
        if total == 0:
            raise ConfigError(
                f"--store {cfg.store}: {sum(map(len, lengths.values()))} samples plan 0 training steps at "
                f"--batch-tokens {cfg.batch_tokens} on {self.num_slots} slots; extract more data or use fewer slots"
            )
        return total

    def resumed_total(self, total: int) -> int:
        """Return a resumed run's length replanned for the options given now (--epochs, --max-steps)."""
        return planned_total(self.epoch_steps, 1, self.cfg.epochs, self.cfg.max_steps, done=self.first_epoch_steps())

    def first_epoch_steps(self) -> int:
        """Return the steps of the run's first epoch."""
        return self.epoch_steps(0)

    def of_epoch(self, epoch: int, resumed: bool) -> Iterator[tuple[int, Round]]:
        """Yield (index, plan) of each round of the epoch."""
        yield 0, self.plan_of(list(self.state.shards), epoch, 0)

    def upcoming(self, epoch: int, index: int) -> Round | None:
        """Return the plan of the round after round `index` of `epoch` (None if there is none)."""
        return self.plan_of(self.state.shards, epoch + 1, 0) if epoch + 1 < self.cfg.epochs else None

    def ahead_now(self, left: int) -> bool:
        """Return whether to ask for the upcoming round now, with `left` steps of this round to take."""
        return True

    def waiting(self) -> bool:
        """Return True while a next round may still be committed (then `upcoming`'s None is no final answer)."""
        return False

    def end_epoch(self, step: int) -> list[list[int]]:
        """Close an epoch that ended at `step`; return its rounds' shard sets (for the epoch's record)."""
        return [self.state.shards]
