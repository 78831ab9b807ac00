"""ShardWriter: fills one claimed shard chunk by chunk, then commits it (every byte fsynced, the record last)."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import StoreError
from . import claims
from .fs import StoreFS
from .codec import (QUANT_DIVISORS, SCALED_CODECS, TRIM_BITS, array_metadata, encode_chunk, encode_scaled,
                    feature_dtype, trim_mantissa)
from .layout import FORMAT_VERSION, commit_path, dumps, group_metadata, header_digest, record_digest, shard_dir

__all__ = ["ShardWriter", "features_to_bits"]

log = logging.getLogger(__name__)


def features_to_bits(features: Any) -> np.ndarray:
    """Return the bf16 bits of features as a C-contiguous uint16 numpy array (zero-copy for CPU bf16 tensors)."""
    if isinstance(features, np.ndarray):
        if features.dtype != np.uint16:
            raise StoreError(f"features as numpy must be uint16 bf16 bits, found dtype {features.dtype}")
        return np.ascontiguousarray(features)
    import torch

    if not isinstance(features, torch.Tensor) or features.dtype != torch.bfloat16:
        raise StoreError(
            f"features must be a torch.bfloat16 tensor or numpy uint16 bits, found {type(features).__name__} "
            f"{getattr(features, 'dtype', '')}"
        )
    return features.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _host_array(x: Any) -> np.ndarray:
    """Return a tensor or array as a C-contiguous numpy array (zero-copy for a contiguous CPU tensor)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    import torch

    if not isinstance(x, torch.Tensor):
        raise StoreError(f"expected a torch tensor or numpy array, found {type(x).__name__}")
    return x.detach().cpu().contiguous().numpy()


class ShardWriter:
    """Context manager over one claimed shard: append samples, then commit(); leaving without commit releases the
    claim and leaves the partial data as garbage (no reader sees a shard without its commit record).

    Call it from one thread; it encodes, writes and fsyncs whole chunks in its own small pool, so append() costs
    one copy of the features (the caller may reuse its buffer as soon as append returns). Under a scaled codec the
    caller may hand over features it encoded already (append's scales, e.g. device_codec.encode_on_device's on the
    GPU): then the pool only compresses and writes them, and the shard's bytes are the same.
    """

    def __init__(self, fs: StoreFS, header: dict, shard_id: int, claim: claims.Claim, chunk_tokens: int,
                 threads: int) -> None:
        self.shard_id = shard_id
        self._fs = fs
        self._claim = claim
        self._dir = shard_dir(shard_id)
        self.codec: str = header["codec"]
        self._header_xxh3 = header_digest(header)
        self.num_layers = len(header["layer_ids"])
        self.hidden_size = int(header["hidden_size"])
        self.chunk_tokens = int(chunk_tokens)
        self._compressed = self.codec != "none"
        self._scaled = self.codec in SCALED_CODECS  # fp8 and the uq codecs: a scale (step) a row beside them
        self._dtype = feature_dtype(self.codec)
        # Scaled codecs only: None until the first append, then whether the shard's samples come encoded (append's
        # scales) or as bf16 bits; a shard takes one kind, so its chunks are made one way.
        self._encoded: bool | None = None
        self._chunk: np.ndarray | None = None
        self._chunk_scales: np.ndarray | None = None
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._offsets: list[int] = [0]
        self._sample_ids: list[int] = []
        self._chunk_index = 0
        self._fill = 0
        self._files: dict[str, dict] = {}
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"dflash-shard{shard_id}")
        self._pending: deque[Future] = deque()
        self._state = "open"
        # Seconds spent, summed over the pool's threads (compress, write_fsync) or in commit() (commit_wait: the
        # chunks still queued; commit_files: the small arrays, documents, fsyncs and the record): the timeline's.
        self.times = {"compress": 0.0, "write_fsync": 0.0, "commit_wait": 0.0, "commit_files": 0.0}
        self._times_lock = threading.Lock()
        for name in ("features", "feature_scales") if self._scaled else ("features",):
            self._fs.makedirs(f"{self._dir}/{name}")
        # Renews the claim while the shard is written, so peers on other hosts see this writer alive.
        self._heartbeat = claims.Heartbeat(fs, shard_id, claim)

    # -- context manager -------------------------------------------------------------------------------------
    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state != "committed":
            self.abort()

    def abort(self) -> None:
        """Stop writing and release the claim; what was written stays uncommitted garbage for gc or a new claim."""
        if self._state == "open":
            self._state = "aborted"
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._heartbeat.stop()
            claims.release(self._fs, self.shard_id, self._claim)

    # -- appending -------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Return the tokens appended so far."""
        return self._offsets[-1]

    def _new_buffers(self) -> None:
        # bf16 bits (the scaled codecs quantise whole chunks in the pool), or the stored codes and their scales.
        shape = (self.chunk_tokens, self.num_layers, self.hidden_size)
        if self._encoded:
            self._chunk = np.empty(shape, self._dtype)
            self._chunk_scales = np.empty(shape[:2], np.float32)
        else:
            self._chunk = np.empty(shape, np.uint16)

    def _rows(self, features: Any, scales: Any, sample_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Return a sample's rows as the chunk buffer holds them: (bf16 bits, None), or (the stored codes, their
        float32 scales) for features a caller encoded already; a StoreError for the wrong kind or dtype."""
        where = f"{self._fs.display(self._dir)}: sample {sample_id}"
        encoded = scales is not None
        if encoded and not self._scaled:
            raise StoreError(f"{where}: encoded features with scales given to a shard of codec {self.codec!r}, which "
                             f"takes bf16 features only (scales are for {', '.join(SCALED_CODECS)})")
        if self._encoded is not None and encoded != self._encoded:
            kinds = ("bf16 features", "encoded features with scales")
            raise StoreError(f"{where}: {kinds[encoded]} appended to a shard begun with {kinds[self._encoded]}; "
                             "a shard takes one kind")
        if not encoded:
            return features_to_bits(features), None
        codes, scales = _host_array(features), _host_array(scales)
        allowed = (np.uint8,) if self.codec == "fp8" else (np.int16, np.uint16)
        if codes.dtype not in allowed or scales.dtype != np.float32:
            raise StoreError(f"{where}: encoded {self.codec} features must be "
                             f"{' or '.join(np.dtype(a).name for a in allowed)} with float32 scales (as "
                             f"device_codec.encode_on_device gives them), found {codes.dtype} and {scales.dtype}")
        return codes.view(self._dtype), scales

    def append(self, input_ids: Any, loss_mask: Any, features: Any, sample_id: int, scales: Any = None) -> None:
        """Add one sample: token ids [t], loss mask [t], features bf16 [t, L, H] (tensor or uint16 bits); or, under
        a scaled codec, features already encoded [t, L, H] (uint8 fp8 bits, int16/uint16 zigzagged uq integers,
        as device_codec.encode_on_device gives them) with their float32 scales [t, L]."""
        if self._state != "open":
            raise StoreError(f"{self._fs.display(self._dir)}: append after the shard was {self._state}")
        ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids).reshape(-1)
        mask = np.asarray(loss_mask.cpu() if hasattr(loss_mask, "cpu") else loss_mask).reshape(-1)
        bits, scale_rows = self._rows(features, scales, sample_id)
        t = ids.shape[0]
        want = (t, self.num_layers, self.hidden_size)
        if mask.shape[0] != t or tuple(bits.shape) != want or (
                scale_rows is not None and tuple(scale_rows.shape) != want[:2]):
            scale_shapes = f", scales {list(scale_rows.shape)}" if scale_rows is not None else ""
            raise StoreError(
                f"{self._fs.display(self._dir)}: sample {sample_id}: expected input_ids [t], loss_mask [t], features "
                f"{list(want)}{', scales [t, L]' if scale_shapes else ''}; found {list(ids.shape)}, "
                f"{list(mask.shape)}, {list(bits.shape)}{scale_shapes}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise StoreError(f"{self._fs.display(self._dir)}: sample {sample_id}: input_ids must be integers, found {ids.dtype}")
        self._encoded = scale_rows is not None
        self._ids.append(ids.astype(np.int32, copy=True))
        self._masks.append(mask.astype(np.bool_, copy=True))
        self._offsets.append(self._offsets[-1] + t)
        self._sample_ids.append(int(sample_id))
        done = 0
        while done < t:
            n = min(t - done, self.chunk_tokens - self._fill)
            if self._chunk is None:
                self._new_buffers()
            self._chunk[self._fill : self._fill + n] = bits[done : done + n]
            if scale_rows is not None:
                self._chunk_scales[self._fill : self._fill + n] = scale_rows[done : done + n]
            self._fill += n
            done += n
            if self._fill == self.chunk_tokens:
                self._flush_chunk()

    def _flush_chunk(self) -> None:
        # Zarr stores edge chunks whole, so the tail of the last chunk is zero padding (encoded: what zero rows
        # encode to, so both kinds of append give the same bytes).
        if self._fill < self.chunk_tokens:
            self._chunk[self._fill :] = 0
            if self._encoded:
                self._chunk_scales[self._fill :] = self._zero_row_scale()
        i = self._chunk_index
        if self._encoded:
            self._pending.append(self._pool.submit(self._write_encoded_chunk, i, self._chunk, self._chunk_scales))
        elif self._scaled:
            self._pending.append(self._pool.submit(self._write_scaled_chunk, i, self._chunk))
        elif self.codec in TRIM_BITS:
            self._pending.append(self._pool.submit(self._write_trimmed_chunk, i, self._chunk))
        else:
            self._submit(f"features/c.{i}.0.0", self._chunk)
        self._chunk_index += 1
        self._fill = 0
        self._chunk = self._chunk_scales = None  # the pool task owns them now; the next append makes new ones
        # Bound the memory held by queued chunks: wait for the oldest once the queue is deep.
        while len(self._pending) > 2 * self._threads:
            self._pending.popleft().result()

    def _submit(self, rel: str, arr: np.ndarray) -> None:
        self._pending.append(self._pool.submit(self._write_chunk, rel, arr))

    def _zero_row_scale(self) -> np.float32:
        """Return the scale the codec gives a row of zeros (padding): its own encoder's, not a copy of its rule."""
        return encode_scaled(np.zeros((1, 1, 1), np.uint16), self.codec)[1][0, 0]

    def _write_scaled_chunk(self, i: int, bits: np.ndarray) -> None:
        # Quantising in the pool keeps append() as cheap as a copy, as for the lossless codecs.
        self._write_encoded_chunk(i, *encode_scaled(bits, self.codec))

    def _write_encoded_chunk(self, i: int, q: np.ndarray, scales: np.ndarray) -> None:
        self._write_chunk(f"features/c.{i}.0.0", q)
        self._write_chunk(f"feature_scales/c.{i}.0", scales)

    def _write_trimmed_chunk(self, i: int, bits: np.ndarray) -> None:
        self._write_chunk(f"features/c.{i}.0.0", trim_mantissa(bits, TRIM_BITS[self.codec]))

    def _write_chunk(self, rel: str, arr: np.ndarray) -> None:
        import xxhash

        t0 = time.perf_counter()
        data = encode_chunk(arr, self._compressed)
        t1 = time.perf_counter()
        path = f"{self._dir}/{rel}"
        try:
            self._fs.write_file(path, data)
            self._time("compress", t1 - t0)
            self._time("write_fsync", time.perf_counter() - t1)
        except OSError as e:
            raise StoreError(
                f"{self._fs.display(path)}: cannot write a chunk ({e.strerror or e}); free space or fix permissions, "
                "then rerun the same command to resume"
            ) from e
        # dict item assignment is atomic under the GIL; each key is written by one task.
        self._files[rel] = {"xxh3": xxhash.xxh3_64_hexdigest(data), "bytes": len(memoryview(data).cast("B"))}

    def _write_doc(self, rel: str, doc: bytes) -> None:
        """Write a zarr.json of this shard durably, then fsync the folder naming it (and its chunks)."""
        path = f"{self._dir}/{rel}"
        self._fs.write_file(path, doc)
        self._fs.fsync_dir(path.rsplit("/", 1)[0])

    def _time(self, name: str, seconds: float) -> None:
        with self._times_lock:
            self.times[name] += seconds

    # -- committing ------------------------------------------------------------------------------------------
    def commit(self, extra: dict | None = None) -> dict:
        """Return the commit record after fsyncing every chunk, array document and folder, then the record."""
        if self._state != "open":
            raise StoreError(f"{self._fs.display(self._dir)}: commit after the shard was {self._state}")
        try:
            record = self._commit(extra or {})
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        claims.release(self._fs, self.shard_id, self._claim)
        return record

    def _commit(self, extra: dict) -> dict:
        if self._fill:
            self._flush_chunk()
        T = self.num_tokens
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int32)
        mask = np.concatenate(self._masks) if self._masks else np.zeros(0, np.bool_)
        small = {
            "input_ids": ids,
            "loss_mask": mask,
            "offsets": np.asarray(self._offsets, np.int64),
            "sample_ids": np.asarray(self._sample_ids, np.int64),
        }
        t0 = time.perf_counter()
        for name, arr in small.items():
            self._fs.makedirs(f"{self._dir}/{name}")
            if arr.size:
                self._submit(f"{name}/c.0", arr)
        while self._pending:
            self._pending.popleft().result()
        t1 = time.perf_counter()
        self._time("commit_wait", t1 - t0)
        L, H, C = self.num_layers, self.hidden_size, self.chunk_tokens
        arrays: dict[str, dict] = {
            name: {"shape": [int(a.size)], "chunk_shape": [max(1, int(a.size))], "dtype": a.dtype.name}
            for name, a in small.items()
        }
        arrays["features"] = {"shape": [T, L, H], "chunk_shape": [C, L, H], "dtype": self._dtype.name}
        if self._scaled:
            arrays["feature_scales"] = {"shape": [T, L], "chunk_shape": [C, L], "dtype": "float32"}
        feature_attrs = {"logical_dtype": "bfloat16", "encoding": "bf16_bits"}
        if self.codec in TRIM_BITS:
            feature_attrs["mantissa_bits"] = TRIM_BITS[self.codec]
        if self.codec == "fp8":
            feature_attrs = {"logical_dtype": "bfloat16", "encoding": "fp8_e4m3_scaled", "scales": "feature_scales"}
        elif self._scaled:
            feature_attrs = {"logical_dtype": "bfloat16", "encoding": "int16_zigzag_times_step",
                             "scales": "feature_scales",
                             "step": f"median |value| of the row / {QUANT_DIVISORS[self.codec]}, or max |value| / 32767"}
        import xxhash

        # The documents and folder fsyncs go to the pool at once: one after another they were ~12 fsyncs in a row
        # on the commit's path. They need no atomic replace: nothing reads a shard before its record, written
        # below after every one of them is durable.
        docs = {f"{name}/zarr.json": dumps(array_metadata(
                    spec["shape"], spec["chunk_shape"], np.dtype(spec["dtype"]), self._compressed,
                    feature_attrs if name == "features" else None)) for name, spec in arrays.items()}
        for rel, doc in docs.items():
            self._files[rel] = {"xxh3": xxhash.xxh3_64_hexdigest(doc), "bytes": len(doc)}
        docs["zarr.json"] = dumps(group_metadata({"shard_id": self.shard_id}))
        tasks = [self._pool.submit(self._write_doc, rel, doc) for rel, doc in docs.items()]
        tasks.append(self._pool.submit(self._fs.fsync_dir, "shards"))
        for task in tasks:
            task.result()
        self._pool.shutdown(wait=True)
        record = {
            "format_version": FORMAT_VERSION,
            "shard_id": self.shard_id,
            # Binds the shard to the header it was written under; readers refuse it under any other.
            "header_xxh3": self._header_xxh3,
            "codec": self.codec,
            "num_samples": len(self._sample_ids),
            "num_tokens": T,
            "num_loss_tokens": int(mask.sum()),
            "bytes": sum(f["bytes"] for f in self._files.values()),
            "raw_feature_bytes": T * L * H * 2,
            "chunk_tokens": C,
            "arrays": arrays,
            "files": dict(sorted(self._files.items())),
            "writer": {"host": claims.HOST, "pid": os.getpid()},
            "time": time.time(),
            "extra": extra,
        }
        record["record_xxh3"] = record_digest(record)
        # A writer that stalled past its lease may have lost the shard to a peer: only the claim's holder commits.
        self._heartbeat.stop()
        claims.check_still_ours(self._fs, self.shard_id, self._claim)
        self._fs.write_atomic(commit_path(self.shard_id), dumps(record))
        self._time("commit_files", time.perf_counter() - t1)
        log.debug("committed shard %d: %d samples, %d tokens", self.shard_id, record["num_samples"], T)
        return record
