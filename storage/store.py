"""Store: open or create a feature store, claim and commit shards, read them (follow.py follows one being written)."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CorruptShard, ManifestMismatch, StoreError
from . import claims
from ..runtime.locks import pid_alive
from .backends import open_fs
from .codec import SCALED_CODECS, feature_dtype
from .fs import PARTIAL_SUFFIX, StoreFS, temp_writer, writer_tag
from .layout import (
    CLAIMS,
    COMMITS,
    COMPLETE,
    FORMAT_VERSION,
    ROOT_META,
    SHARDS,
    check_header,
    commit_path,
    dumps,
    group_metadata,
    header_digest,
    parse_id,
    shard_dir,
    validate_header,
)
from .reader import (
    SMALL_ARRAYS,
    ShardData,
    invariant_problems,
    load_record,
    parse_record,
    read_features,
    read_record_bytes,
    read_small,
)
from .writer import ShardWriter

if TYPE_CHECKING:
    import torch

    from .cache import ShardCache

__all__ = ["Store", "DEFAULT_CHUNK_TOKENS"]

log = logging.getLogger(__name__)

# Measured in bench/storage.py: 512-token chunks read and write within a few % of 1024 and decode in parallel well.
DEFAULT_CHUNK_TOKENS = 512
# Every temp file of ours (`*.partial`) is renamed away within one small write; one this old has no live writer.
PARTIAL_MAX_AGE_S = 600.0


class Store:
    """A dflash feature store (format v1): a zarr v3 group whose header is attrs["dflash"]; see DESIGN.md."""

    def __init__(self, fs: StoreFS, header: dict, chunk_tokens: int | None = None) -> None:
        self.fs = fs
        self.url = fs.url
        self.header = header
        self.header_xxh3 = header_digest(header)
        # Chunking is a property of each shard (its record says it), so writers may choose it freely.
        self.chunk_tokens = int(chunk_tokens or DEFAULT_CHUNK_TOKENS)
        self._records: dict[int, tuple[bytes, dict]] = {}  # shard id -> (raw record, parsed record)
        self.cache: "ShardCache | None" = None  # local copies of a remote store's shards (use_cache)

    # -- opening -------------------------------------------------------------------------------------------------
    @classmethod
    def create_or_open(cls, url: str, header: dict, *, chunk_tokens: int | None = None,
                       replace_skeleton: bool = False) -> "Store":
        """Return the store at url, creating it with this header; ManifestMismatch if it exists with another
        (replace_skeleton: unless it holds no commit record and no live writer, when this header replaces it)."""
        fs = open_fs(url)
        validate_header(header, fs.display())
        fs.check_writable()
        full = {**json.loads(json.dumps(header)), "format_version": FORMAT_VERSION}
        if not fs.exists(ROOT_META):
            _refuse_foreign_records(fs, full)
            fs.makedirs("")
            for sub in (SHARDS, COMMITS, CLAIMS):
                fs.makedirs(sub)
            fs.write_atomic(f"{SHARDS}/zarr.json", dumps(group_metadata()))
            # Exclusive create: of several processes creating one store at once, one header wins, the rest compare.
            if fs.create_exclusive(ROOT_META, dumps(group_metadata({"dflash": full}))):
                log.info("created store %s", fs.display())
                return cls(fs, full, chunk_tokens)
        try:
            return cls.open(url, expected=header, chunk_tokens=chunk_tokens)
        except ManifestMismatch:
            if not (replace_skeleton and cls.open(url).is_skeleton()):
                raise
        # A run that failed before its first shard left nothing of value: the new settings take the store over.
        log.warning("%s: replacing the header of a store that holds no committed shard", fs.display())
        fs.write_atomic(ROOT_META, dumps(group_metadata({"dflash": full})))
        return cls(fs, full, chunk_tokens)

    @classmethod
    def open(cls, url: str, expected: dict | None = None, *, chunk_tokens: int | None = None) -> "Store":
        """Return the existing store at url; StoreError if missing or of an unknown version, ManifestMismatch if
        `expected` differs from its header in any field."""
        fs = open_fs(url)
        try:
            meta = json.loads(fs.read_bytes(ROOT_META))
        except FileNotFoundError:
            raise StoreError(
                f"{fs.display()}: no dflash store here (expected {ROOT_META}); create one with `dflash extract --out`"
            ) from None
        except ValueError as e:
            raise StoreError(f"{fs.display(ROOT_META)}: not valid JSON ({e}); the store is damaged") from None
        header = meta.get("attributes", {}).get("dflash") if isinstance(meta, dict) else None
        if not isinstance(header, dict):
            raise StoreError(f"{fs.display(ROOT_META)}: a zarr group without a dflash header; not a dflash store")
        version = header.get("format_version")
        if version != FORMAT_VERSION:
            raise StoreError(
                f"{fs.display()}: store format version {version!r}, this dflash reads version {FORMAT_VERSION}; "
                "use the dflash version that wrote it, or re-extract"
            )
        validate_header(header, fs.display(ROOT_META))
        if expected is not None:
            check_header(header, expected, fs.display())
        return cls(fs, header, chunk_tokens)

    @property
    def num_shards(self) -> int:
        """Return the number of shards the plan has."""
        return int(self.header["shard_plan"]["num_shards"])

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- listing -------------------------------------------------------------------------------------------------
    def committed_ids(self) -> list[int]:
        """Return the sorted ids of shards whose commit record exists."""
        ids = (parse_id(n, ".json") for n in self.fs.listdir(COMMITS))
        return sorted(i for i in ids if i is not None)

    def is_skeleton(self) -> bool:
        """Return True if the store holds no commit record and no live writer: a header and empty folders only."""
        if self.committed_ids():
            return False
        ids = (parse_id(n, ".json") for n in self.fs.listdir(CLAIMS))
        return not any(claims.claim_is_live(claims.read_claim(self.fs, i)) for i in ids if i is not None)

    def discard_if_skeleton(self) -> bool:
        """Remove the store if it is a skeleton (is_skeleton), leaving no folder behind where it made one; return
        True if it did. For a run that made the store and failed before its first commit."""
        if not self.is_skeleton():
            return False
        for sub in (SHARDS, COMMITS, CLAIMS):
            self.fs.rmtree(sub)
        self.fs.rm(ROOT_META)
        if not self.fs.listdir(""):
            self.fs.rmtree("")
        return True

    def commit_record(self, shard_id: int) -> dict:
        """Return a committed shard's record (counts, bytes, checksums, writer, extra); CorruptShard if damaged or
        written under another header.

        The file is read every time (a record may be withdrawn and redone), but parsed and digest-checked only
        when its bytes changed since this Store last read it.
        """
        raw = read_record_bytes(self.fs, shard_id)
        cached = self._records.get(shard_id)
        if cached is not None and cached[0] == raw:
            return cached[1]
        record = parse_record(self.fs, shard_id, raw, header_xxh3=self.header_xxh3)
        self._records[shard_id] = (raw, record)
        return record

    def sample_lengths(self, shard_id: int) -> np.ndarray:
        """Return the token count of every sample of a committed shard (from its small `offsets` array)."""
        return np.diff(read_small(self.fs, shard_id, self.commit_record(shard_id), "offsets"))

    def _check_id(self, shard_id: int) -> None:
        if not (isinstance(shard_id, (int, np.integer)) and 0 <= shard_id < self.num_shards):
            raise StoreError(f"{self.fs.display()}: shard id {shard_id!r} is outside the plan 0..{self.num_shards - 1}")

    # -- writing -------------------------------------------------------------------------------------------------
    def try_claim(self, shard_id: int, *, threads: int | None = None) -> ShardWriter | None:
        """Return a writer for the shard (encoding on `threads` threads, default 2-8 by CPU count), or None if it
        is committed or claimed by a live process."""
        self._check_id(shard_id)
        if self.fs.exists(commit_path(shard_id)):
            return None
        claim = claims.acquire(self.fs, shard_id)
        if claim is None:
            return None
        # Checked again under the claim: a writer may have committed between our first look and our claim.
        if self.fs.exists(commit_path(shard_id)):
            claims.release(self.fs, shard_id, claim)
            return None
        self.fs.rmtree(shard_dir(shard_id))
        threads = threads or min(8, max(2, os.cpu_count() or 2))
        return ShardWriter(self.fs, self.header, int(shard_id), claim, self.chunk_tokens, threads)

    def release_own_claims(self) -> int:
        """Return how many claims of this process were released: what an interrupted writer leaves (a signal
        can land between taking a claim and handing it to the code that would release it)."""
        mine = 0
        for sid in range(self.num_shards):
            claim = claims.read_claim(self.fs, sid)
            if claim and claim.get("pid") == os.getpid() and claim.get("host") == claims.HOST:
                claims.release(self.fs, sid, claim)
                mine += 1
        me = writer_tag()
        for name in self.fs.listdir(CLAIMS):  # a claim this process was writing when the signal came
            if name.endswith(PARTIAL_SUFFIX) and f".{me}." in name:
                self.fs.rm(f"{CLAIMS}/{name}")
        return mine

    def withdraw(self, shard_id: int) -> bool:
        """Return True if a commit record was removed, so the shard counts as never written (and the store as not
        complete) and the next extract redoes it."""
        self._check_id(shard_id)
        self.fs.rm(COMPLETE)
        return self.fs.rm(commit_path(shard_id))

    def mark_complete(self, extra: dict | None = None) -> dict:
        """Return the completion record written once every planned shard is committed; StoreError otherwise."""
        done = self.committed_ids()
        missing = sorted(set(range(self.num_shards)) - set(done))
        if missing:
            more = "..." if len(missing) > 10 else ""
            raise StoreError(
                f"{self.fs.display()}: cannot mark complete: {len(missing)} of {self.num_shards} planned shards are "
                f"not committed ({missing[:10]}{more}); rerun `dflash extract` to finish them"
            )
        record = {"format_version": FORMAT_VERSION, "num_shards": self.num_shards, "time": time.time(), "extra": extra or {}}
        self.fs.write_atomic(COMPLETE, dumps(record))
        return record

    def is_complete(self) -> bool:
        """Return True if the completion record exists and every planned shard is committed."""
        return self.fs.exists(COMPLETE) and len(self.committed_ids()) >= self.num_shards

    def gc(self) -> dict:
        """Return counts of what was removed: stale claims, uncommitted shard folders no live writer holds, and
        `*.partial` temp files of dead writers.

        Safe beside live writers: a claim or a shard folder is removed only under a claim this call took itself,
        through the same takeover a writer uses (so a live writer's claim is never touched), and a temp file only
        when it is a takeover lock of a dead process or older than PARTIAL_MAX_AGE_S.
        """
        removed = {"shards": 0, "claims": 0, "partial": 0}
        committed = set(self.committed_ids())
        folders = {parse_id(n) for n in self.fs.listdir(SHARDS)} - {None} - committed
        claimed = {parse_id(n, ".json") for n in self.fs.listdir(CLAIMS)} - {None}
        for sid in sorted(folders | claimed):
            if sid in claimed and claims.claim_is_live(claims.read_claim(self.fs, sid)):
                continue
            mine = claims.acquire(self.fs, sid)
            if mine is None:
                continue  # a live writer holds it
            try:
                if sid in folders and not self.fs.exists(commit_path(sid)):
                    removed["shards"] += self.fs.rmtree(shard_dir(sid))
            finally:
                claims.release(self.fs, sid, mine)
            removed["claims"] += sid in claimed
        now = time.time()
        for folder in ("", COMMITS, SHARDS, CLAIMS):
            for name in self.fs.listdir(folder):
                rel = f"{folder}/{name}" if folder else name
                if not name.endswith(PARTIAL_SUFFIX):
                    continue
                writer = temp_writer(name)
                if ".takeover-" in name:
                    stale = claims.lock_is_stale(self.fs, rel)
                elif writer is not None and writer[1] == writer_tag().split("@", 1)[1]:
                    stale = not pid_alive(writer[0])  # a writer of this host: dead or not, we can tell
                else:
                    try:
                        mtime = self.fs.mtime(rel)
                    except FileNotFoundError:
                        continue
                    stale = mtime is not None and now - mtime > PARTIAL_MAX_AGE_S
                if stale:
                    removed["partial"] += self.fs.rm(rel)
        if any(removed.values()):
            log.info("gc %s: removed %s", self.fs.display(), removed)
        return removed

    # -- reading -------------------------------------------------------------------------------------------------
    def use_cache(self, folder: str | None, gb: float, ahead: int | None = None) -> "ShardCache | None":
        """Return the bounded local shard cache this store now reads through (a folder, at most `gb` GB), or None
        where there is no folder or the store is on a local file system already."""
        if not folder:
            if not self.fs.is_local:
                log.info("%s is remote and no --cache-dir was given: every epoch reads every shard from it again",
                         self.fs.display())
            return None
        if self.fs.is_local:
            log.info("%s is a local folder: --cache-dir %s is not used", self.fs.display(), folder)
            return None
        from .cache import DEFAULT_AHEAD, ShardCache, cache_key

        self.cache = ShardCache(folder, cache_key(self.url, self.header_xxh3), int(gb * 1e9),
                                DEFAULT_AHEAD if ahead is None else ahead)
        log.info("reading %s through the shard cache %s (at most %.1f GB)", self.fs.display(), self.cache.root, gb)
        return self.cache

    def read_ahead(self, shard_ids: list[int]) -> None:
        """Fetch these committed shards into the cache on a thread, in order, as room allows (no-op uncached)."""
        if self.cache is not None:
            self.cache.read_ahead(self.fs, list(shard_ids), self.commit_record)

    def read_shard(self, shard_id: int, *, verify: bool = True, out: "torch.Tensor | None" = None,
                   raw: bool = False) -> ShardData:
        """Return a whole committed shard; features land in `out` (e.g. pinned, at least T*L*H bf16) if given.

        raw: a scaled codec's store (fp8, uq) returns its stored codes and their scales instead of bf16 features,
        for the device that trains on them to decode (ShardData.scales, device_codec.decode_on_device); other
        stores return bf16 features as without it."""
        record = self.commit_record(shard_id) if verify or self.cache else load_record(self.fs, shard_id, verify,
                                                                                       self.header_xxh3)
        raw = raw and self.header["codec"] in SCALED_CODECS
        if self.cache is None:
            return self._read_shard(self.fs, shard_id, record, verify, out, raw)
        try:
            with self.cache.local(self.fs, shard_id, record) as fs:
                return self._read_shard(fs, shard_id, record, True, out, raw)
        except CorruptShard as e:
            if not str(e).startswith(self.cache.root):
                raise  # the store's own copy is bad (found while fetching): verify --repair is the remedy
            # The local copy went bad or was evicted by another process between fetch and read: fetch it again.
            log.warning("shard %d: cached copy unusable (%s); fetching it again", shard_id, e)
            self.cache.drop(shard_id, record)
            with self.cache.local(self.fs, shard_id, record) as fs:
                return self._read_shard(fs, shard_id, record, True, out, raw)

    def _read_shard(self, fs: StoreFS, shard_id: int, record: dict, verify: bool,
                    out: "torch.Tensor | None", raw: bool = False) -> ShardData:
        small = {name: read_small(fs, shard_id, record, name, verify) for name in SMALL_ARRAYS}
        problems = invariant_problems(record, self.header, small)
        if problems:
            raise CorruptShard(f"{fs.display(shard_dir(shard_id))}: {'; '.join(problems)}")
        T = int(record["num_tokens"])
        features = self._feature_tensor(T, out)
        if not raw:
            read_features(fs, shard_id, record, 0, T, _bits(features), verify)
            return ShardData(small["input_ids"], small["loss_mask"], features, small["offsets"], small["sample_ids"])
        import torch

        from .device_codec import stored_torch_dtype

        codec = self.header["codec"]
        codes = features.view(-1).view(torch.uint8)[: features.numel() * feature_dtype(codec).itemsize]
        codes = codes.view(stored_torch_dtype(codec)).view(features.shape)
        scales = torch.empty(features.shape[:2], dtype=torch.float32)
        read_features(fs, shard_id, record, 0, T, codes.numpy().view(feature_dtype(codec)), verify, scales.numpy())
        return ShardData(small["input_ids"], small["loss_mask"], codes, small["offsets"], small["sample_ids"],
                         scales=scales, codec=codec)

    def _feature_tensor(self, T: int, out: "torch.Tensor | None") -> "torch.Tensor":
        import torch

        shape = (T, len(self.header["layer_ids"]), int(self.header["hidden_size"]))
        n = shape[0] * shape[1] * shape[2]
        if out is None:
            return torch.empty(shape, dtype=torch.bfloat16)
        if out.dtype != torch.bfloat16 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < n:
            raise StoreError(
                f"read_shard out= must be a contiguous CPU bfloat16 tensor of at least {n} elements {list(shape)}, "
                f"found {out.dtype} {out.device} {list(out.shape)}"
            )
        return out.view(-1)[:n].view(shape)

    def verify(self, shard_id: int) -> list[str]:
        """Return one line per problem of a committed shard (each naming the path); empty when it is sound."""
        try:
            record = load_record(self.fs, shard_id, header_xxh3=self.header_xxh3)
        except CorruptShard as e:
            return [str(e)]
        problems = []
        sdir = shard_dir(shard_id)
        for rel, entry in record.get("files", {}).items():
            path = f"{sdir}/{rel}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                problems.append(f"{self.fs.display(path)}: file is missing")
                continue
            if size != entry["bytes"]:
                problems.append(f"{self.fs.display(path)}: expected {entry['bytes']} bytes, found {size}")
        if problems:
            return problems
        try:
            data = self.read_shard(shard_id, verify=True)
        except CorruptShard as e:
            return [str(e)]
        import xxhash

        for rel, entry in record["files"].items():
            if rel.endswith("zarr.json"):
                path = f"{sdir}/{rel}"
                if xxhash.xxh3_64_hexdigest(self.fs.read_bytes(path)) != entry["xxh3"]:
                    problems.append(f"{self.fs.display(path)}: checksum mismatch (expected xxh3 {entry['xxh3']})")
        del data
        return problems


def _refuse_foreign_records(fs: StoreFS, header: dict) -> None:
    """Raise ManifestMismatch if a store without a header holds commit records of another header.

    Its zarr.json was removed (or lost) but its shards were not. Records of this very header are adopted: they are
    what this run would write. Records of another header (or of none: written before records named their header)
    are refused rather than redone: they are somebody's finished extraction, and deleting it silently because a
    header went missing is the one thing a rerun must not do; the user decides, with the command in the message.
    """
    want = header_digest(header)
    foreign: dict[str, int] = {}
    for name in fs.listdir(COMMITS):
        sid = parse_id(name, ".json")
        if sid is None:
            continue
        try:
            got = json.loads(fs.read_bytes(commit_path(sid))).get("header_xxh3") or "none"
        except (FileNotFoundError, ValueError, AttributeError):
            got = "unreadable"
        if got != want:
            foreign[got] = foreign.get(got, 0) + 1
    if foreign:
        found = ", ".join(f"{n} with header xxh3 {d}" for d, n in sorted(foreign.items()))
        raise ManifestMismatch(
            f"{fs.display()}: has no {ROOT_META} but {sum(foreign.values())} commit records written under another "
            f"header ({found}; this run's header is xxh3 {want}); remove {fs.display(COMMITS)} and "
            f"{fs.display(SHARDS)} to start over, or choose a new --out"
        )


def _bits(features: "torch.Tensor") -> np.ndarray:
    import torch

    return features.view(torch.int16).numpy().view(np.uint16)
