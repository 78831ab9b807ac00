"""File access for a store: local folders through os (fsync, O_EXCL, pread), any other URL through fsspec."""
from __future__ import annotations

import errno
import logging
import os
import uuid
from typing import Any

__all__ = ["StoreFS", "LocalFS", "FsspecFS", "open_fs", "PARTIAL_SUFFIX"]

log = logging.getLogger(__name__)

# Temporary files end with this; anything still carrying it after a crash is garbage that gc removes.
PARTIAL_SUFFIX = ".partial"


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

    def read_into(self, rel: str, buf: memoryview) -> int:
        """Return how many bytes of the file were read into buf (at most len(buf))."""
        raise NotImplementedError

    def size(self, rel: str) -> int:
        """Return the file's size in bytes."""
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

    def rm(self, rel: str) -> bool:
        """Return True if a file was removed."""
        raise NotImplementedError

    def rmtree(self, rel: str) -> bool:
        """Return True if a folder was removed with everything in it."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> bool:
        """Return True if src was moved to dst, False if src was gone."""
        raise NotImplementedError

    def makedirs(self, rel: str) -> None:
        """Create a folder and its parents if missing."""
        raise NotImplementedError

    def fsync_dir(self, rel: str) -> None:
        """Make the names in a folder durable (no-op where the backend has no such notion)."""
        raise NotImplementedError

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

    def read_into(self, rel: str, buf: memoryview) -> int:
        """Return the number of bytes read from the file into buf (pread in a loop; stops at end of file)."""
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            total, n = 0, len(buf)
            while total < n:
                got = os.preadv(fd, [buf[total:]], total)
                if got == 0:
                    break
                total += got
            return total
        finally:
            os.close(fd)

    def size(self, rel: str) -> int:
        return os.stat(self.path(rel)).st_size

    def write_file(self, rel: str, data: Any) -> None:
        """Write data (bytes or a contiguous buffer) to the file and fsync it; not atomic (the commit is)."""
        fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_temp(self, rel: str, data: bytes) -> str:
        tmp = f"{self.path(rel)}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write data to a temp file, fsync it, rename it into place and fsync the folder."""
        tmp = self._write_temp(rel, data)
        try:
            os.replace(tmp, self.path(rel))
        except BaseException:
            _silent_unlink(tmp)
            raise
        self.fsync_dir(os.path.dirname(rel))

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

    def rename(self, src: str, dst: str) -> bool:
        """Return True if this call moved src to dst; False if src was already gone (another process won)."""
        try:
            os.rename(self.path(src), self.path(dst))
            return True
        except FileNotFoundError:
            return False

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def fsync_dir(self, rel: str) -> None:
        """Fsync a folder so the names created in it survive a power loss."""
        fd = os.open(self.path(rel), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        except OSError as e:  # some file systems (e.g. certain network mounts) refuse fsync on folders
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise
        finally:
            os.close(fd)


class FsspecFS(StoreFS):
    """A store behind any fsspec URL (memory://, s3://, ...): puts are whole-object, so the commit record written
    last is what makes a shard real; there is no fsync to call and no O_EXCL, so claims are best effort."""

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

    def read_into(self, rel: str, buf: memoryview) -> int:
        data = self.fs.cat_file(self.path(rel), start=0, end=len(buf))
        buf[: len(data)] = data
        return len(data)

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

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
            # No exclusive create here: check, write, then read back to see whose bytes won.
            if self.fs.exists(self.path(rel)):
                return False
            self.fs.pipe_file(self.path(rel), data)
            return self.fs.cat_file(self.path(rel)) == data
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

    def rename(self, src: str, dst: str) -> bool:
        try:
            self.fs.mv(self.path(src), self.path(dst))
            return True
        except FileNotFoundError:
            return False

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def fsync_dir(self, rel: str) -> None:
        return None


def _silent_unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def open_fs(url: str) -> StoreFS:
    """Return the file access for a store path: a local folder or file:// URL gets LocalFS, anything else fsspec."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalFS(text[len("file://"):])
    if "://" in text:
        return FsspecFS(text)
    return LocalFS(text)
