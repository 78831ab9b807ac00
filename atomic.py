"""Write a file whole or not at all: a temp file beside it, fsync, rename."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace `path` with `data` (str is written as UTF-8); a crash leaves the old file or the new one, never half.

    The temp name starts with a dot and carries the pid, so concurrent writers never share one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
