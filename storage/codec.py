"""Chunk codecs of the store: Blosc(zstd) / none on the stored integer arrays, and the lossy fp8 feature encoding.

Every chunk a codec writes is exactly what zarr's `bytes` (+ `blosc`) codec chain would write, so the files stay a
valid zarr v3 store while our own reader decodes them straight into the caller's memory.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = [
    "CODECS",
    "BLOSC_CONFIG",
    "FP8_MAX",
    "feature_dtype",
    "encode_chunk",
    "decode_chunk_into",
    "array_metadata",
    "to_fp8",
    "fp8_to_bf16_bits",
    "TRIM_BITS",
    "trim_mantissa",
]

log = logging.getLogger(__name__)

CODECS = ("blosc", "none", "fp8", "bf16m3", "bf16m2", "bf16m1")
# Lossy bf16 codecs that keep this many of bf16's 7 mantissa bits (rounded to nearest even), then the same
# Blosc(zstd, byte shuffle) as blosc: the low byte, nearly random in bf16, becomes mostly zeros; unlike fp8 the values
# need no scales (the exponent is untouched), so the relative error is at most 2^-(m+1) for every normal value,
# outliers included. On the SmolLM2 demo's stored answers (bench/RESULTS.md, 2026-12-05): 0.443x / 0.384x / 0.350x of
# raw bf16 for bf16m3 / bf16m2 / bf16m1 against fp8's 0.417x (relative error 2.6% / 5.1% / 9.9%, fp8 2.1%); byte
# shuffle beat bit shuffle for each, and zstd level 9 gains 2-4% for several times the encode time.
TRIM_BITS = {"bf16m3": 3, "bf16m2": 2, "bf16m1": 1}

# zstd level 1 with byte shuffle and 1 MiB blocks: 1.43x on real bf16 activations at ~0.7 GB/s a core.
# Blosc's default blocksize at clevel 1 loses most of that gain (1.22x), and lz4 gains nothing (DESIGN.md).
BLOSC_CONFIG = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}

# Largest finite float8_e4m3fn value: each (token, layer) row is scaled so its largest magnitude lands here.
FP8_MAX = 448.0


def feature_dtype(codec: str) -> np.dtype:
    """Return the numpy dtype the features array is stored as: uint16 bf16 bits, or uint8 fp8 bits for fp8."""
    return np.dtype(np.uint8) if codec == "fp8" else np.dtype(np.uint16)


def trim_mantissa(bits: np.ndarray, keep: int) -> np.ndarray:
    """Return bf16 bits with all but `keep` mantissa bits rounded off (to nearest, ties to even); inf and NaN
    unchanged, and a finite value never rounds up to inf (it is truncated instead)."""
    drop = 7 - keep
    b = np.ascontiguousarray(bits).astype(np.uint32)
    half = (1 << (drop - 1)) - 1
    rounded = ((b + half + ((b >> drop) & 1)) >> drop << drop) & 0xFFFF
    finite = (b & 0x7F80) != 0x7F80
    overflow = (rounded & 0x7F80) == 0x7F80
    out = np.where(finite & ~overflow, rounded, np.where(finite, b >> drop << drop, b))
    return out.astype(np.uint16)


def encode_chunk(arr: np.ndarray, compressed: bool) -> Any:
    """Return the stored bytes of one whole chunk: the little-endian array bytes, Blosc-compressed if asked."""
    arr = np.ascontiguousarray(arr)
    if not compressed:
        return memoryview(arr).cast("B")
    from numcodecs import blosc

    # typesize must be the element size: on raw bytes shuffle becomes a no-op and the ratio drops to 1.25x.
    return blosc.compress(
        arr,
        BLOSC_CONFIG["cname"].encode(),
        BLOSC_CONFIG["clevel"],
        blosc.SHUFFLE,
        BLOSC_CONFIG["blocksize"],
        typesize=arr.dtype.itemsize,
    )


def decode_chunk_into(stored: Any, dest: np.ndarray, compressed: bool) -> None:
    """Decode one stored chunk into dest (a C-contiguous array of the chunk's shape); ValueError if sizes differ."""
    view = memoryview(dest).cast("B")
    if not compressed:
        src = memoryview(stored).cast("B")
        if len(src) != len(view):
            raise ValueError(f"chunk holds {len(src)} bytes, expected {len(view)}")
        view[:] = src
        return
    from numcodecs import blosc

    nbytes, _, _ = blosc._cbuffer_sizes(stored)
    if nbytes != len(view):
        raise ValueError(f"chunk decompresses to {nbytes} bytes, expected {len(view)}")
    # From a non-main thread numcodecs uses blosc's context API without the GIL, so threads decode in parallel.
    blosc.decompress(stored, view)


def array_metadata(
    shape: list[int], chunk_shape: list[int], dtype: np.dtype, compressed: bool, attributes: dict | None = None
) -> dict:
    """Return the zarr v3 `zarr.json` document of an array with regular chunks and flat `c.i.j.k` chunk files."""
    dtype = np.dtype(dtype)
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}] if dtype.itemsize > 1 else [
        {"name": "bytes"}
    ]
    if compressed:
        codecs.append({"name": "blosc", "configuration": {"typesize": dtype.itemsize, **BLOSC_CONFIG}})
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [int(s) for s in shape],
        "data_type": "bool" if dtype == np.bool_ else dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, int(c)) for c in chunk_shape]}},
        # "." keeps every chunk of an array in one folder: one listing, one folder fsync.
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": False if dtype == np.bool_ else 0,
        "codecs": codecs,
        "attributes": attributes or {},
        "storage_transformers": [],
    }


def to_fp8(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (fp8 e4m3 bits uint8 [t, L, H], float32 scales [t, L]) of bf16 bits [t, L, H]; lossy by design."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float()
    amax = x.abs().amax(dim=-1)
    # Non-finite rows cannot be scaled; a zero row keeps scale 1 so decoding gives exact zeros.
    amax = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    scale = amax / FP8_MAX
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scale.numpy()


def fp8_to_bf16_bits(q: np.ndarray, scale: np.ndarray, dest: np.ndarray) -> None:
    """Write bf16 bits of fp8 values q [t, L, H] times scale [t, L] into dest (uint16 [t, L, H])."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(q)).view(torch.float8_e4m3fn).float()
    x.mul_(torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1))
    torch.from_numpy(dest.view(np.int16)).view(torch.bfloat16).copy_(x)
