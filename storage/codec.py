"""Chunk codecs of the store: Blosc(zstd) / none on the stored integer arrays, and the lossy feature encodings (fp8
and the uniform quantizers with a scale a row; the bf16 mantissa trims).

Every chunk a codec writes is exactly what zarr's `bytes` (+ `blosc`) codec chain would write, so the files stay a
valid zarr v3 store while our own reader decodes them straight into the caller's memory.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "resolve_codec",
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
    "QUANT_DIVISORS",
    "SCALED_CODECS",
    "to_uq",
    "uq_to_bf16_bits",
    "encode_scaled",
    "decode_scaled_into",
]

log = logging.getLogger(__name__)

CODECS = ("blosc", "none", "fp8", "uq8", "uq6", "uq4", "bf16m3", "bf16m2", "bf16m1")
# Lossy bf16 codecs that keep this many of bf16's 7 mantissa bits (rounded to nearest even), then the same
# Blosc(zstd, byte shuffle) as blosc: the low byte, nearly random in bf16, becomes mostly zeros; unlike fp8 the values
# need no scales (the exponent is untouched), so the relative error is at most 2^-(m+1) for every normal value,
# outliers included. On the SmolLM2 demo's stored answers (bench/RESULTS.md, 2026-12-05): 0.443x / 0.384x / 0.350x of
# raw bf16 for bf16m3 / bf16m2 / bf16m1 against fp8's 0.417x (relative error 2.6% / 5.1% / 9.9%, fp8 2.1%); byte
# shuffle beat bit shuffle for each, and zstd level 9 gains 2-4% for several times the encode time.
TRIM_BITS = {"bf16m3": 3, "bf16m2": 2, "bf16m1": 1}

# Uniform quantizers: each (token, layer) row becomes integers with one step, the row's median magnitude over this
# divisor, stored zigzagged in uint16 under the same Blosc(zstd, byte shuffle) as blosc, the step beside them as fp8's
# scale. For a linear consumer (the drafter's first layer) an entropy-coded uniform quantizer spends its bits where
# the error is: a float format gives the row's small values as many significant bits as its large ones. The median
# ignores the few huge channels a hidden state carries, so the bulk of a row keeps its precision; a row whose largest
# value would overflow 15 bits (over 32767 steps: for uq6 5,461x the median, as the massive activations of a few
# tokens can be) takes the coarser step amax / 32767. On the SmolLM2 demo's stored answers (bench/
# RESULTS.md, 2026-12-05): uq8 / uq6 / uq4 0.37x / 0.34x / 0.31x of raw bf16 at a relative error a row of 1.3% / 1.7%
# / 2.6%, where fp8 is 0.42x at 2.1% (measured as bench/codec_ab.py does).
QUANT_DIVISORS = {"uq8": 8, "uq6": 6, "uq4": 4}
# A new store's codec (extract --codec auto): the fewest bytes whose drafter's measured tau stays within 1% of the
# lossless store's; on one H200 the GPU demo's uq6 store took 0.346x raw bf16 at 1.030x blosc's measured tau
# (bench/RESULTS.md, 2026-12-05). Stores made before keep theirs (blosc) when resumed.
DEFAULT_CODEC = "uq6"


def resolve_codec(codec: str, recorded: str | None = None) -> str:
    """Return the codec a store is written in: `codec` as asked, or for auto the resumed store's own (`recorded`,
    its header's) where it has one, else DEFAULT_CODEC."""
    if codec != "auto":
        return codec
    return recorded if recorded in CODECS else DEFAULT_CODEC
# Codecs whose features carry a float32 scale (step) a row, in a `feature_scales` array beside them.
SCALED_CODECS = ("fp8", *QUANT_DIVISORS)
ZIGZAG_MAX = 32767  # |q| <= this keeps a zigzagged integer in 16 bits
_UQ_BLOCK = 32
_F32_TINY = float(np.finfo(np.float32).tiny)
_BF16_MAX = 3.3895313892515355e38  # the largest finite bfloat16

# zstd level 1 with byte shuffle and 1 MiB blocks: 1.43x on real bf16 activations at ~0.7 GB/s a core.
# Blosc's default blocksize at clevel 1 loses most of that gain (1.22x), and lz4 gains nothing (DESIGN.md).
BLOSC_CONFIG = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}

# Largest finite float8_e4m3fn value: each (token, layer) row is scaled so its largest magnitude lands here.
FP8_MAX = 448.0


def feature_dtype(codec: str) -> np.dtype:
    """Return the numpy dtype the features array is stored as: uint16 bf16 bits, or uint8 fp8 bits for fp8."""
    return np.dtype(np.uint8) if codec == "fp8" else np.dtype(np.uint16)


# The lossy codecs' arithmetic meets inf and NaN on purpose (a non-finite row decodes to NaN, a value past the
# format's range is clamped): numpy's warnings about them would be noise in every reader and writer thread.
_QUIET = {"over": "ignore", "invalid": "ignore", "divide": "ignore"}


def _float32(bits: np.ndarray) -> np.ndarray:
    """Return bf16 bits (uint16) as float32 values, exactly (a bf16 is a float32's high half)."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _round_off(b: np.ndarray, drop: int) -> np.ndarray:
    """Return uint32 bits b with their low `drop` bits rounded off (to nearest, ties to even), shifted down by them;
    b is left as it is."""
    r = (b >> np.uint32(drop)) & np.uint32(1)
    r += np.uint32((1 << (drop - 1)) - 1)
    r += b
    r >>= np.uint32(drop)
    return r


def _to_bf16_bits(x: np.ndarray, dest: np.ndarray, nan: bool = True) -> None:
    """Write float32 values x as bf16 bits into dest (uint16 of x's shape), rounded to nearest, ties to even, as
    torch's conversion rounds; NaN stays NaN (0x7FC0; nan=False: the caller knows x holds none)."""
    dest[...] = _round_off(x.view(np.uint32), 16)
    if nan:
        where = np.isnan(x)
        if where.any():
            dest[where] = 0x7FC0


def trim_mantissa(bits: np.ndarray, keep: int) -> np.ndarray:
    """Return bf16 bits with all but `keep` mantissa bits rounded off (to nearest, ties to even); inf and NaN
    unchanged, and a finite value never rounds up to inf (it is truncated instead)."""
    drop = 7 - keep
    b = np.ascontiguousarray(bits).astype(np.uint32)
    rounded = (_round_off(b, drop) << np.uint32(drop)) & np.uint32(0xFFFF)
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


def _fp8_bits(x: np.ndarray) -> np.ndarray:
    """Return float8_e4m3fn bits (uint8) of float32 values x, rounded to nearest, ties to even, as torch's conversion
    on the CPU: past 448, inf included, saturate to 448, and NaN stays NaN (0x7F), each with its sign."""
    b = x.view(np.uint32)
    a = b & np.uint32(0x7FFFFFFF)
    sign = (b >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    # Normal results: the exponent rebased from 127 to 7 and the mantissa rounded to 3 bits, in the integer bits.
    normal = a + np.uint32(((7 - 127) << 23) & 0xFFFFFFFF) + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))
    out = (normal >> np.uint32(20)).astype(np.uint8)
    small = a < np.uint32(121 << 23)  # under 2**-6, the smallest normal: multiples of 2**-9 (to nearest, ties even)
    if small.any():
        out[small] = np.rint(a[small].view(np.float32) * np.float32(512)).astype(np.uint8)
    out[a > np.uint32(0x43E00000)] = 0x7E  # 448
    out[a > np.uint32(0x7F800000)] = 0x7F  # NaN
    out |= sign
    return out


def _fp8_table() -> np.ndarray:
    """Return the float32 value of each of the 256 float8_e4m3fn bit patterns."""
    c = np.arange(256, dtype=np.int64)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * np.exp2(e - 7.0))
    mag[(e == 15) & (m == 7)] = np.nan
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


_FP8_VALUES = _fp8_table()


def to_fp8(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (fp8 e4m3 bits uint8 [t, L, H], float32 scales [t, L]) of bf16 bits [t, L, H]; lossy by design."""
    bits = np.ascontiguousarray(bits)
    q = np.empty(bits.shape, np.uint8)
    scales = np.empty(bits.shape[:2], np.float32)
    with np.errstate(**_QUIET):
        for i in range(0, bits.shape[0], _UQ_BLOCK):
            x = _float32(bits[i : i + _UQ_BLOCK])
            amax = np.abs(x).max(axis=-1)
            # Non-finite rows cannot be scaled; a zero row keeps scale 1 so decoding gives exact zeros.
            amax = np.where(np.isfinite(amax) & (amax > 0), amax, np.float32(1))
            scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
            x /= scale[..., None]  # a tiny scale's quotient past float32 is clamped to 448 below, as torch's is
            np.clip(x, np.float32(-FP8_MAX), np.float32(FP8_MAX), out=x)
            q[i : i + _UQ_BLOCK] = _fp8_bits(x)
            scales[i : i + _UQ_BLOCK] = scale
    return q, scales


def fp8_to_bf16_bits(q: np.ndarray, scale: np.ndarray, dest: np.ndarray) -> None:
    """Write bf16 bits of fp8 values q [t, L, H] times scale [t, L] into dest (uint16 [t, L, H])."""
    q, scale = np.ascontiguousarray(q), np.ascontiguousarray(scale, dtype=np.float32)
    with np.errstate(**_QUIET):
        for i in range(0, q.shape[0], _UQ_BLOCK):
            x = _FP8_VALUES[q[i : i + _UQ_BLOCK]]
            x *= scale[i : i + _UQ_BLOCK, :, None]  # as torch's product: inf past float32, NaN stays NaN
            _to_bf16_bits(x, dest[i : i + _UQ_BLOCK])


def to_uq(bits: np.ndarray, divisor: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (zigzagged integers uint16 [t, L, H], float32 steps [t, L]) of bf16 bits [t, L, H]: each row divided by
    its step (its median magnitude / divisor, or amax / 32767 where that is coarser) and rounded to nearest; lossy by
    design. A zero row keeps step 1 (decodes to exact zeros); a row holding NaN or inf gets step NaN (decodes to NaN,
    never to plausible numbers)."""
    bits = np.ascontiguousarray(bits)
    t, _, H = bits.shape
    z = np.empty(bits.shape, np.uint16)
    steps = np.empty(bits.shape[:2], np.float32)
    # The median of every stride-th value: the step needs no more (it is stored), and a full median per row cost
    # more than all the rest of the encoding. The lower of the two middle values where their count is even.
    stride = max(1, H // 256)
    middle = (len(range(0, H, stride)) - 1) // 2
    with np.errstate(**_QUIET):
        for i in range(0, t, _UQ_BLOCK):
            x = _float32(bits[i : i + _UQ_BLOCK])
            amax = np.maximum(x.max(axis=-1), -x.min(axis=-1))
            median = np.partition(np.abs(x[..., ::stride]), middle, axis=-1)[..., middle]
            step = np.maximum(median / np.float32(divisor), amax / np.float32(ZIGZAG_MAX))
            # A positive step stays a normal float32, so 1 / step is finite (a row of values under 1e-34 rounds to
            # 0).
            step = np.where(step > 0, np.maximum(step, np.float32(_F32_TINY)), np.float32(1)).astype(np.float32)
            finite = np.isfinite(amax)
            if not finite.all():
                x[~finite] = 0
                step[~finite] = np.nan
            steps[i : i + _UQ_BLOCK] = step
            inv = np.where(finite, np.float32(1) / step, np.float32(0)).astype(np.float32)
            x *= inv[..., None]
            np.rint(x, out=x)
            np.clip(x, np.float32(-ZIGZAG_MAX), np.float32(ZIGZAG_MAX), out=x)
            q = x.astype(np.int32)
            # Zigzag (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...): small magnitudes get small high bytes, which byte shuffle
            # and zstd then store in almost nothing; the cast to 16 bits keeps the low 16 of them.
            q = (q << 1) ^ (q >> 31)
            z[i : i + _UQ_BLOCK] = q.astype(np.uint16)
    return z, steps


def uq_to_bf16_bits(z: np.ndarray, step: np.ndarray, dest: np.ndarray) -> None:
    """Write bf16 bits of zigzagged integers z [t, L, H] (uint16) times step [t, L] into dest (uint16 [t, L, H])."""
    z, step = np.ascontiguousarray(z), np.ascontiguousarray(step, dtype=np.float32)
    with np.errstate(**_QUIET):
        for i in range(0, z.shape[0], _UQ_BLOCK):
            u = z[i : i + _UQ_BLOCK].astype(np.int32)
            sign = -(u & 1)
            u >>= 1
            u ^= sign
            v = u.astype(np.float32)
            v *= step[i : i + _UQ_BLOCK, :, None]  # clamped below
            # Rounding to nearest may take a value near bf16's largest half a step past it: clamp it there, not to
            # inf.
            np.clip(v, np.float32(-_BF16_MAX), np.float32(_BF16_MAX), out=v)
            _to_bf16_bits(v, dest[i : i + _UQ_BLOCK], nan=False)
    nan = np.isnan(step)  # the integers are finite: only a row stored with step NaN (it held NaN or inf) decodes to NaN
    if nan.any():
        dest[nan] = 0x7FC0


def encode_scaled(bits: np.ndarray, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (the stored feature array, float32 scales [t, L]) of bf16 bits [t, L, H] under a scaled codec."""
    if codec == "fp8":
        return to_fp8(bits)
    return to_uq(bits, QUANT_DIVISORS[codec])


def decode_scaled_into(codec: str, stored: np.ndarray, scales: np.ndarray, dest: np.ndarray) -> None:
    """Write bf16 bits of a scaled codec's stored features [t, L, H] with their scales [t, L] into dest."""
    if codec == "fp8":
        fp8_to_bf16_bits(stored, scales, dest)
    else:
        uq_to_bf16_bits(stored, scales, dest)
