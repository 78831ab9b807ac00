"""dflash.storage: the zarr v3 feature store (format v1); knows nothing about models. See DESIGN.md."""
from __future__ import annotations

from .codec import CODECS
from .layout import FORMAT_VERSION
from .reader import ShardData
from .store import DEFAULT_CHUNK_TOKENS, Store
from .writer import ShardWriter

__all__ = ["Store", "ShardData", "ShardWriter", "CODECS", "FORMAT_VERSION", "DEFAULT_CHUNK_TOKENS"]
