"""Round and epoch boundaries start warm: the next round's first shards are read while the current round ends,
without changing a batch, a loss or what a resumed run takes."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import TrainConfig
from dflash.storage import Store
from dflash.train.metrics import read_metrics
from dflash.train.plan import LoaderState, plan_round, split_shards
from test_train_run import losses, opts


def wait_begun(prefetch: Any, rnd: int, timeout: float) -> bool:
    """Wait until the prefetcher has begun a read of round `rnd`; return whether it has."""
    with prefetch.cond:
        prefetch.cond.wait_for(lambda: prefetch.stop or any(r == rnd for r, _ in prefetch.started), timeout)
        return any(r == rnd for r, _ in prefetch.started)


def run_trainer(kw: dict) -> "object":
    """Train in this process and return the Trainer (to look at its streams afterwards)."""
    from dflash.train.loop import Trainer
    from dflash.train.run_folder import preflight

    cfg = TrainConfig(**kw)
    preflight(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.release()
    return trainer


def batches_equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


def test_the_next_epochs_first_shard_is_read_before_this_epochs_last_batch_is_yielded(store):  # noqa: F811
    from dflash.train.packing import max_blocks_for
    from dflash.train.plan import ShardLengths
    from dflash.train.stream import RoundStream, RoundStreams, StreamSpec

    st = Store.open(store)
    ids = st.committed_ids()
    lengths = ShardLengths(st, False).load(ids)
    epochs = 3
    plans = [plan_round(lengths, ids, num_slots=1, seed=0, epoch=e, round_index=0, batch_tokens=256,
                        buffer_tokens=1024) for e in range(epochs)]
    assert all(p.steps >= 3 for p in plans)
    spec = StreamSpec(slots=[0], seed=0, block_size=8, mask_token_id=st.header["mask_token_id"], anchors=32,
                      max_blocks=max_blocks_for(256), device=torch.device("cpu"), depth=1)
    streams = RoundStreams(st, spec)
    got = []
    try:
        for e, plan in enumerate(plans):
            s = streams.open(plan, epoch=e, step_offset=0, start=0)
            if e + 1 < epochs:
                streams.read_ahead(plans[e + 1])
            items = [s.get()[0] for _ in range(plan.steps - 1)]
            if e + 1 < epochs:
                # The last batch is still unconsumed: the next epoch's first shard read has begun already.
                assert wait_begun(s.prefetch, s.rnd + 1, timeout=60), "the next epoch's shards were not read ahead"
                assert s.prefetch.started.index((s.rnd + 1, plans[e + 1].batches[0][0][0][0])) > 0
            items.append(s.get()[0])
            assert s.get()[0] is None
            streams.end()
            got.append(items)
    finally:
        streams.close()
    assert streams.handed == epochs - 1  # every later epoch's stream took over shards read ahead for it
    for e, plan in enumerate(plans):  # the same batches as a stream of its own, started cold
        cold = RoundStream(st, plan, spec, epoch=e, step_offset=0, start=0)
        try:
            want = [cold.get()[0] for _ in range(plan.steps)]
        finally:
            cold.close()
        assert [x.step_in_epoch for x in got[e]] == [x.step_in_epoch for x in want]
        assert all(batches_equal(a, b) for x, y in zip(got[e], want) for a, b in zip(x.micro, y.micro))


@pytest.mark.parametrize("follow", [False, True])
def test_read_ahead_leaves_every_step_and_loss_of_a_multi_epoch_run_unchanged(store, tiny_qwen3, tmp_path,  # noqa: F811
                                                                                monkeypatch, follow):
    from dflash.train.loop import Trainer

    kw = dict(epochs=3, batch_tokens=256, save_every=100, follow=follow)
    on = run_trainer(opts(store, tiny_qwen3, tmp_path / "on", **kw))
    assert on.streams.handed == 2  # epochs 1 and 2 (following: after the one round of a complete store) began warm
    monkeypatch.setattr(Trainer, "read_ahead", False)
    off = run_trainer(opts(store, tiny_qwen3, tmp_path / "off", **kw))
    assert off.streams.handed == 0
    assert losses(tmp_path / "on") == losses(tmp_path / "off") and len(losses(tmp_path / "on")) > 6
    last = len(losses(tmp_path / "on"))
    a, b = ((tmp_path / r / "checkpoints" / f"step-{last:06d}" / "model.safetensors").read_bytes() for r in ("on", "off"))
    assert a == b


def test_resuming_next_to_an_epoch_boundary_takes_exactly_the_uninterrupted_steps(store, tiny_qwen3, tmp_path):  # noqa: F811
    kw = dict(epochs=2, batch_tokens=256, save_every=1, keep=1000)
    full = tmp_path / "full"
    run_trainer(opts(store, tiny_qwen3, full, **kw))
    expected = losses(full)
    boundary = [r for r in read_metrics(full) if r.get("event") == "epoch_end"][0]["step"]
    assert 2 <= boundary < len(expected) - 2
    for at in (boundary - 1, boundary, boundary + 1):  # the last step of epoch 0, its end, the first of epoch 1
        run = tmp_path / f"at-{at}"
        shutil.copytree(full, run)
        for folder in (run / "checkpoints").iterdir():  # as if killed right after the checkpoint of step `at`
            if folder.name.startswith("step-") and int(folder.name[5:]) > at:
                shutil.rmtree(folder)
        run_trainer(opts(store, tiny_qwen3, run, resume=True, **kw))
        assert losses(run) == expected
        last = f"step-{len(expected):06d}"
        assert (run / "checkpoints" / last / "model.safetensors").read_bytes() == \
            (full / "checkpoints" / last / "model.safetensors").read_bytes()


def test_follow_looks_ahead_only_at_committed_shards_and_trains_the_round_it_found_next(store, tmp_path):  # noqa: F811
    from dflash.train.dist import Dist
    from dflash.train.follow import CommitWatch

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    held = tmp_path / "held"
    held.mkdir()
    commits = sorted((copy / "commits").glob("*.json"))
    (copy / "complete.json").rename(held / "complete.json")
    for f in commits:  # extraction has committed nothing yet
        f.rename(held / f.name)
    st = Store.open(str(copy))
    train_ids, _ = split_shards(st.num_shards, 0.2)

    def commit(n: int) -> None:
        for f in sorted(held.glob("0*.json"))[:n]:
            f.rename(copy / "commits" / f.name)

    while len(set(train_ids) & set(st.committed_ids())) < 2:  # enough for a first round of two slots
        commit(1)
    state = LoaderState(world_size=1, num_slots=2, seed=0)
    rounds = CommitWatch(st, Dist(0, 1, torch.device("cpu")), state, train_ids, num_slots=2)
    it = iter(rounds)
    first = next(it)
    assert set(first) <= set(st.committed_ids())
    assert rounds.ahead() is None  # nothing new committed yet: no round to read ahead
    while len(set(train_ids) & (set(st.committed_ids()) - set(first))) < 2:
        commit(1)
    found = rounds.ahead()
    committed = set(st.committed_ids())
    assert found and set(found) <= committed and not set(found) & set(first)
    assert state.rounds == [first, found] and rounds.ahead() == found  # recorded once: a checkpoint replays it
    commit(len(list(held.glob("0*.json"))))
    assert next(it) == found  # the round read ahead is the one trained next, whatever came since
    (held / "complete.json").rename(copy / "complete.json")
    rest = rounds.ahead()
    assert sorted(first + found + rest) == train_ids
    assert next(it) == rest and rounds.ahead() == "done"
    with pytest.raises(StopIteration):
        next(it)
