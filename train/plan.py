"""Pure planning of training data: held-out split, epoch order, shard-to-slot assignment, batch plans, loader state.

Everything here is a function of numbers (shard ids, sample lengths, seed, epoch), never of timing or world state,
so every rank computes the same plan on its own and a resumed run replays the killed run's batches exactly.
ShardLengths is the one reader of those numbers: each shard's sample lengths, read once from the store.

A *slot* is one stream of micro-batches: world_size * grad_accum of them. Step s of an epoch takes micro-batch s
of every slot; rank r serves slots r*grad_accum .. r*grad_accum + grad_accum - 1. The global batch therefore
depends only on the number of slots, so 2 ranks x 1 micro-batch == 1 rank x 2 micro-batches.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError, CorruptShard

if TYPE_CHECKING:
    from ..storage import Store

__all__ = [
    "planned_total",
    "LOADER_STATE_VERSION",
    "Sample",
    "Round",
    "split_shards",
    "epoch_order",
    "assign_shards",
    "plan_slot",
    "plan_round",
    "batch_seed",
    "LoaderState",
    "ShardLengths",
]

log = logging.getLogger(__name__)

LOADER_STATE_VERSION = 1

# (shard id, sample index in the shard, tokens used: the sample's length, cut to the batch budget)
Sample = tuple[int, int, int]


def auto_val_count(num_shards: int) -> int:
    """Return the held-out shards of `--val-fraction auto`: 2% of the plan, 1 to 8, none below 20 shards."""
    return 0 if num_shards < 20 else min(8, max(1, round(0.02 * num_shards)))


def split_shards(num_shards: int, val_fraction: float | None,
                 held_out: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """Return (train ids, held-out ids) of a shard plan: the held_out ids when given (--val-shards), else a fixed
    pseudo-random pick by shard id alone.

    At least one shard is held out when val_fraction > 0 and at least one always trains, so a store of one or
    two shards still trains; None is auto_val_count's number. The pick depends on nothing but (num_shards,
    val_fraction): a run, `dflash eval` and the demo all see the same split.
    """
    if num_shards < 1:
        raise ConfigError(f"a store needs at least one shard to train on, its plan has {num_shards}")
    if held_out is not None:
        val = sorted({int(i) for i in held_out})
        if val and (val[0] < 0 or val[-1] >= num_shards):
            raise ConfigError(f"--val-shards {','.join(map(str, val))}: the store's plan has shards 0..{num_shards - 1}; "
                              "pass ids inside it")
        if len(val) >= num_shards:
            raise ConfigError(f"--val-shards holds out all {num_shards} shards, leaving none to train on; hold out fewer")
        return [i for i in range(num_shards) if i not in set(val)], val
    n_val = 0
    if val_fraction is None:
        n_val = auto_val_count(num_shards)
    elif val_fraction > 0:
        n_val = min(num_shards - 1, max(1, int(round(val_fraction * num_shards))))
    # A multiplicative hash spreads held-out ids over the whole plan (early and late source rows alike).
    ranked = sorted(range(num_shards), key=lambda i: ((i * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF, i))
    val = sorted(ranked[:n_val])
    return [i for i in range(num_shards) if i not in set(val)], val


def epoch_order(shard_ids: Sequence[int], seed: int, epoch: int) -> list[int]:
    """Return the shard ids in the order of an epoch: a permutation fixed by (sorted ids, seed, epoch)."""
    ids = sorted(int(i) for i in shard_ids)
    perm = np.random.default_rng([int(seed), int(epoch), 0x5EED]).permutation(len(ids))
    return [ids[i] for i in perm]


def assign_shards(ordered: Sequence[tuple[int, int]], num_slots: int) -> list[list[int]]:
    """Return the shard ids of each slot, balanced by tokens, each slot keeping the given order.

    ordered: (shard id, tokens) in epoch order. Largest shards are placed first, each on the slot with the fewest
    tokens so far (ties: lowest slot), which keeps the imbalance below one shard's size.
    """
    pos = {sid: k for k, (sid, _) in enumerate(ordered)}
    loads = [0] * num_slots
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    for sid, tokens in sorted(ordered, key=lambda st: (-st[1], pos[st[0]])):
        j = min(range(num_slots), key=lambda k: (loads[k], k))
        slots[j].append(sid)
        loads[j] += tokens
    return [sorted(s, key=pos.__getitem__) for s in slots]


def plan_slot(
    shards: Sequence[tuple[int, Sequence[int]]], batch_tokens: int, buffer_tokens: int, seed: Sequence[int]
) -> list[list[Sample]]:
    """Return the micro-batches of one slot: its shards streamed in order through a shuffle buffer, then packed.

    shards: (shard id, sample lengths). Samples of a shard enter in a random order; once the buffer holds more
    than buffer_tokens, a random sample leaves it for the packer, which fills a batch up to batch_tokens and
    starts the next one when a sample does not fit. A sample longer than batch_tokens is cut to it.
    """
    rng = np.random.default_rng([int(s) for s in seed])
    batches: list[list[Sample]] = []
    cur: list[Sample] = []
    cur_tokens = 0
    buffer: list[Sample] = []
    held = 0

    def pack(s: Sample) -> None:
        nonlocal cur, cur_tokens
        if cur and cur_tokens + s[2] > batch_tokens:
            batches.append(cur)
            cur, cur_tokens = [], 0
        cur.append(s)
        cur_tokens += s[2]

    def pop() -> Sample:
        nonlocal held
        j = int(rng.integers(len(buffer)))
        buffer[j], buffer[-1] = buffer[-1], buffer[j]
        s = buffer.pop()
        held -= s[2]
        return s

    for sid, lengths in shards:
        for idx in rng.permutation(len(lengths)):
            n = min(int(lengths[idx]), batch_tokens)
            if n < 1:
                continue
            buffer.append((int(sid), int(idx), n))
            held += n
            while held > buffer_tokens:
                pack(pop())
    while buffer:
        pack(pop())
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Round:
    """The plan of one set of shards: the slots' shards and micro-batches, cut to the same number of steps.

    In a normal epoch there is one round holding every training shard; in the first epoch of follow mode there is
    one per set of newly committed shards the ranks agreed on.
    """

    shards: list[int]
    slot_shards: list[list[int]]
    batches: list[list[list[Sample]]]  # [slot][step] -> samples
    steps: int
    dropped_samples: int
    dropped_tokens: int


def plan_round(
    lengths: dict[int, Sequence[int]],
    shard_ids: Sequence[int],
    *,
    num_slots: int,
    seed: int,
    epoch: int,
    round_index: int,
    batch_tokens: int,
    buffer_tokens: int,
) -> Round:
    """Return the plan of one round: shards in epoch order, assigned to slots, packed, cut to the shortest slot.

    Cutting every slot to the shortest keeps all ranks in step (no DDP hang at the tail); the samples cut off are
    counted, not used (a sample is used at most once per epoch).
    """
    ordered = epoch_order(shard_ids, seed, epoch * 1_000_003 + round_index)
    slot_shards = assign_shards([(s, int(np.sum(lengths[s]))) for s in ordered], num_slots)
    batches = [
        plan_slot([(s, lengths[s]) for s in mine], batch_tokens, buffer_tokens, (seed, epoch, round_index, k))
        for k, mine in enumerate(slot_shards)
    ]
    steps = min(len(b) for b in batches) if batches else 0
    dropped = [x for b in batches for batch in b[steps:] for x in batch]
    return Round(
        shards=sorted(int(s) for s in shard_ids),
        slot_shards=slot_shards,
        batches=batches,
        steps=steps,
        dropped_samples=len(dropped),
        dropped_tokens=sum(x[2] for x in dropped),
    )


def batch_seed(seed: int, epoch: int, step_in_epoch: int, slot: int) -> int:
    """Return the anchor-sampling seed of one micro-batch: fixed by where it sits in the run, not by the rank."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(step_in_epoch), int(slot)]).generate_state(1)[0])


@dataclass
class LoaderState:
    """Where the loader stands: epoch, steps done in it, its shards, and (follow mode) the shard sets of its rounds."""

    world_size: int
    num_slots: int
    seed: int
    epoch: int = 0
    step_in_epoch: int = 0
    shards: list[int] = field(default_factory=list)  # the training shards of full epochs
    rounds: list[list[int]] = field(default_factory=list)  # follow mode, first epoch only
    follow_done: bool = False

    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain values, with its format version."""
        return {
            "version": LOADER_STATE_VERSION,
            "world_size": self.world_size,
            "num_slots": self.num_slots,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.step_in_epoch,
            "shards": list(self.shards),
            "rounds": [list(r) for r in self.rounds],
            "follow_done": self.follow_done,
        }

    def load_state_dict(self, state: dict[str, Any], where: str = "") -> None:
        """Take a saved state; ConfigError naming the field (and `where` it came from) if it was made for another
        version, slot count or seed. Another world size is fine: batches are a function of the slots alone."""
        where = f"{where}: " if where else ""
        if state.get("version") != LOADER_STATE_VERSION:
            raise ConfigError(
                f"{where}loader state version {state.get('version')!r}, this dflash reads "
                f"{LOADER_STATE_VERSION}; resume with the dflash version that wrote it or start a new --out"
            )
        for key, mine in (("num_slots", self.num_slots), ("seed", self.seed)):
            if state.get(key) != mine:
                raise ConfigError(
                    f"{where}loader state was saved with {key} {state.get(key)!r}, this run has {mine!r}; "
                    f"resume with GPUs x --grad-accum = {state.get('num_slots')!r} and the same --seed, or start "
                    "a new --out"
                )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["cursor"])
        self.shards = [int(s) for s in state.get("shards", [])]
        self.rounds = [[int(s) for s in r] for r in state.get("rounds", [])]
        self.follow_done = bool(state.get("follow_done", False))


def planned_total(epoch_steps: Callable[[int], int], first_epoch: int, epochs: int, max_steps: int,
                  done: int = 0) -> int:
    """Return the run's total steps: `done` plus the planned steps of epochs first_epoch.., capped by max_steps.

    Epochs are planned only until the cap is reached: a run of --epochs 100000 --max-steps 700 plans ~90 epochs,
    not 100,000 (which took minutes before its first step).
    """
    total = done
    for e in range(first_epoch, epochs):
        if max_steps and total >= max_steps:
            break
        total += epoch_steps(e)
    return min(total, max_steps) if max_steps else total


class ShardLengths:
    """Sample lengths of each shard, read once from its small `offsets` array (corrupt shards: none, counted)."""

    def __init__(self, store: "Store", skip_corrupt: bool) -> None:
        self.store, self.skip_corrupt = store, skip_corrupt
        self.cache: dict[int, np.ndarray] = {}
        self.corrupt: dict[int, str] = {}

    def __getitem__(self, sid: int) -> np.ndarray:
        if sid not in self.cache:
            try:
                self.cache[sid] = self.store.sample_lengths(sid)
            except CorruptShard as e:
                if not self.skip_corrupt:
                    raise CorruptShard(f"{e}; or rerun `dflash train` with --skip-corrupt to train without it") from None
                log.warning("skipping corrupt shard (--skip-corrupt): %s", e)
                self.corrupt[sid] = str(e)
                self.cache[sid] = np.zeros(0, np.int64)
        return self.cache[sid]

    def load(self, ids: list[int]) -> dict[int, np.ndarray]:
        """Return {id: lengths} for the shards."""
        return {s: self[s] for s in ids}
