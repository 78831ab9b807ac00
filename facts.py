"""DFlash facts shared by extract and train: which target layers feed the drafter, loss-decay constants."""
from __future__ import annotations

from .errors import ConfigError

__all__ = ["NUM_FEATURE_LAYERS", "build_target_layer_ids", "validate_layer_ids", "decay_gamma"]

NUM_FEATURE_LAYERS = 5

# gamma of the per-slot loss weight exp(-(k-1)/gamma), by block size (DFlash paper and reference trainers).
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def build_target_layer_ids(num_target_layers: int, n: int = NUM_FEATURE_LAYERS) -> list[int]:
    """Return n decoder-layer ids evenly spaced from 1 to num_target_layers - 3, rounded as the reference does.

    The feature of id i is the output of decoder layer i, i.e. transformers' output_hidden_states[i + 1].
    Python's round (half to even) is what the reference uses, so 30 layers give [1, 8, 14, 20, 27].
    """
    if n < 1:
        raise ConfigError(f"the number of target layers to capture must be >= 1, got {n}")
    if num_target_layers < 4 and n > 1:
        raise ConfigError(
            f"a target with {num_target_layers} decoder layers is too shallow for {n} DFlash feature layers "
            "(need at least 4); pass --layers explicitly"
        )
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    ids = [int(round(start + i * span / (n - 1))) for i in range(n)]
    if len(set(ids)) < n:  # fewer than n layers between 1 and L-3: the reference would repeat ids
        raise ConfigError(
            f"a target with {num_target_layers} decoder layers is too shallow for {n} distinct DFlash feature layers "
            f"between 1 and {end} (need at least {n + 3}); pass --layers with {n} or fewer distinct ids"
        )
    return ids


def validate_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Return the ids unchanged if they are distinct, increasing decoder-layer ids of the target, else raise."""
    ids = list(layer_ids)
    if not ids:
        raise ConfigError("--layers is empty; pass --layers auto or a comma-separated list such as 1,9,17,25,33")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ConfigError(
            f"--layers {','.join(map(str, ids))} names layers {bad} but the target has decoder layers "
            f"0..{num_target_layers - 1}; pass --layers auto"
        )
    if sorted(set(ids)) != ids:
        raise ConfigError(
            f"--layers {','.join(map(str, ids))} must be distinct and increasing; pass --layers auto"
        )
    return ids


def decay_gamma(block_size: int) -> float:
    """Return gamma of the loss decay for a block size: 7 for 16, 5 for 10, 4 for 8, else a linear fit."""
    if block_size < 2:
        raise ConfigError(f"--block-size must be >= 2, got {block_size}")
    if block_size in _GAMMA_BY_BLOCK:
        return _GAMMA_BY_BLOCK[block_size]
    # Between the published points gamma grows about linearly with the block: 0.4375 * B.
    return round(0.4375 * block_size, 4)
