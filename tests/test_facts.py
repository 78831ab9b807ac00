"""Shared DFlash facts: target layer selection and loss-decay constants."""
from __future__ import annotations

import pytest

from dflash.errors import ConfigError
from dflash.facts import build_target_layer_ids, decay_gamma, validate_layer_ids


@pytest.mark.parametrize(
    "layers,expected",
    [
        (36, [1, 9, 17, 25, 33]),  # Qwen3-8B
        (64, [1, 16, 31, 46, 61]),  # Qwen3-32B
        (30, [1, 8, 14, 20, 27]),  # SmolLM2-135M: 7.5 -> 8 and 20.5 -> 20 (round half to even)
        (8, [1, 2, 3, 4, 5]),
    ],
)
def test_layer_ids(layers, expected):
    ids = build_target_layer_ids(layers)
    assert ids == expected
    assert ids[0] == 1 and ids[-1] == layers - 3


def test_single_layer_and_too_shallow():
    assert build_target_layer_ids(36, 1) == [18]
    with pytest.raises(ConfigError, match="too shallow"):
        build_target_layer_ids(3)
    # 6 layers leave 1..3 for 5 ids: the reference's [1, 2, 2, 2, 3] would feed the drafter one layer three times.
    for shallow in (6, 7):
        with pytest.raises(ConfigError, match="too shallow for 5 distinct"):
            build_target_layer_ids(shallow)


def test_auto_ids_are_always_distinct_and_increasing():
    for layers in range(8, 257):
        ids = build_target_layer_ids(layers)
        assert ids == sorted(set(ids)) and len(ids) == 5 and ids[-1] == layers - 3, (layers, ids)


def test_validate_layer_ids():
    assert validate_layer_ids([1, 9, 17], 36) == [1, 9, 17]
    with pytest.raises(ConfigError, match=r"names layers \[36\]"):
        validate_layer_ids([1, 36], 36)
    with pytest.raises(ConfigError, match="distinct and increasing"):
        validate_layer_ids([9, 1], 36)


def test_decay_gamma():
    assert (decay_gamma(16), decay_gamma(10), decay_gamma(8)) == (7.0, 5.0, 4.0)
    with pytest.raises(ConfigError):
        decay_gamma(1)
