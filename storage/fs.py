"""File access for a store: local folders through os (fsync, O_EXCL, pread), any other URL through fsspec."""
from __future__ import annotations

import errno
import logging
import os
import re
import socket
import uuid
from typing import Any

from ..runtime.atomic import fsync_dir, write_atomic, write_durable

__all__ = ["StoreFS", "LocalFS", "FsspecFS", "PARTIAL_SUFFIX", "writer_tag", "temp_writer", "aligned_buffer",
           "is_aligned", "ALIGN"]

log = logging.getLogger(__name__)

# Temporary files end with this; anything still carrying it after a crash is garbage that gc removes.
PARTIAL_SUFFIX = ".partial"
# ... and name their writer (`NAME.PID@HOST.RANDOM.partial`), so gc can tell a dead writer's from a live one's.
_TEMP_WRITER = re.compile(r"\.(\d+)@([^.@]+)\.[0-9a-f]{8}" + re.escape(PARTIAL_SUFFIX) + "$")


def writer_tag() -> str:
    """Return this process's tag in temp names: PID@HOST (the host's dots made underscores)."""
    return f"{os.getpid()}@{socket.gethostname().replace('.', '_')}"


def temp_writer(name: str) -> tuple[int, str] | None:
    """Return (pid, host as tagged) of the process that wrote a temp file, or None if its name does not say."""
    m = _TEMP_WRITER.search(name)
    return (int(m.group(1)), m.group(2)) if m else None
# O_DIRECT alignment of buffer address, length and file offset: 4096 covers 512 and 4K logical blocks.
ALIGN = 4096
# Opt-in (DFLASH_DIRECT_IO=1): it reads cold chunk files faster, but gives up the page cache, which serves a
# store that fits in memory several times faster than any disk.
DIRECT_IO = hasattr(os, "O_DIRECT") and os.environ.get("DFLASH_DIRECT_IO", "0") == "1"


class StoreFS:
    """The few file operations a store needs, on paths relative to the store root ("shards/00042/zarr.json")."""

    url: str
    is_local: bool = False

    def exists(self, rel: str) -> bool:
        """Return True if the path exists."""
        raise NotImplementedError

    def read_bytes(self, rel: str) -> bytes:
        """Return the whole file."""
        raise NotImplementedError

    def read_into(self, rel: str, buf: memoryview, direct: bool = False, hasher: Any = None) -> int:
        """Return how many bytes of the file were read into buf (at most len(buf)); direct: bypass the page
        cache where the backend can and buf is aligned (see aligned_buffer); hasher: updated with the bytes read."""
        raise NotImplementedError

    def size(self, rel: str) -> int:
        """Return the file's size in bytes."""
        raise NotImplementedError

    def mtime(self, rel: str) -> float | None:
        """Return the file's modification time (seconds since the epoch), or None where the backend cannot say."""
        raise NotImplementedError

    def write_file(self, rel: str, data: Any) -> None:
        """Write (and fsync where possible) a file; not atomic: only commit records must be."""
        raise NotImplementedError

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace a file so that readers see the old content or the new, never a mix."""
        raise NotImplementedError

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Return True if this call created the file, False if it already existed."""
        raise NotImplementedError

    def listdir(self, rel: str) -> list[str]:
        """Return the sorted names in a folder ([] if it does not exist)."""
        raise NotImplementedError

    def check_writable(self) -> None:
        """Raise StoreError if writers could not claim shards exclusively here (before anything is written)."""
        return None

    def rm(self, rel: str) -> bool:
        """Return True if a file was removed."""
        raise NotImplementedError

    def rmtree(self, rel: str) -> bool:
        """Return True if a folder was removed with everything in it."""
        raise NotImplementedError

    def makedirs(self, rel: str) -> None:
        """Create a folder and its parents if missing."""
        raise NotImplementedError

    def fsync_dir(self, rel: str) -> None:
        """Make the names in a folder durable (no-op where the backend has no such notion)."""
        raise NotImplementedError

    def download(self, rels: list[str], dests: list[str]) -> None:
        """Copy files of the store to local paths (the shard cache's fetch); FileNotFoundError if one is missing."""
        for rel, dest in zip(rels, dests):
            with open(dest, "wb") as f:
                f.write(self.read_bytes(rel))

    def display(self, rel: str = "") -> str:
        """Return the full path or URL of a relative path, for messages."""
        return self.url.rstrip("/") + ("/" + rel if rel else "")


class LocalFS(StoreFS):
    """A store in a local (or mounted shared) folder: real fsync, atomic rename, O_EXCL claims."""

    is_local = True

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def path(self, rel: str) -> str:
        """Return the absolute local path of a relative store path."""
        return os.path.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    def read_into(self, rel: str, buf: memoryview, direct: bool = False, hasher: Any = None) -> int:
        """Return the number of bytes read from the file into buf (pread in a loop; stops at end of file).

        direct uses O_DIRECT when buf is aligned: a chunk file read through the page cache starts with small
        synchronous readahead, so many chunk files read at half the speed of one big file; O_DIRECT hands the
        device the whole chunk at once (measured in bench/storage.py). Opt in with DFLASH_DIRECT_IO=1.
        """
        path = self.path(rel)
        if direct and DIRECT_IO and is_aligned(buf):
            try:
                got = _pread_all(os.open(path, os.O_RDONLY | os.O_DIRECT), buf, None)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this file system or alignment refuses O_DIRECT
                    raise
            else:
                if hasher is not None:  # DMA left nothing in the CPU caches: one pass costs the same here
                    hasher.update(buf[:got])
                return got
        return _pread_all(os.open(path, os.O_RDONLY), buf, hasher)

    def size(self, rel: str) -> int:
        return os.stat(self.path(rel)).st_size

    def mtime(self, rel: str) -> float | None:
        return os.stat(self.path(rel)).st_mtime

    def write_file(self, rel: str, data: Any) -> None:
        """Write data (bytes or a contiguous buffer) to the file and fsync it; not atomic (the commit is)."""
        write_durable(self.path(rel), data)

    def _write_temp(self, rel: str, data: bytes) -> str:
        tmp = f"{self.path(rel)}.{writer_tag()}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"
        try:
            write_durable(tmp, data)
        except BaseException:  # a signal mid-write must not leave the temp behind
            _silent_unlink(tmp)
            raise
        return tmp

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write data to a temp file (`*.partial`), fsync it, rename it into place and fsync the folder."""
        write_atomic(self.path(rel), data, suffix=PARTIAL_SUFFIX, tag=writer_tag())

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Return True if this call created the file with exactly data (link of a fsynced temp), False if it existed."""
        tmp = self._write_temp(rel, data)
        try:
            # link() fails if the name exists, so the file appears complete or not at all, never half-written.
            os.link(tmp, self.path(rel))
        except FileExistsError:
            return False
        finally:
            _silent_unlink(tmp)
        self.fsync_dir(os.path.dirname(rel))
        return True

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except FileNotFoundError:
            return []

    def rm(self, rel: str) -> bool:
        return _silent_unlink(self.path(rel))

    def rmtree(self, rel: str) -> bool:
        import shutil

        p = self.path(rel)
        if not os.path.exists(p):
            return False
        shutil.rmtree(p, ignore_errors=True)
        return True

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def fsync_dir(self, rel: str) -> None:
        """Fsync a folder so the names created in it survive a power loss."""
        fsync_dir(self.path(rel))


class FsspecFS(StoreFS):
    """A store behind an fsspec URL (memory://, ...; s3:// is s3.S3FS): puts are whole-object, so the commit record
    written last is what makes a shard real; there is no fsync to call; claims need the file system's exclusive
    create ("xb"), and one without it is refused."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.url = url

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def read_into(self, rel: str, buf: memoryview, direct: bool = False, hasher: Any = None) -> int:
        data = self.fs.cat_file(self.path(rel), start=0, end=len(buf))
        buf[: len(data)] = data
        if hasher is not None:
            hasher.update(data)
        return len(data)

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def download(self, rels: list[str], dests: list[str]) -> None:
        """Copy files to local paths, concurrently where the file system is asynchronous (s3fs: one batch of GETs)."""
        self.fs.get([self.path(r) for r in rels], list(dests))

    def mtime(self, rel: str) -> float | None:
        try:
            return self.fs.modified(self.path(rel)).timestamp()
        except (NotImplementedError, AttributeError, KeyError, ValueError):
            return None  # unknown age: gc keeps the file

    def write_file(self, rel: str, data: Any) -> None:
        self.fs.pipe_file(self.path(rel), bytes(memoryview(data).cast("B")))

    def write_atomic(self, rel: str, data: bytes) -> None:
        # An object-store put is atomic: readers see the old object or the new one.
        self.fs.pipe_file(self.path(rel), data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        try:
            with self.fs.open(self.path(rel), "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):
            # A check-then-write fallback would let two writers both win a claim: refuse instead.
            from ..errors import StoreError

            raise StoreError(
                f"{self.display(rel)}: this file system ({type(self.fs).__name__}) has no exclusive create, so two "
                "writers could both claim a shard; use a local or shared folder, or s3:// (PUT with If-None-Match)"
            ) from None
        return True

    def listdir(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def rm(self, rel: str) -> bool:
        try:
            self.fs.rm_file(self.path(rel))
            return True
        except FileNotFoundError:
            return False

    def rmtree(self, rel: str) -> bool:
        if not self.fs.exists(self.path(rel)):
            return False
        self.fs.rm(self.path(rel), recursive=True)
        return True

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def fsync_dir(self, rel: str) -> None:
        return None


# Buffered reads go in pieces this big so the checksum reads each piece while it is still in the CPU cache:
# hashing a whole 20 MB chunk after reading it costs a second trip through memory (45% of a cached read).
HASH_PIECE = 1 << 20


def _pread_all(fd: int, buf: memoryview, hasher: Any) -> int:
    """Return the bytes read into buf from the start of fd (closed on return); a short read means end of file."""
    try:
        total, n = 0, len(buf)
        step = HASH_PIECE if hasher is not None else n
        while total < n:
            got = os.preadv(fd, [buf[total : total + step]], total)
            if hasher is not None:
                hasher.update(buf[total : total + got])
            total += got
            if got == 0 or total % ALIGN:
                break  # end of file (an O_DIRECT read cannot go on from an unaligned offset anyway)
        return total
    finally:
        os.close(fd)


def is_aligned(buf: memoryview) -> bool:
    """Return True if buf's address and length are multiples of ALIGN (what O_DIRECT needs)."""
    import numpy as np

    return len(buf) % ALIGN == 0 and np.frombuffer(buf, np.uint8).ctypes.data % ALIGN == 0


def aligned_buffer(n: int) -> memoryview:
    """Return a writable buffer of n bytes rounded up to ALIGN, starting at an ALIGN-aligned address."""
    import numpy as np

    size = -(-n // ALIGN) * ALIGN
    raw = np.empty(size + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return memoryview(raw[off : off + size])


def _silent_unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
