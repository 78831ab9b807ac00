"""Reading committed shards: chunk files straight into the caller's memory, checksummed and decoded in threads."""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptShard, StoreError
from .codec import SCALED_CODECS, decode_chunk_into, decode_scaled_into
from .fs import StoreFS, aligned_buffer, is_aligned
from .layout import FORMAT_VERSION, ROOT_META, commit_path, record_digest, shard_dir

if TYPE_CHECKING:
    import torch

__all__ = ["ShardData", "load_record", "read_small", "read_features", "invariant_problems", "read_pool"]

log = logging.getLogger(__name__)

SMALL_ARRAYS = {"input_ids": np.int32, "loss_mask": np.bool_, "offsets": np.int64, "sample_ids": np.int64}

# Chunk files at least this big are read with O_DIRECT where possible (see LocalFS.read_into).
DIRECT_MIN_BYTES = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def read_pool() -> ThreadPoolExecutor:
    """Return the process-wide pool that reads and decodes chunks (blosc and xxhash run without the GIL)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            n = int(os.environ.get("DFLASH_READ_THREADS", 0)) or min(16, max(4, os.cpu_count() or 4))
            _pool = ThreadPoolExecutor(n, thread_name_prefix="dflash-read")
        return _pool


@dataclass
class ShardData:
    """One shard in memory: all samples concatenated along tokens, with offsets marking sample boundaries."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    features: "torch.Tensor"  # bfloat16 [T, L, H]; read with raw=True from a scaled codec's store: its stored codes
    offsets: np.ndarray  # int64 [N + 1]
    sample_ids: np.ndarray  # int64 [N]
    scales: "torch.Tensor | None" = None  # float32 [T, L] beside stored codes (device_codec.decode_on_device)
    codec: str | None = None  # the store's codec where features hold its stored codes

    @property
    def num_samples(self) -> int:
        """Return the number of samples N."""
        return int(self.sample_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Return the number of tokens T."""
        return int(self.input_ids.shape[0])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, "torch.Tensor"]:
        """Return views (input_ids, loss_mask, features) of sample i."""
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[s:e], self.loss_mask[s:e], self.features[s:e]

    def sample_scales(self, i: int) -> "torch.Tensor | None":
        """Return a view of sample i's scales [t, L] where features hold stored codes, else None."""
        if self.scales is None:
            return None
        return self.scales[int(self.offsets[i]) : int(self.offsets[i + 1])]


def load_record(fs: StoreFS, shard_id: int, verify: bool = True, header_xxh3: str | None = None) -> dict:
    """Return a shard's commit record; CorruptShard if it is unreadable, (verify) its digest does not match, or it
    was written under another header than the one whose digest is header_xxh3."""
    return parse_record(fs, shard_id, read_record_bytes(fs, shard_id), verify, header_xxh3)


def read_record_bytes(fs: StoreFS, shard_id: int) -> bytes:
    """Return the raw bytes of a shard's commit record; CorruptShard if it has none."""
    path = commit_path(shard_id)
    try:
        return fs.read_bytes(path)
    except FileNotFoundError:
        raise CorruptShard(f"{fs.display(path)}: shard {shard_id} is not committed (no commit record)") from None


def parse_record(fs: StoreFS, shard_id: int, raw: bytes, verify: bool = True, header_xxh3: str | None = None) -> dict:
    """Return the commit record in `raw`; CorruptShard if it is not one, (verify) its digest does not match, or
    it names another header digest than header_xxh3 (when given).

    Records written before records named their header (no `header_xxh3`) are accepted as they are: such stores
    were made when the header was only ever created once and never replaced, so they stay readable; `dflash
    verify` counts them, and a recreated header refuses to adopt them (Store.create_or_open).
    """
    path = commit_path(shard_id)
    fix = f"run `dflash verify {fs.url} --repair` and rerun extract to redo it"
    try:
        record = json.loads(raw)
    except ValueError as e:
        raise CorruptShard(f"{fs.display(path)}: commit record is not valid JSON ({e}); {fix}") from None
    if not isinstance(record, dict):
        raise CorruptShard(f"{fs.display(path)}: commit record is not a JSON object; {fix}")
    if verify and record.get("record_xxh3") != record_digest(record):
        raise CorruptShard(f"{fs.display(path)}: commit record was modified after commit (digest mismatch); {fix}")
    if record.get("format_version") != FORMAT_VERSION or record.get("shard_id") != shard_id:
        raise CorruptShard(
            f"{fs.display(path)}: expected a format {FORMAT_VERSION} record of shard {shard_id}, found format "
            f"{record.get('format_version')!r} of shard {record.get('shard_id')!r}; {fix}"
        )
    bound = record.get("header_xxh3")
    if header_xxh3 is not None and bound is not None and bound != header_xxh3:
        raise CorruptShard(
            f"{fs.display(path)}: shard {shard_id} was written under another header (xxh3 {bound}), the store's "
            f"{ROOT_META} has xxh3 {header_xxh3}; {fix}"
        )
    return record


def _read_file(fs: StoreFS, shard_id: int, record: dict, rel: str, into: memoryview | None, verify: bool) -> Any:
    """Return the stored bytes of one chunk file (in `into` if given), checked against the record."""
    import xxhash

    path = f"{shard_dir(shard_id)}/{rel}"
    entry = record["files"].get(rel)
    fix = f"run `dflash verify {fs.url} --repair` and rerun extract to redo it"
    if entry is None:
        raise CorruptShard(f"{fs.display(path)}: shard {shard_id}: chunk is not listed in its commit record; {fix}")
    n = int(entry["bytes"])
    direct = n >= DIRECT_MIN_BYTES
    if into is not None and len(into) == n:
        buf = into
    else:
        buf = aligned_buffer(n) if direct else memoryview(bytearray(n))
    hasher = xxhash.xxh3_64() if verify else None
    try:
        got = fs.read_into(path, buf, direct=direct, hasher=hasher)
    except FileNotFoundError:
        raise CorruptShard(f"{fs.display(path)}: shard {shard_id}: chunk file is missing; {fix}") from None
    except OSError as e:  # permissions, I/O errors: the bytes may be fine, the medium is not
        raise StoreError(f"{fs.display(path)}: shard {shard_id}: cannot read ({e.strerror or e}); check the disk") from e
    if got != n:
        found = f"at least {got}" if got == len(buf) > n else str(got)
        raise CorruptShard(f"{fs.display(path)}: shard {shard_id}: expected {n} bytes, found {found}; {fix}")
    buf = buf[:n]
    if hasher is not None and hasher.hexdigest() != entry["xxh3"]:
        raise CorruptShard(f"{fs.display(path)}: shard {shard_id}: checksum mismatch (expected xxh3 {entry['xxh3']}); {fix}")
    return buf


def read_small(fs: StoreFS, shard_id: int, record: dict, name: str, verify: bool = True) -> np.ndarray:
    """Return one of the small one-chunk arrays (input_ids, loss_mask, offsets, sample_ids) of a shard."""
    dtype = np.dtype(SMALL_ARRAYS[name])
    n = int(record["arrays"][name]["shape"][0])
    out = np.empty(n, dtype)
    if n == 0:
        return out
    compressed = record["codec"] != "none"
    stored = _read_file(fs, shard_id, record, f"{name}/c.0", None if compressed else memoryview(out).cast("B"), verify)
    if compressed:
        _decode(fs, shard_id, f"{name}/c.0", stored, out, True)
    return out


def _decode(fs: StoreFS, shard_id: int, rel: str, stored: Any, dest: np.ndarray, compressed: bool) -> None:
    try:
        decode_chunk_into(stored, dest, compressed)
    except (ValueError, RuntimeError) as e:
        path = fs.display(f"{shard_dir(shard_id)}/{rel}")
        raise CorruptShard(f"{path}: shard {shard_id}: chunk does not decode ({e}); run `dflash verify {fs.url} --repair`") from None


def read_features(
    fs: StoreFS, shard_id: int, record: dict, start: int, stop: int, dest: np.ndarray, verify: bool = True,
    scales_out: np.ndarray | None = None,
) -> None:
    """Fill dest (uint16 bf16 bits [stop - start, L, H]) with feature rows start..stop of a shard, chunks in parallel.

    With scales_out (float32 [stop - start, L]; a scaled codec's store only), dest (of the stored dtype) gets the
    stored codes and scales_out their scales, for the device to decode (device_codec.decode_on_device)."""
    spec = record["arrays"]["features"]
    C, L, H = (int(x) for x in spec["chunk_shape"])
    codec = record["codec"]
    compressed, scaled = codec != "none", codec in SCALED_CODECS
    stored_dtype = np.dtype(spec["dtype"])
    raw = scales_out is not None
    if raw and not scaled:
        raise StoreError(f"{fs.display(shard_dir(shard_id))}: stored codes asked of a {codec!r} store, which has none")

    def one(i: int) -> None:
        lo, hi = max(start, i * C), min(stop, (i + 1) * C)
        rel = f"features/c.{i}.0.0"
        if (raw or not scaled) and lo == i * C and hi == (i + 1) * C:  # a whole chunk: straight into dest
            target = dest[lo - start : hi - start]
            view = memoryview(target).cast("B")
            # Uncompressed bytes land in dest itself when O_DIRECT can take it (aligned), else via a buffer.
            into = view if not compressed and (is_aligned(view) or len(view) < DIRECT_MIN_BYTES) else None
            stored = _read_file(fs, shard_id, record, rel, into, verify)
            if into is None:
                _decode(fs, shard_id, rel, stored, target, compressed)
            if raw:
                _read_scales(i, scales_out[lo - start : hi - start])
            return
        tmp = np.empty((C, L, H), stored_dtype)
        stored = _read_file(fs, shard_id, record, rel, None, verify)
        _decode(fs, shard_id, rel, stored, tmp, compressed)
        part = slice(lo - i * C, hi - i * C)
        if scaled:
            scales = np.empty((C, L), np.float32)
            _read_scales(i, scales)
            if raw:
                dest[lo - start : hi - start] = tmp[part]
                scales_out[lo - start : hi - start] = scales[part]
            else:
                decode_scaled_into(codec, tmp[part], scales[part], dest[lo - start : hi - start])
        else:
            dest[lo - start : hi - start] = tmp[part]

    def _read_scales(i: int, into: np.ndarray) -> None:
        srel = f"feature_scales/c.{i}.0"
        _decode(fs, shard_id, srel, _read_file(fs, shard_id, record, srel, None, verify), into, compressed)

    if stop <= start:
        return
    chunks = range(start // C, (stop - 1) // C + 1)
    futures = [read_pool().submit(one, i) for i in chunks]
    errors = []
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # collect all, report the first: the others are usually the same cause
            errors.append(e)
    if errors:
        raise errors[0]


def invariant_problems(record: dict, header: dict, arrays: dict[str, np.ndarray]) -> list[str]:
    """Return what is wrong with a shard's arrays against its record and the store header (empty when sound)."""
    problems = []
    T = int(record.get("num_tokens", -1))
    N = int(record.get("num_samples", -1))
    L, H = len(header["layer_ids"]), int(header["hidden_size"])
    feat = record["arrays"]["features"]
    if list(feat["shape"]) != [T, L, H]:
        problems.append(f"features shape {feat['shape']} does not match [T={T}, L={L}, H={H}] of the header")
    if record.get("codec") != header.get("codec"):
        problems.append(f"codec {record.get('codec')!r} differs from the header's {header.get('codec')!r}")
    offs = arrays.get("offsets")
    if offs is not None:
        if offs.shape[0] != N + 1:
            problems.append(f"offsets has {offs.shape[0]} entries, expected num_samples + 1 = {N + 1}")
        elif offs[0] != 0 or offs[-1] != T or np.any(np.diff(offs) < 0):
            problems.append(f"offsets must start at 0, not decrease and end at T={T}; found {offs[0]}..{offs[-1]}")
    for name in ("input_ids", "loss_mask"):
        a = arrays.get(name)
        if a is not None and a.shape[0] != T:
            problems.append(f"{name} has {a.shape[0]} entries, expected T={T}")
    sid = arrays.get("sample_ids")
    if sid is not None and sid.shape[0] != N:
        problems.append(f"sample_ids has {sid.shape[0]} entries, expected N={N}")
    mask = arrays.get("loss_mask")
    if mask is not None and mask.shape[0] == T and int(mask.sum()) != int(record.get("num_loss_tokens", -1)):
        problems.append(f"loss_mask has {int(mask.sum())} loss tokens, record says {record.get('num_loss_tokens')}")
    return problems
