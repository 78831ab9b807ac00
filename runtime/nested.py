"""Differences between two nested JSON-like records, field by dotted field (store headers, run records)."""
from __future__ import annotations

import json
from typing import Any, Callable

__all__ = ["flatten", "nested_diff"]


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Return {dotted key: leaf value} of nested dicts (an empty dict is a leaf)."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def nested_diff(a: dict, b: dict, *, ignore: Callable[[str], bool] = lambda key: False) -> list[tuple[str, Any, Any]]:
    """Return (dotted key, value in a, value in b) of every leaf that differs; a missing leaf reads as None.

    Values are compared in their JSON form, so a tuple equals the list a JSON round trip makes of it.
    """
    fa, fb = flatten(a), flatten(b)
    diffs = []
    for key in sorted(set(fa) | set(fb)):
        if ignore(key):
            continue
        va, vb = fa.get(key), fb.get(key)
        if json.dumps(va, sort_keys=True) != json.dumps(vb, sort_keys=True):
            diffs.append((key, va, vb))
    return diffs
