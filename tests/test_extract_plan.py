"""Shard plans and batch packing: pure functions, checked over sizes and seeds."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.errors import ConfigError, InputError
from dflash.extract.header import resolve_layers, resolve_mask_token
from dflash.extract.plan import (claim_order, default_shard_size, make_plan, pack_batches, scan_rows,
                                 shard_ranges)


@pytest.mark.parametrize("num_rows", [0, 1, 7, 100, 1001])
@pytest.mark.parametrize("shard_size", [1, 3, 64, 5000])
def test_shard_ranges_cover_every_row_once(num_rows, shard_size):
    ranges = shard_ranges(num_rows, shard_size)
    rows = [r for a, b in ranges for r in range(a, b)]
    assert rows == list(range(num_rows))
    assert all(0 < b - a <= shard_size for a, b in ranges)


def test_default_shard_size_is_about_two_gb():
    # Qwen3-8B: 5 layers x 4096 x 2 bytes per token; 1,500-token rows -> ~35 rows per 2 GiB.
    n = default_shard_size(1500, 5 * 4096 * 2)
    assert 30 <= n <= 40
    assert default_shard_size(1e9, 10) == 1


def test_a_sharded_targets_shards_hold_two_of_its_batches_and_a_resumed_store_keeps_its_plan():
    from dflash.extract.header import resume_plan

    # A 5,120-wide target's features (51,200 bytes a token): 2 GiB is 41,943 tokens, less than one 64K batch.
    assert default_shard_size(1500, 51200) * 1500 < 65536
    assert default_shard_size(1500, 51200, min_tokens=2 * 65536) * 1500 >= 2 * 65536
    assert default_shard_size(1500, 5 * 4096 * 2, min_tokens=1000) == default_shard_size(1500, 5 * 4096 * 2)
    new = {"shard_plan": {"num_rows": 100, "rows_per_shard": 7, "num_shards": 15}}
    old = {"shard_plan": {"num_rows": 100, "rows_per_shard": 20, "num_shards": 5}}
    assert resume_plan(new, old, None)["shard_plan"] == old["shard_plan"]  # the store's own shards
    assert resume_plan(new, old, 7) == new  # --shard-size asked: compared, and refused if it differs
    assert resume_plan(new, None, None) == new
    assert resume_plan(new, {"shard_plan": {**old["shard_plan"], "num_rows": 99}}, None) == new  # other data


@given(
    lengths=st.lists(st.integers(1, 512), min_size=0, max_size=80),
    budget=st.integers(512, 4096),
)
@settings(max_examples=60, deadline=None)
def test_pack_batches_places_every_sample_once_within_budget(lengths, budget):
    batches = pack_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= budget
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert pack_batches(lengths, budget) == batches  # deterministic


def padding_fraction(lengths: list[int], batches: list[list[int]]) -> float:
    """Return the share of computed token slots that are padding for these batches (0.0 for no batches)."""
    real = sum(lengths[i] for b in batches for i in b)
    computed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 0.0 if computed == 0 else 1.0 - real / computed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_stays_under_two_percent_on_realistic_shards(seed):
    rng = random.Random(seed)
    lengths = [min(4096, max(32, int(rng.lognormvariate(7.1, 0.8)))) for _ in range(40)]
    batches = pack_batches(lengths, 32768)
    assert padding_fraction(lengths, batches) < 0.02


@pytest.mark.parametrize("seed", [0, 1])
def test_a_floor_packs_a_sharded_target_s_small_batches_into_fewer_fuller_forwards(seed):
    # An offloaded target pays a whole pass of its weights on every forward: on 2026-12-05 a 400K-token shard went in
    # 49 forwards of 5-12K tokens and the offloaded Qwen3-32B shape ran at 0.80 of resident.
    rng = random.Random(seed)
    lengths = [min(4001, max(193, int(rng.lognormvariate(7.17, 0.7)))) for _ in range(260)]
    plain = pack_batches(lengths, 65536)
    floored = pack_batches(lengths, 65536, floor_tokens=16384)
    assert sorted(i for b in floored for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 65536 for b in floored)
    assert len(floored) <= len(plain) // 2, (len(floored), len(plain))

    def cost(batches):  # what the forwards take where each pays at least the floor
        return sum(max(len(b) * max(lengths[i] for i in b), 16384) for b in batches)

    assert cost(floored) < 0.85 * cost(plain), (cost(floored), cost(plain))
    assert padding_fraction(lengths, floored) < 0.06
    assert pack_batches(lengths, 65536, floor_tokens=0) == plain


def test_a_sharded_target_s_default_shards_hold_enough_batches_to_pack_with_little_padding():
    # Each shard is packed on its own: under the floor, a shard of two batches mixes long and short rows (11% padding).
    from dflash.extract.placement import SHARDED_BATCH_FLOOR, SHARDED_SHARD_BATCHES

    rng = random.Random(3)
    lengths = [min(4001, max(193, int(rng.lognormvariate(7.17, 0.7)))) for _ in range(1500)]
    batch, floor = 65536, int(65536 * SHARDED_BATCH_FLOOR)

    def padding(batches_a_shard: int) -> float:
        rows = default_shard_size(sum(lengths) / len(lengths), 51200, min_tokens=batches_a_shard * batch)
        shards = [lengths[i:i + rows] for i in range(0, len(lengths), rows)]
        packed = [[[s[i] for i in b] for b in pack_batches(s, batch, floor_tokens=floor)] for s in shards]
        return 1 - sum(lengths) / sum(len(b) * max(b) for p in packed for b in p)

    assert SHARDED_SHARD_BATCHES >= 4
    assert padding(SHARDED_SHARD_BATCHES) < 0.08 < padding(2), (padding(SHARDED_SHARD_BATCHES), padding(2))


def test_a_sharded_target_s_shards_shrink_to_two_batches_rather_than_leave_ranks_few_of_them():
    from dflash.extract.placement import Placement, SHARDED_SHARD_BATCHES, min_shard_tokens

    offloaded, resident = Placement(1, True, 65536, "asked"), Placement(1, False, 32768, "asked")
    assert min_shard_tokens(offloaded, 10**9, 8) == SHARDED_SHARD_BATCHES * 65536
    assert min_shard_tokens(offloaded, 8 * 4 * 3 * 65536, 8) == 3 * 65536  # about four shards for every rank
    assert min_shard_tokens(offloaded, 1000, 8) == 2 * 65536  # never below two batches
    assert min_shard_tokens(offloaded, 1000, 1) == SHARDED_SHARD_BATCHES * 65536  # one rank: no peer waits on it
    assert min_shard_tokens(resident, 10**9, 8) == min_shard_tokens(None, 10**9, 8) == 0


def test_only_a_sharded_or_offloaded_target_s_batches_have_a_floor():
    from dflash.config.extract import ExtractConfig
    from dflash.extract.placement import batch_floor

    base = dict(model="m", data=("d.jsonl",), out="o", gpus="0", batch_tokens=65536)
    assert batch_floor(ExtractConfig(**base, shard_weights="1", offload="cpu")) == 16384
    assert batch_floor(ExtractConfig(**base, shard_weights="2", offload="none")) == 16384
    assert batch_floor(ExtractConfig(**base, shard_weights="1", offload="none")) == 0


def test_pack_batches_refuses_oversized_samples():
    with pytest.raises(ValueError, match="does not fit"):
        pack_batches([10, 600], 512)


def test_layers_and_mask_token_resolution():
    assert resolve_layers(None, 36) == [1, 9, 17, 25, 33]
    assert resolve_layers((2, 4), 8) == [2, 4]
    with pytest.raises(ConfigError, match="decoder layers 0..7"):
        resolve_layers((2, 9), 8)
    assert resolve_mask_token(151936, 151669, None, "m") == 151669
    assert resolve_mask_token(100, 100, 7, "m") == 7
    with pytest.raises(InputError, match="pass --mask-token-id"):
        resolve_mask_token(100, 100, None, "m")
    with pytest.raises(ConfigError, match="outside the target's embedding rows"):
        resolve_mask_token(100, 90, 100, "m")
    assert scan_rows([], 100).tokens_per_row() == 1.0


@pytest.mark.parametrize("num_shards", [0, 1, 5, 12])
@pytest.mark.parametrize("committed", [(), (0,), (1, 3, 4)])
@pytest.mark.parametrize("workers", [1, 2, 8])
def test_claim_order_offers_every_shard_left_once_from_different_starts(num_shards, committed, workers):
    left = [s for s in range(num_shards) if s not in committed]
    orders = [claim_order(num_shards, committed, w) for w in range(workers)]
    assert all(sorted(o) == left for o in orders)
    firsts = [o[0] for o in orders if o]
    assert len(set(firsts)) == min(workers, len(left))


def test_the_plan_hands_workers_the_data_index_not_its_parsed_rows(tmp_path):
    # The plan travels to every spawned worker: it must stay small however long the conversations are.
    import json
    import pickle

    from dflash.conversations import read_rows

    data = tmp_path / "conv.jsonl"
    turn = [{"role": "user", "content": "q" * 5000}, {"role": "assistant", "content": "a" * 5000}]
    data.write_text("".join(json.dumps({"messages": turn}) + "\n" for _ in range(40)) + "not json\n")
    rows = read_rows([str(data)])
    scan = scan_rows(rows, 256)
    assert scan.bad.counts == {"malformed_json": 1} and scan.tokens_per_row() == 256
    header = {"shard_plan": {"num_rows": 41, "rows_per_shard": 6}, "layer_ids": [1, 2], "hidden_size": 8,
              "codec": "none"}
    plan = make_plan(header, rows, scan, [1, 6], str(tmp_path / "store"), ["cpu"])
    assert plan.ranges == tuple(shard_ranges(41, 6)) and plan.left() == [0, 2, 3, 4, 5]
    assert plan.rows_of(plan.left()) == 30 and plan.tokens_left == 30 * 256
    back = pickle.loads(pickle.dumps(plan))
    assert len(pickle.dumps(plan)) < data.stat().st_size // 20
    assert back.shard_rows(6) == (36, 41, rows[36:41]) and back.shard_rows(6)[2][-1].error == "malformed_json"
