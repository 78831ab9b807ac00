"""Which file access a store path gets: a local folder or file:// URL the local file system, s3:// the S3 client
with conditional creates (s3.py), any other URL fsspec."""
from __future__ import annotations

import os

from .fs import FsspecFS, LocalFS, StoreFS

__all__ = ["open_fs"]


def open_fs(url: str) -> StoreFS:
    """Return the file access for a store path: a local folder or file:// URL gets LocalFS, s3:// S3FS, anything
    else fsspec."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalFS(text[len("file://"):])
    if text.startswith("s3://"):
        from .s3 import open_s3  # s3fs and its client load only for s3:// stores

        return open_s3(text)
    if "://" in text:
        return FsspecFS(text)
    return LocalFS(text)
