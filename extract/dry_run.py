"""The plan of an extract run before its first byte: samples, tokens and drops (the workers' own tokenization), the
store's projected size (the target run on a few real batches, encoded with the store's codec), the free space where
it goes, and projected times; `dflash extract` refuses to start when the store would not fit."""
from __future__ import annotations

import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError
from ..runtime import Progress, format_eta
from .plan import shard_ranges
from .worker import open_pipeline, prepare_shard

__all__ = ["ExtractPlan", "make_plan", "estimate_plan", "format_plan", "check_fits", "free_space"]

log = logging.getLogger(__name__)

# Tokens of the few real batches the target runs to measure bytes per token and its rate.
MEASURE_TOKENS = 16384
# A commit record's size besides its per-file entries (counts, arrays, writer, stats) and the size of one entry.
_RECORD_BYTES, _RECORD_FILE_BYTES = 1100, 80


@dataclass
class ExtractPlan:
    """What an extract run will do and need; sizes and times are None when they could not be measured."""

    rows: int
    shards: int
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    shards_left: int = 0
    tokens_left: int = 0
    raw_bytes_per_token: int = 0
    bytes_per_token: float | None = None  # stored feature bytes a real token costs, measured
    projected_bytes: int | None = None  # the whole store
    projected_left_bytes: int | None = None  # what the shards not yet committed add
    free_path: str | None = None
    free_bytes: int | None = None
    device: str = ""
    devices: int = 1
    tokens_per_s: float | None = None  # one device, measured on the few batches (warm-up included)

    @property
    def extract_s(self) -> float | None:
        """Return the projected seconds of extraction left, or None when no rate was measured."""
        if not self.tokens_per_s:
            return None
        return self.tokens_left / (self.tokens_per_s * max(1, self.devices))

    def to_dict(self) -> dict[str, Any]:
        """Return the plan as plain values."""
        return {**asdict(self), "extract_s": self.extract_s}


def free_space(url: str) -> tuple[str | None, int | None]:
    """Return (the nearest existing folder of a local store path, its free bytes); (None, None) for a URL."""
    if "://" in url and not url.startswith("file://"):
        return None, None
    p = Path(url.removeprefix("file://")).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p), shutil.disk_usage(p).free


class _Keep:
    """A sink that keeps each sample's feature bits (for the measurement: a few batches only)."""

    def __init__(self) -> None:
        self.bits: list[np.ndarray] = []

    def append(self, input_ids: Any, loss_mask: Any, features: Any, sample_id: int) -> None:
        from ..storage.writer import features_to_bits

        self.bits.append(features_to_bits(features).copy())


def _encoded_bytes(bits: np.ndarray, codec: str) -> int:
    """Return the stored bytes of one whole feature chunk (bf16 bits) as the store's writer encodes it."""
    from ..storage.codec import encode_chunk, to_fp8

    if codec == "fp8":
        q, scales = to_fp8(bits)
        return len(memoryview(encode_chunk(q, True)).cast("B")) + len(memoryview(encode_chunk(scales, True)).cast("B"))
    return len(memoryview(encode_chunk(bits, codec != "none")).cast("B"))


def _feature_cost(bits: np.ndarray, codec: str, chunk: int) -> tuple[float, float]:
    """Return (stored bytes of a real token, of a padding token) of features encoded in whole chunks."""
    T = bits.shape[0]
    n = math.ceil(T / chunk)
    padded = np.zeros((n * chunk, *bits.shape[1:]), np.uint16)
    padded[:T] = bits
    total = sum(_encoded_bytes(padded[i * chunk:(i + 1) * chunk], codec) for i in range(n))
    zero = _encoded_bytes(np.zeros((chunk, *bits.shape[1:]), np.uint16), codec) / chunk
    return (total - zero * (n * chunk - T)) / T, zero


def _token_array_ratio(samples: list[Any], codec: str) -> float:
    """Return stored / raw bytes of the samples' input_ids and loss_mask arrays as the writer encodes them."""
    from ..storage.codec import encode_chunk

    ids = np.concatenate([np.asarray(x.input_ids, np.int32) for x in samples])
    mask = np.concatenate([np.asarray(x.loss_mask, np.bool_) for x in samples])
    stored = sum(len(memoryview(encode_chunk(a, codec != "none")).cast("B")) for a in (ids, mask))
    return stored / (ids.nbytes + mask.nbytes)


def _shard_bytes(tokens: int, samples: int, header: dict[str, Any], chunk: int, real: float, pad: float,
                 small_ratio: float) -> float:
    """Return a shard's projected bytes: features in whole chunks, the small arrays, the array documents, the record."""
    from ..storage.codec import array_metadata
    from ..storage.layout import dumps, group_metadata

    L, H = len(header["layer_ids"]), int(header["hidden_size"])
    n = math.ceil(tokens / chunk)
    small = 5 * tokens * small_ratio + 8 * (samples + 1) + 8 * samples  # input_ids + loss_mask, offsets, sample_ids
    compressed = header["codec"] != "none"
    docs = [array_metadata([tokens, L, H], [chunk, L, H], np.uint16, compressed, {"logical_dtype": "bfloat16"})]
    docs += [array_metadata([samples], [max(1, samples)], np.int64, compressed) for _ in range(4)]
    files = n * (2 if header["codec"] == "fp8" else 1) + 4 + len(docs)
    meta = sum(len(dumps(d)) for d in docs) + len(dumps(group_metadata({"shard_id": 0})))
    return real * tokens + pad * (n * chunk - tokens) + small + meta + _RECORD_BYTES + _RECORD_FILE_BYTES * files


def _measure(cfg: Any, header: dict[str, Any], samples: list[Any], device: str) -> tuple[float, float, float]:
    """Return (stored bytes of a real token, of a padding token, tokens/s) from the target on a few real batches."""
    from ..storage import DEFAULT_CHUNK_TOKENS

    _, pipeline = open_pipeline(cfg, header, device)
    sink = _Keep()
    stats = pipeline.run(samples, sink)
    del pipeline
    if device.startswith("cuda"):  # the workers need this device's memory next
        import torch

        torch.cuda.empty_cache()
    real, pad = _feature_cost(np.concatenate(sink.bits), header["codec"], DEFAULT_CHUNK_TOKENS)
    return real, pad, stats.tokens / max(stats.seconds, 1e-9)


def make_plan(cfg: Any, header: dict[str, Any], rows: list[Any], encoder: Any, *, committed: set[int] = frozenset(),
              whole: bool = True, measure: bool = True, devices: list[str] | None = None) -> ExtractPlan:
    """Return the plan of extracting `rows` into a store with `header`: every shard (whole) or the uncommitted ones.

    Rows are tokenized shard by shard with the workers' own prepare_shard, so samples, tokens and drops are exactly
    what extraction will store; the size comes from the target run on a few real batches (measure).
    """
    from ..config import resolve_devices
    from ..storage import DEFAULT_CHUNK_TOKENS

    plan_ = header["shard_plan"]
    ranges = shard_ranges(len(rows), plan_["rows_per_shard"])
    todo = [s for s in range(len(ranges)) if whole or s not in committed]
    devices = devices or resolve_devices(cfg.gpus)
    plan = ExtractPlan(rows=len(rows), shards=len(ranges), device=devices[0], devices=len(devices),
                       raw_bytes_per_token=len(header["layer_ids"]) * int(header["hidden_size"]) * 2)
    progress = Progress(sum(b - a for a, b in (ranges[s] for s in todo)), unit="row", desc="plan: tokenize")
    sizes: list[tuple[int, int, bool]] = []  # (tokens, samples, left to extract) of each planned shard
    probe: list[Any] = []
    for s in todo:
        a, b = ranges[s]
        samples, dropped = prepare_shard(rows[a:b], encoder, cfg.min_loss_tokens, cfg.strict)
        tokens = sum(len(x.input_ids) for x in samples)
        left = s not in committed
        sizes.append((tokens, len(samples), left))
        plan.samples += len(samples)
        plan.tokens += tokens
        plan.loss_tokens += sum(int(np.sum(x.loss_mask)) for x in samples)
        for reason, n in dropped.counts.items():
            plan.dropped[reason] = plan.dropped.get(reason, 0) + n
        if left:
            plan.shards_left += 1
            plan.tokens_left += tokens
        if sum(len(x.input_ids) for x in probe) < min(MEASURE_TOKENS, 3 * cfg.batch_tokens):
            probe += samples
        progress.update(b - a)
    progress.close()
    plan.dropped = dict(sorted(plan.dropped.items()))
    plan.free_path, plan.free_bytes = free_space(cfg.out)
    if measure and probe:
        real, pad, plan.tokens_per_s = _measure(cfg, header, probe, devices[0])
        plan.bytes_per_token = real
        chunk = DEFAULT_CHUNK_TOKENS
        ratio = _token_array_ratio(probe, header["codec"])
        cost = [_shard_bytes(t, n, header, chunk, real, pad, ratio) for t, n, _ in sizes]
        plan.projected_left_bytes = int(sum(c for c, (_, _, left) in zip(cost, sizes) if left))
        plan.projected_bytes = int(sum(cost)) if whole else None
    elif measure and not plan.shards_left:
        plan.projected_left_bytes = 0
    return plan


def _size(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return ""


def format_plan(plan: ExtractPlan, out: str, codec: str) -> str:
    """Return the plan as the lines `dflash extract --dry-run` and `dflash run` print."""
    dropped = ", ".join(f"{k} {v:,}" for k, v in plan.dropped.items()) or "none"
    rate = (f"{plan.tokens_per_s:,.0f} tok/s per device on {plan.device} (measured on a few batches)"
            if plan.tokens_per_s else "unknown")
    eta = format_eta(plan.extract_s) if plan.extract_s is not None else "unknown"
    fits = "unknown"
    if plan.projected_left_bytes is not None and plan.free_bytes is not None:
        fits = ("yes" if plan.projected_left_bytes <= plan.free_bytes
                else f"NO (pass {fp8_advice()}, fewer rows, another --out, or --force)")
    lines = [
        f"plan of {out}:",
        f"  data       {plan.rows:,} rows in {plan.shards:,} shards ({plan.shards_left:,} left to extract)",
        f"  samples    {plan.samples:,}, {plan.tokens:,} tokens, {plan.loss_tokens:,} loss tokens",
        f"  dropped    {dropped}",
        f"  per token  {plan.raw_bytes_per_token:,} B raw bf16, "
        + (f"{plan.bytes_per_token:,.0f} B stored with --codec {codec}" if plan.bytes_per_token else "stored: unknown"),
        f"  store      {_size(plan.projected_bytes)} projected, {_size(plan.projected_left_bytes)} still to write",
        f"  free       {_size(plan.free_bytes)} at {plan.free_path or out}; fits: {fits}",
        f"  extract    {rate}; {eta} on {plan.devices} device(s)",
        "  train      time unknown until training has run (its ETA follows from its first steps)",
    ]
    return "\n".join(lines)


# Stored / raw bf16 feature bytes by codec, as measured (bench/RESULTS.md: 0.68-0.70 lossless on real SmolLM2 and
# random-init 8B features, fp8 0.43), for the estimate a plain `dflash extract` checks before it starts.
CODEC_RATIO = {"blosc": 0.70, "none": 1.0, "fp8": 0.43}
# What fp8 features cost a drafter, measured (bench/RESULTS.md, "fp8's price", bench/fp8_price.py): the CPU demo's
# drafter trained from its blosc store and from an fp8 store of the same data, scored on the same held-out prompts.
FP8_PRICE = "on the CPU demo's drafter held-out tau_hat 1.248 -> 1.254 and measured tau 1.233 -> 1.231"


def fp8_advice() -> str:
    """Return the suggestion of --codec fp8 with what it saves and what it was measured to cost."""
    return f"--codec fp8 (about {CODEC_RATIO['fp8']:.2f}x of raw bf16; {FP8_PRICE})"


def estimate_plan(cfg: Any, header: dict[str, Any], rows: list[Any], committed: set[int]) -> ExtractPlan:
    """Return a plan whose size is estimated without the target or the tokenizer: ~3.5 characters a token (the
    header's own estimate), the codec's measured ratio, the shards not yet committed; `--dry-run` measures it."""
    from .header import estimate_tokens_per_row

    ranges = shard_ranges(len(rows), header["shard_plan"]["rows_per_shard"])
    left = [(a, b) for s, (a, b) in enumerate(ranges) if s not in committed]
    raw = len(header["layer_ids"]) * int(header["hidden_size"]) * 2
    plan = ExtractPlan(rows=len(rows), shards=len(ranges), raw_bytes_per_token=raw, shards_left=len(left))
    # One shard's rows at a time: the data is read, not held.
    plan.tokens_left = int(sum(estimate_tokens_per_row(rows[a:b], cfg.max_length) * (b - a) for a, b in left if b > a))
    plan.projected_left_bytes = int(plan.tokens_left * raw * CODEC_RATIO.get(header["codec"], 1.0))
    plan.free_path, plan.free_bytes = free_space(cfg.out)
    return plan


def _read_only(path: str | None) -> bool:
    """Return True if `path` lies on a file system mounted read-only."""
    import os

    try:
        return bool(path) and bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_fits(plan: ExtractPlan, out: str) -> None:
    """Raise StoreError when the projected bytes still to write exceed the free space where the store goes."""
    need, free = plan.projected_left_bytes, plan.free_bytes
    if need is None or free is None or need <= free:
        return
    if _read_only(plan.free_path):  # no room is not the news there: nothing can be written at all
        raise StoreError(f"--out {out}: cannot write the store there ({plan.free_path} is on a read-only file "
                         "system); pass a writable --out, or make this one writable and rerun the same command")
    raise StoreError(
        f"--out {out}: the store needs {_size(need)} more but {plan.free_path} has {_size(free)} free; "
        f"pass {fp8_advice()}, extract fewer rows, choose another --out, or --force to "
        f"start anyway ({'measured' if plan.bytes_per_token else 'estimated from the data; --dry-run measures it'})"
    )
