"""The extraction plan, made once by the command's process and handed to every worker, and the pure decisions
behind it: shard ranges of source rows, the shard size, where each worker starts claiming, token-budget batches."""
from __future__ import annotations

import math

import shutil
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conversations import BadRowLog, Row
from ..errors import InputError, StoreError

__all__ = [
    "TARGET_SHARD_BYTES",
    "BATCH_OVERHEAD_TOKENS",
    "CODEC_RATIO",
    "RowScan",
    "ExtractionPlan",
    "scan_rows",
    "shard_record",
    "make_plan",
    "default_shard_size",
    "shard_ranges",
    "claim_order",
    "pack_batches",
    "free_space",
    "codec_advice",
    "format_bytes",
]

# About 2 GB of features a shard: large sequential reads for the trainer, and a killed worker loses little.
TARGET_SHARD_BYTES = 2 * 1024**3
# The fixed cost of one batch in token slots: ~500 kernel launches of a 36-layer target (~3 ms at ~30K tok/s).
BATCH_OVERHEAD_TOKENS = 128


# Stored / raw bf16 feature bytes by codec, as measured (bench/RESULTS.md: 0.68-0.70 lossless on real SmolLM2 and
# random-init 8B features, fp8 0.41-0.43; the uq codecs and the bf16 trims on the SmolLM2 demo's answers, rounded up
# to the next hundredth), for the estimate a plain `dflash extract` checks before it starts.
CODEC_RATIO = {"blosc": 0.70, "none": 1.0, "fp8": 0.43, "uq8": 0.37, "uq6": 0.35, "uq4": 0.31, "bf16m3": 0.45,
               "bf16m2": 0.39, "bf16m1": 0.35}
# What fp8 features cost a drafter, measured (bench/RESULTS.md, "fp8's price", bench/fp8_price.py): the CPU demo's
# drafter trained from its blosc store and from an fp8 store of the same data, scored on the same held-out prompts.
FP8_PRICE = "on the CPU demo's drafter held-out tau_hat 1.248 -> 1.254 and measured tau 1.233 -> 1.231"
# The same for uq6 (the default), against the lossless blosc store: the GPU demo's drafter on one H200
# (bench/RESULTS.md, "The codec A/B on a GPU", bench/codec_ab.py).
UQ6_PRICE = "on the GPU demo's drafter held-out tau_hat 2.448 -> 2.476 and measured tau 2.233 -> 2.301"
# Fewer bytes than uq6 and not measured on a drafter yet.
UQ4_PRICE = "its price in tau is not measured yet"


@dataclass(frozen=True)
class RowScan:
    """One pass over the source rows: the bad ones by reason, and each row's estimated tokens (-1 for a bad row)."""

    bad: BadRowLog
    tokens: array  # float64 per row: about 3.5 characters a token plus turn markup, capped at --max-length

    def tokens_per_row(self, start: int = 0, stop: int | None = None) -> float:
        """Return the estimated mean tokens of the usable rows in [start, stop) (1.0 when none is usable)."""
        total, good = 0.0, 0
        for t in self.tokens[start:stop]:
            if t >= 0:
                total += t
                good += 1
        return max(1.0, total / good) if good else 1.0


def scan_rows(rows: Iterable[Row], max_length: int, strict: bool = False) -> RowScan:
    """Return the rows' RowScan, parsing each row once (the rows are streamed, not held); --strict raises
    InputError at the first bad row."""
    bad, tokens = BadRowLog(), array("d")
    for r in rows:
        if r.error:
            if strict:
                raise InputError(f"{r.where}: bad row ({r.error}: {r.detail}); fix or remove it, or rerun without "
                                 "--strict")
            bad.add(r.error, r.index, r.where, r.detail)
            tokens.append(-1.0)
        else:
            tokens.append(min(max_length, sum(len(m["content"]) for m in r.messages) / 3.5 + 8 * len(r.messages)))
    return RowScan(bad, tokens)


def shard_record(num_rows: int, rows_per_shard: int) -> dict[str, int]:
    """Return the store header's shard plan: the rows, the rows a shard holds, the shards they make."""
    return {"num_rows": num_rows, "rows_per_shard": rows_per_shard,
            "num_shards": len(shard_ranges(num_rows, rows_per_shard))}


@dataclass(frozen=True, kw_only=True)
class ExtractionPlan:
    """What one extract run does, made once by the command's process (make_plan): the source rows, the shards'
    row ranges, the shards committed before it, and the size of what is left, estimated. `--dry-run` prints it
    (measured, extract/dry_run.py); a run checks that it fits, then hands it to its workers, who take their rows
    and ranges from it and from nowhere else.

    rows is the data files' index (chatfiles.Rows: the byte offset of every row, 16 bytes a row), not their parsed
    rows: a worker parses a shard's rows as it tokenises them, beside the device. Handed to spawned workers in their
    arguments, the plan of 800k conversations (4.2 GB of JSONL) pickles to 12.8 MB in 32-35 ms and loads in 21-26
    ms, where rescanning the files cost each worker 18-29 s, and the parsed rows would pickle to 4.2 GB (22-25 s
    out, 33-37 s in, per worker) after a 44-48 s parse (bench/plan_handoff.py, 2-core CPU, 2026-12-03).
    """

    rows: Sequence[Row]
    ranges: tuple[tuple[int, int], ...]  # [start, stop) source rows of each shard
    committed: frozenset[int]  # shards already committed when the plan was made
    raw_bytes_per_token: int
    tokens_left: int  # estimated tokens of the shards not committed (about 3.5 characters a token)
    projected_left_bytes: int  # what those shards add to the store, estimated with the codec's measured ratio
    free_path: str | None
    free_bytes: int | None
    device: str
    devices: int
    codec: str = "uq6"  # the store's feature codec

    @property
    def num_shards(self) -> int:
        return len(self.ranges)

    def left(self, committed: Iterable[int] | None = None) -> list[int]:
        """Return the shards not committed (when the plan was made, or in `committed`), in order."""
        done = self.committed if committed is None else set(committed)
        return [s for s in range(self.num_shards) if s not in done]

    def rows_of(self, shards: Iterable[int]) -> int:
        """Return the source rows these shards hold."""
        return sum(self.ranges[s][1] - self.ranges[s][0] for s in shards)

    def shard_rows(self, shard_id: int) -> tuple[int, int, list[Row]]:
        """Return (start, stop, the parsed rows) of one shard."""
        start, stop = self.ranges[shard_id]
        return start, stop, self.rows[start:stop]

    def check_fits(self, out: str) -> None:
        """Raise StoreError when the bytes still to write exceed the free space where the store goes."""
        need, free = self.projected_left_bytes, self.free_bytes
        if free is None or need <= free:
            return
        if _read_only(self.free_path):  # no room is not the news there: nothing can be written at all
            raise StoreError(f"--out {out}: cannot write the store there ({self.free_path} is on a read-only file "
                             "system); pass a writable --out, or make this one writable and rerun the same command")
        raise StoreError(
            f"--out {out}: the store needs {format_bytes(need)} more but {self.free_path} has {format_bytes(free)} "
            f"free; {codec_advice(self.codec)}extract fewer rows, choose another --out, or --force to start "
            "anyway "
            "(estimated from the data; --dry-run measures it)"
        )


def make_plan(header: dict[str, Any], rows: Sequence[Row], scan: RowScan, committed: Iterable[int], out: str,
              devices: list[str]) -> ExtractionPlan:
    """Return the plan of extracting `rows` into the store at `out` with `header`, whose shards in `committed` are
    done already: the only place shard ranges are computed."""
    record = header["shard_plan"]
    ranges = tuple(shard_ranges(record["num_rows"], record["rows_per_shard"]))
    committed = frozenset(committed)
    raw = len(header["layer_ids"]) * int(header["hidden_size"]) * 2
    tokens = int(sum(scan.tokens_per_row(a, b) * (b - a) for s, (a, b) in enumerate(ranges)
                     if s not in committed and b > a))
    free_path, free_bytes = free_space(out)
    return ExtractionPlan(rows=rows, ranges=ranges, committed=committed, raw_bytes_per_token=raw, tokens_left=tokens,
                          projected_left_bytes=int(tokens * raw * CODEC_RATIO.get(header["codec"], 1.0)),
                          free_path=free_path, free_bytes=free_bytes, device=devices[0], devices=len(devices),
                          codec=header["codec"])


def default_shard_size(mean_tokens_per_row: float, bytes_per_token: int, target_bytes: int = TARGET_SHARD_BYTES,
                       min_tokens: int = 0) -> int:
    """Return the source rows per shard that give about target_bytes of raw features, and at least min_tokens
    tokens (at least 1 row).

    A forward never spans two shards: min_tokens keeps the batches of a sharded or offloaded target (64K tokens,
    where streaming the weights costs little) from being cut to a shard's 2 GiB (41K tokens of a 5,120-wide
    target's features), and gives its packing rows enough to fill them (placement.SHARDED_SHARD_BATCHES)."""
    if mean_tokens_per_row <= 0 or bytes_per_token <= 0:
        raise ValueError("mean_tokens_per_row and bytes_per_token must be positive")
    rows = int(target_bytes // (mean_tokens_per_row * bytes_per_token))
    return max(1, rows, math.ceil(min_tokens / mean_tokens_per_row))


def shard_ranges(num_rows: int, shard_size: int) -> list[tuple[int, int]]:
    """Return the [start, stop) source-row ranges of the shards: fixed, so independent of the number of workers."""
    if num_rows < 0 or shard_size < 1:
        raise ValueError(f"need num_rows >= 0 and shard_size >= 1, got {num_rows}, {shard_size}")
    return [(s, min(s + shard_size, num_rows)) for s in range(0, num_rows, shard_size)]


def claim_order(num_shards: int, committed: Iterable[int], worker: int) -> list[int]:
    """Return the shards not committed, in the order worker number `worker` tries to claim them: each worker starts
    at another shard, so peers do not race for the same claim first (any worker may take any shard)."""
    done = set(committed)
    todo = [s for s in range(num_shards) if s not in done]
    k = worker % max(1, len(todo))
    return todo[k:] + todo[:k]


def pack_batches(lengths: list[int], batch_tokens: int, overhead_tokens: int = BATCH_OVERHEAD_TOKENS,
                 floor_tokens: int = 0) -> list[list[int]]:
    """Return batches of sample indices, longest first, each with len(batch) * longest <= batch_tokens.

    A batch is right-padded to its longest sample, so it costs len * longest token slots, or floor_tokens where that
    is more, plus a fixed overhead (kernel launches, small-matmul inefficiency) worth `overhead_tokens`. The floor is
    what a forward costs whatever its size: a target whose weights cross to the device once a forward (streamed from
    host memory, gathered from peers) pays that pass on every batch, so its small batches cost as much as large
    ones. Over the samples sorted by length (ties by index, so the plan is deterministic) an exact dynamic programme
    picks the cuts of least total cost: a shard holds too few samples for greedy filling to keep padding small (30%
    on 33 samples), while this stays near 1%.
    """
    if any(n < 1 for n in lengths):
        raise ValueError("every sample needs at least one token")
    if lengths and max(lengths) > batch_tokens:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a batch of {batch_tokens} tokens")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ls = [lengths[i] for i in order]
    n = len(ls)
    best = [0] * (n + 1)  # best[i]: least cost of packing ls[i:]
    cut = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        top = ls[i]  # the longest of any batch starting at i
        cost_i, cut_i = None, i + 1
        for j in range(i + 1, min(n, i + batch_tokens // top) + 1):
            c = max((j - i) * top, floor_tokens) + overhead_tokens + best[j]
            if cost_i is None or c < cost_i:
                cost_i, cut_i = c, j
        best[i], cut[i] = cost_i, cut_i
    batches, i = [], 0
    while i < n:
        batches.append(order[i : cut[i]])
        i = cut[i]
    return batches


def free_space(url: str) -> tuple[str | None, int | None]:
    """Return (the nearest existing folder of a local store path, its free bytes); (None, None) for a URL."""
    if "://" in url and not url.startswith("file://"):
        return None, None
    p = Path(url.removeprefix("file://")).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p), shutil.disk_usage(p).free


def _read_only(path: str | None) -> bool:
    """Return True if `path` lies on a file system mounted read-only."""
    import os

    try:
        return bool(path) and bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def codec_advice(codec: str) -> str:
    """Return the suggestion of the lossy codec with fewer bytes than `codec` (uq6, else uq4), with what it saves and
    was measured to cost, ending in ", "; empty where `codec` is as small as these."""
    for smaller, price in (("uq6", UQ6_PRICE), ("uq4", UQ4_PRICE)):
        if CODEC_RATIO[smaller] < CODEC_RATIO.get(codec, 1.0):
            return f"pass --codec {smaller} (about {CODEC_RATIO[smaller]:.2f}x of raw bf16; {price}), "
    return ""


def format_bytes(n: float | None) -> str:
    """Return bytes as text in decimal units ("unknown" for None)."""
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return ""
