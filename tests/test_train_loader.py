"""Pure planning of training data: split, epoch order, balanced slots, equal steps, each sample at most once."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dflash.errors import ConfigError
from dflash.train.plan import (
    LoaderState,
    assign_shards,
    batch_seed,
    epoch_order,
    plan_round,
    plan_slot,
    split_shards,
)
from dflash.train.learner import lr_factor


def fake_lengths(num_shards: int, seed: int) -> dict[int, np.ndarray]:
    """Return ragged sample lengths per shard, shards of very different sizes (as real stores have at the tail)."""
    rng = np.random.default_rng(seed)
    return {s: rng.integers(1, 900, size=int(rng.integers(1, 40))) for s in range(num_shards)}


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_epoch_order_is_a_pure_function_of_ids_seed_and_epoch(seed):
    ids = [5, 3, 11, 0, 8, 2, 9]
    a = epoch_order(ids, seed, 0)
    assert a == epoch_order(list(reversed(ids)), seed, 0)  # the listing order does not matter
    assert sorted(a) == sorted(ids)
    assert a != epoch_order(ids, seed, 1) or a != epoch_order(ids, seed, 2)
    assert a != epoch_order(ids, seed + 100, 0) or a != epoch_order(ids, seed + 200, 0)
    # Anchor seeds depend on where a micro-batch sits in the run (epoch, step, slot), never on the rank.
    assert batch_seed(seed, 0, 3, 1) == batch_seed(seed, 0, 3, 1) != batch_seed(seed, 0, 3, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 3])
def test_plan_gives_every_slot_the_same_steps_and_each_sample_at_most_once(world, seed):
    lengths = fake_lengths(13, seed)
    kw = dict(num_slots=world, seed=seed, batch_tokens=2048, buffer_tokens=4096, epoch=2, round_index=0)
    plan = plan_round(lengths, sorted(lengths), **kw)
    assert plan == plan_round(dict(reversed(list(lengths.items()))), list(reversed(sorted(lengths))), **kw)
    assert all(len(b) >= plan.steps for b in plan.batches)
    # Every shard goes to exactly one slot, and the slots are balanced to within the largest shard.
    placed = sorted(s for slot in plan.slot_shards for s in slot)
    assert placed == sorted(lengths)
    loads = [sum(int(lengths[s].sum()) for s in slot) for slot in plan.slot_shards]
    assert max(loads) - min(loads) <= max(int(v.sum()) for v in lengths.values())
    # Samples come only from the slot's own shards, each at most once; used + dropped == all of them.
    used = []
    for slot, batches in zip(plan.slot_shards, plan.batches):
        for batch in batches[: plan.steps]:
            assert sum(n for _, _, n in batch) <= 2048
            assert all(sid in slot for sid, _, _ in batch)
            used += [(sid, idx) for sid, idx, _ in batch]
    assert len(used) == len(set(used))
    total = sum(len(v) for v in lengths.values())
    assert len(used) + plan.dropped_samples == total
    assert plan.steps >= 1


def test_shuffle_buffer_mixes_shards_and_long_samples_are_cut():
    shards = [(0, [100] * 20), (1, [100] * 20), (2, [5000])]
    batches = plan_slot(shards, batch_tokens=1000, buffer_tokens=1500, seed=(0,))
    flat = [x for b in batches for x in b]
    assert sorted((s, i) for s, i, _ in flat) == sorted([(0, i) for i in range(20)] + [(1, i) for i in range(20)] + [(2, 0)])
    assert (2, 0, 1000) in flat  # cut to the batch budget
    order = [s for s, _, _ in flat]
    first_one = order.index(1)
    assert 0 in order[first_one:], "samples of shard 0 should still be leaving the buffer after shard 1 arrives"


@pytest.mark.parametrize("n", [1, 2, 3, 10, 57])
def test_split_holds_out_by_id_and_always_trains(n):
    train, val = split_shards(n, 0.1)
    assert sorted(train + val) == list(range(n)) and not set(train) & set(val)
    assert len(train) >= 1 and len(val) == min(n - 1, max(1, round(0.1 * n)))
    assert (train, val) == split_shards(n, 0.1)
    assert split_shards(n, 0.0) == (list(range(n)), [])


def test_assign_keeps_epoch_order_within_a_slot():
    ordered = [(4, 10), (1, 50), (3, 10), (0, 30), (2, 10)]
    slots = assign_shards(ordered, 2)
    pos = {s: k for k, (s, _) in enumerate(ordered)}
    for slot in slots:
        assert slot == sorted(slot, key=pos.__getitem__)
    assert sorted(sum(slots, [])) == [0, 1, 2, 3, 4]


def test_loader_state_round_trips_and_refuses_another_world():
    state = LoaderState(world_size=2, num_slots=4, seed=3, epoch=1, step_in_epoch=17, shards=[1, 2], rounds=[[1], [2]])
    saved = state.state_dict()
    assert saved["version"] == 1 and saved["cursor"] == 17
    other = LoaderState(world_size=2, num_slots=4, seed=3)
    other.load_state_dict(saved, "ckpt")
    assert other == state
    # Another world with the same slots takes the same batches (elastic resume); other slots do not.
    elastic = LoaderState(world_size=1, num_slots=4, seed=3)
    elastic.load_state_dict(saved, "ckpt")
    assert (elastic.epoch, elastic.step_in_epoch, elastic.rounds) == (1, 17, [[1], [2]])
    with pytest.raises(ConfigError, match="num_slots 4, this run has 6"):
        LoaderState(world_size=3, num_slots=6, seed=3).load_state_dict(saved, "ckpt")
    with pytest.raises(ConfigError, match="seed"):
        LoaderState(world_size=2, num_slots=4, seed=4).load_state_dict(saved, "ckpt")
    with pytest.raises(ConfigError, match="version"):
        other.load_state_dict({**saved, "version": 99}, "ckpt")


def test_schedule_warms_up_then_follows_a_cosine_to_zero():
    total = 100
    f = [lr_factor(s, total, 0.04) for s in range(total + 1)]
    assert f[0] == pytest.approx(0.25) and f[3] == pytest.approx(1.0)
    assert f[4] == pytest.approx(1.0) and f[total] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[3:], f[4:]))
    assert f[52] == pytest.approx(0.5 * (1 + math.cos(math.pi * 48 / 96)))
