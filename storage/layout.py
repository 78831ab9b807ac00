"""Names and header rules of store format v1: where every file lives, what a header must hold, how two differ."""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

from ..runtime.nested import flatten, nested_diff
from ..errors import ManifestMismatch, StoreError
from .codec import CODECS

__all__ = [
    "FORMAT_VERSION",
    "ROOT_META",
    "COMPLETE",
    "shard_dir",
    "commit_path",
    "claim_path",
    "parse_id",
    "validate_header",
    "header_diff",
    "check_header",
    "group_metadata",
    "dumps",
    "record_digest",
    "header_digest",
    "INFORMATIONAL",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROOT_META = "zarr.json"
COMPLETE = "complete.json"
SHARDS = "shards"
COMMITS = "commits"
CLAIMS = "claims"
# Keys storage adds to the header itself; never part of a comparison the caller asked for.
_OWN_KEYS = ("format_version",)
# A header may list dotted fields that are there for information only (where the target lay, say): they are neither
# compared nor part of the header's digest, so moving a model folder changes nothing a store's identity rests on.
INFORMATIONAL = "informational"


def shard_dir(shard_id: int) -> str:
    """Return the store-relative folder of a shard: zero-padded so listings sort."""
    return f"{SHARDS}/{shard_id:05d}"


def commit_path(shard_id: int) -> str:
    """Return the store-relative path of a shard's commit record."""
    return f"{COMMITS}/{shard_id:05d}.json"


def claim_path(shard_id: int) -> str:
    """Return the store-relative path of a shard's claim file."""
    return f"{CLAIMS}/{shard_id:05d}.json"


def parse_id(name: str, suffix: str = "") -> int | None:
    """Return the shard id of a listed name ("00042.json" -> 42), or None for anything else (temp files)."""
    if suffix:
        if not name.endswith(suffix):
            return None
        name = name[: -len(suffix)]
    return int(name) if name.isdigit() else None


def dumps(obj: Any) -> bytes:
    """Return canonical JSON bytes (sorted keys) so equal content hashes equally."""
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode()


def record_digest(record: dict) -> str:
    """Return the xxh3_64 hex digest of a commit record's content without its own digest field."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(dumps({k: v for k, v in record.items() if k != "record_xxh3"}))


def _identity(header: dict) -> dict:
    """Return the header without its informational fields: what two headers must share to be the same store."""
    skip = _informational(header)
    return {k: v for k, v in flatten(header).items() if not skip(k)}


def _informational(*headers: dict) -> Callable[[str], bool]:
    """Return whether a dotted field is informational in any of the headers: named there, or below a named one
    ("dataset.generated_by" covers each file's record)."""
    named = tuple({s for h in headers for s in (h.get(INFORMATIONAL) or [])})
    return lambda key: any(key == s or key.startswith(s + ".") for s in named)


def header_digest(header: dict) -> str:
    """Return the xxh3_64 hex digest of a header's identity (format version included, informational fields not).

    Every commit record carries the digest of the header it was written under, so a shard made under one header
    is never read, verified or resumed as part of a store with another (a replaced or recreated zarr.json).
    """
    import xxhash

    return xxhash.xxh3_64_hexdigest(dumps(_identity(header)))


def group_metadata(attributes: dict | None = None) -> dict:
    """Return a zarr v3 group `zarr.json` document."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def validate_header(header: dict, where: str) -> None:
    """Raise StoreError unless the header holds the fields storage relies on, with usable values."""
    if not isinstance(header, dict):
        raise StoreError(f"{where}: the header must be a JSON object, found {type(header).__name__}")
    try:
        json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StoreError(f"{where}: the header must be plain JSON values ({e})") from None
    problems = []
    ids = header.get("layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        problems.append(f"layer_ids must be a non-empty list of ints, found {ids!r}")
    hs = header.get("hidden_size")
    if not (isinstance(hs, int) and not isinstance(hs, bool) and hs > 0):
        problems.append(f"hidden_size must be a positive int, found {hs!r}")
    if header.get("codec") not in CODECS:
        problems.append(f"codec must be one of {', '.join(CODECS)}, found {header.get('codec')!r}")
    plan = header.get("shard_plan")
    n = plan.get("num_shards") if isinstance(plan, dict) else None
    if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
        problems.append(f"shard_plan.num_shards must be a positive int, found {n!r}")
    if problems:
        raise StoreError(f"{where}: invalid store header: {'; '.join(problems)}")


def header_diff(stored: dict, expected: dict) -> list[tuple[str, Any, Any]]:
    """Return (dotted field, stored value, expected value) for every field that differs; missing reads as None."""
    return nested_diff({k: v for k, v in stored.items() if k not in _OWN_KEYS},
                       {k: v for k, v in expected.items() if k not in _OWN_KEYS}, ignore=_informational(stored, expected))


def check_header(stored: dict, expected: dict, where: str) -> None:
    """Raise ManifestMismatch naming every differing field with both values, in one line."""
    diffs = header_diff(stored, expected)
    if diffs:
        parts = "; ".join(f"{k}: store has {json.dumps(s)}, asked for {json.dumps(e)}" for k, s, e in diffs)
        raise ManifestMismatch(
            f"{where} was written with different settings ({parts}); "
            "rerun with the store's settings, or choose a new --out for the new ones"
        )
