"""Deterministic synthetic shards for tests and benchmarks (token ids, loss masks and LLM-like bf16 feature bits),
and one sample of a shard read back alone."""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["activation_bits", "synthetic_sample", "write_synthetic_shard", "read_sample"]


def activation_bits(rng: np.random.Generator, t: int, num_layers: int, hidden: int) -> np.ndarray:
    """Return bf16 bits uint16 [t, L, H] shaped like residual-stream activations: Gaussian rows whose scale grows
    with depth, a few persistent outlier channels, per-token scale jitter (numpy only, no torch)."""
    x = rng.standard_normal((t, num_layers, hidden), dtype=np.float32)
    x *= (1.0 + np.arange(num_layers, dtype=np.float32))[None, :, None]
    # Real activations have a handful of channels tens of times larger than the rest, fixed across tokens.
    outliers = rng.choice(hidden, size=max(1, hidden // 256), replace=False)
    x[:, :, outliers] *= 30.0
    x *= rng.lognormal(0.0, 0.3, size=(t, 1, 1)).astype(np.float32)
    return float32_to_bf16_bits(x)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Return the bf16 bits (round to nearest even) of a float32 array, as uint16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = u + (0x7FFF + ((u >> 16) & 1))
    bits = (rounded >> 16).astype(np.uint16)
    # NaN must stay NaN: rounding could carry a NaN payload into infinity.
    nan = np.isnan(x)
    bits[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return bits


def synthetic_sample(
    shard_id: int, index: int, num_layers: int, hidden: int, max_len: int = 300
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (input_ids int32 [t], loss_mask bool [t], feature bits uint16 [t, L, H]) fixed by (shard, index)."""
    rng = np.random.default_rng([shard_id, index])
    t = int(rng.integers(1, max_len + 1))
    ids = rng.integers(0, 50000, size=t, dtype=np.int32)
    mask = np.zeros(t, np.bool_)
    mask[int(rng.integers(0, t)) :] = True
    return ids, mask, activation_bits(rng, t, num_layers, hidden)


def write_synthetic_shard(store, shard_id: int, num_samples: int, max_len: int = 300) -> dict | None:
    """Return the commit record of a shard filled with synthetic samples, or None if it could not be claimed."""
    L, H = len(store.header["layer_ids"]), int(store.header["hidden_size"])
    writer = store.try_claim(shard_id)
    if writer is None:
        return None
    with writer:
        for i in range(num_samples):
            ids, mask, bits = synthetic_sample(shard_id, i, L, H, max_len)
            writer.append(ids, mask, bits, sample_id=shard_id * 1_000_000 + i)
        return writer.commit({"synthetic": True})


def read_sample(store, shard_id: int, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (input_ids, loss_mask, feature bits uint16 [t, L, H]) of one sample of a committed shard, reading only
    the feature chunks its rows span (a range that starts and ends inside chunks: the reader's partial path)."""
    from dflash.storage.reader import read_features, read_small

    record = store.commit_record(shard_id)
    offsets = read_small(store.fs, shard_id, record, "offsets")
    s, e = int(offsets[index]), int(offsets[index + 1])
    bits = np.empty((e - s, len(store.header["layer_ids"]), int(store.header["hidden_size"])), np.uint16)
    read_features(store.fs, shard_id, record, s, e, bits)
    ids = read_small(store.fs, shard_id, record, "input_ids")[s:e]
    return ids, read_small(store.fs, shard_id, record, "loss_mask")[s:e], bits
