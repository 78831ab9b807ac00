"""`dflash extract --dry-run`: the run's plan (plan.ExtractionPlan) measured and printed before its first byte:
samples, tokens and drops (the workers' own tokenization of the plan's shards), the store's projected size (the
target run on a few real batches, encoded with the store's codec), the free space where it goes, projected times."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..runtime.process import Progress, format_eta
from .plan import ExtractionPlan, codec_advice, format_bytes
from .worker import open_pipeline, prepare_shard

__all__ = ["DryRun", "measure", "format_plan"]

log = logging.getLogger(__name__)

# Tokens of the few real batches the target runs to measure bytes per token and its rate.
MEASURE_TOKENS = 16384
# A commit record's size besides its per-file entries (counts, arrays, writer, stats) and the size of one entry.
_RECORD_BYTES, _RECORD_FILE_BYTES = 1100, 80


@dataclass
class DryRun:
    """An extraction plan measured; sizes and times are None when they could not be measured."""

    plan: ExtractionPlan
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    tokens_left: int = 0
    bytes_per_token: float | None = None  # stored feature bytes a real token costs, measured
    projected_bytes: int | None = None  # the whole store
    projected_left_bytes: int | None = None  # what the shards not yet committed add
    projected_left_objects: int | None = None  # files (objects on S3) the shards not yet committed write
    tokens_per_s: float | None = None  # one device, measured on the few batches (warm-up included)

    @property
    def extract_s(self) -> float | None:
        """Return the projected seconds of extraction left, or None when no rate was measured."""
        if not self.tokens_per_s:
            return None
        return self.tokens_left / (self.tokens_per_s * max(1, self.plan.devices))

    def to_dict(self) -> dict[str, Any]:
        """Return the measured plan as plain values (what `dflash extract --dry-run` returns)."""
        p = self.plan
        return {"rows": len(p.rows), "shards": p.num_shards, "samples": self.samples, "tokens": self.tokens,
                "loss_tokens": self.loss_tokens, "dropped": self.dropped, "shards_left": len(p.left()),
                "tokens_left": self.tokens_left, "raw_bytes_per_token": p.raw_bytes_per_token,
                "bytes_per_token": self.bytes_per_token, "projected_bytes": self.projected_bytes,
                "projected_left_bytes": self.projected_left_bytes,
                "projected_left_objects": self.projected_left_objects, "free_path": p.free_path,
                "free_bytes": p.free_bytes, "device": p.device, "devices": p.devices,
                "tokens_per_s": self.tokens_per_s, "extract_s": self.extract_s}


class _Keep:
    """A sink that keeps each sample's feature bits (for the measurement: a few batches only)."""

    def __init__(self) -> None:
        self.bits: list[np.ndarray] = []

    def append(self, input_ids: Any, loss_mask: Any, features: Any, sample_id: int) -> None:
        from ..storage.writer import features_to_bits

        self.bits.append(features_to_bits(features).copy())


def _encoded_bytes(bits: np.ndarray, codec: str) -> int:
    """Return the stored bytes of one whole feature chunk (bf16 bits) as the store's writer encodes it."""
    from ..storage.codec import SCALED_CODECS, TRIM_BITS, encode_chunk, encode_scaled, trim_mantissa

    if codec in SCALED_CODECS:
        q, scales = encode_scaled(bits, codec)
        return len(memoryview(encode_chunk(q, True)).cast("B")) + len(memoryview(encode_chunk(scales, True)).cast("B"))
    if codec in TRIM_BITS:
        return len(memoryview(encode_chunk(trim_mantissa(bits, TRIM_BITS[codec]), True)).cast("B"))
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
    if _scaled(header):
        docs.append(array_metadata([tokens, L], [chunk, L], np.float32, compressed))
    files = n * (2 if _scaled(header) else 1) + 4 + len(docs)
    meta = sum(len(dumps(d)) for d in docs) + len(dumps(group_metadata({"shard_id": 0})))
    return real * tokens + pad * (n * chunk - tokens) + small + meta + _RECORD_BYTES + _RECORD_FILE_BYTES * files


def _shard_objects(tokens: int, header: dict[str, Any], chunk: int) -> int:
    """Return the files (objects) a committed shard holds: feature chunks (+ their scales under fp8 and the uq codecs),
    4 small arrays, 5 array documents (6 with scales), its group document and its commit record."""
    n = math.ceil(tokens / chunk)
    scaled = _scaled(header)
    return n * (2 if scaled else 1) + 4 + (6 if scaled else 5) + 1 + 1


def _scaled(header: dict[str, Any]) -> bool:
    """Return whether the store's codec keeps a scale a row in its own chunks (fp8, the uq codecs)."""
    from ..storage.codec import SCALED_CODECS

    return header["codec"] in SCALED_CODECS


def _measure(cfg: Any, header: dict[str, Any], samples: list[Any], device: str) -> tuple[float, float, float]:
    """Return (stored bytes of a real token, of a padding token, tokens/s) from the target on a few real batches."""
    from ..storage import DEFAULT_CHUNK_TOKENS

    _, pipeline = open_pipeline(cfg, header, device)
    sink = _Keep()
    stats = pipeline.run(samples, sink)
    finish = getattr(pipeline.runner, "finish", None)
    if finish is not None:  # a sharded target: step with the peers until they have measured too
        finish()
    del pipeline
    if device.startswith("cuda"):  # the workers need this device's memory next
        import torch

        torch.cuda.empty_cache()
    real, pad = _feature_cost(np.concatenate(sink.bits), header["codec"], DEFAULT_CHUNK_TOKENS)
    return real, pad, stats.tokens / max(stats.seconds, 1e-9)


def measure(cfg: Any, header: dict[str, Any], plan: ExtractionPlan, encoder: Any) -> DryRun:
    """Return the plan measured: every shard tokenized with the workers' own prepare_shard, so samples, tokens and
    drops are exactly what extraction will store; the size from the target run on a few real batches."""
    from ..storage import DEFAULT_CHUNK_TOKENS

    dry = DryRun(plan)
    progress = Progress(len(plan.rows), unit="row", desc="plan: tokenize")
    sizes: list[tuple[int, int, bool]] = []  # (tokens, samples, left to extract) of each shard
    probe: list[Any] = []
    for s in range(plan.num_shards):
        start, stop, rows = plan.shard_rows(s)
        samples, dropped = prepare_shard(rows, encoder, cfg.min_loss_tokens, cfg.strict)
        tokens = sum(len(x.input_ids) for x in samples)
        left = s not in plan.committed
        sizes.append((tokens, len(samples), left))
        dry.samples += len(samples)
        dry.tokens += tokens
        dry.loss_tokens += sum(int(np.sum(x.loss_mask)) for x in samples)
        for reason, n in dropped.counts.items():
            dry.dropped[reason] = dry.dropped.get(reason, 0) + n
        if left:
            dry.tokens_left += tokens
        if sum(len(x.input_ids) for x in probe) < min(MEASURE_TOKENS, 3 * cfg.batch_tokens):
            probe += samples
        progress.update(stop - start)
    progress.close()
    dry.dropped = dict(sorted(dry.dropped.items()))
    if probe:
        real, pad, dry.tokens_per_s = _measure(cfg, header, probe, plan.device)
        dry.bytes_per_token = real
        chunk = DEFAULT_CHUNK_TOKENS
        ratio = _token_array_ratio(probe, header["codec"])
        cost = [_shard_bytes(t, n, header, chunk, real, pad, ratio) for t, n, _ in sizes]
        dry.projected_left_bytes = int(sum(c for c, (_, _, left) in zip(cost, sizes) if left))
        dry.projected_bytes = int(sum(cost))
        dry.projected_left_objects = sum(_shard_objects(t, header, chunk) for t, _, left in sizes if left)
    elif not plan.left():
        dry.projected_left_bytes = 0
    return dry


def format_plan(dry: DryRun, out: str, codec: str) -> str:
    """Return the measured plan as the lines `dflash extract --dry-run` and `dflash run` print."""
    plan = dry.plan
    dropped = ", ".join(f"{k} {v:,}" for k, v in dry.dropped.items()) or "none"
    rate = (f"{dry.tokens_per_s:,.0f} tok/s per device on {plan.device} (measured on a few batches)"
            if dry.tokens_per_s else "unknown")
    eta = format_eta(dry.extract_s) if dry.extract_s is not None else "unknown"
    fits = "unknown"
    if dry.projected_left_bytes is not None and plan.free_bytes is not None:
        fits = ("yes" if dry.projected_left_bytes <= plan.free_bytes
                else f"NO ({codec_advice(plan.codec)}fewer rows, another --out, or --force)")
    lines = [
        f"plan of {out}:",
        f"  data       {len(plan.rows):,} rows in {plan.num_shards:,} shards ({len(plan.left()):,} left to extract)",
        f"  samples    {dry.samples:,}, {dry.tokens:,} tokens, {dry.loss_tokens:,} loss tokens",
        f"  dropped    {dropped}",
        f"  per token  {plan.raw_bytes_per_token:,} B raw bf16, "
        + (f"{dry.bytes_per_token:,.0f} B stored with --codec {codec}" if dry.bytes_per_token else "stored: unknown"),
        f"  store      {format_bytes(dry.projected_bytes)} projected, {format_bytes(dry.projected_left_bytes)} still "
        "to write",
        f"  free       {format_bytes(plan.free_bytes)} at {plan.free_path or out}; fits: {fits}",
        f"  extract    {rate}; {eta} on {plan.devices} device(s)",
        "  train      time unknown until training has run (its ETA follows from its first steps)",
    ]
    if "://" in out and dry.projected_left_objects is not None:
        written = format_bytes(dry.projected_left_bytes)
        lines.insert(6, f"  objects    {dry.projected_left_objects:,} objects, {written} to write to {out} (and one "
                        "claim object a shard, removed at its commit)")
    return "\n".join(lines)
