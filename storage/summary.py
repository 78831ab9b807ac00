"""What `dflash inspect` and `dflash verify` report about a store: totals, ratios, writers, and bad shards."""
from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

from ..errors import CorruptShard
from .layout import commit_path
from .store import Store

__all__ = ["inspect_store", "format_inspect", "verify_store"]

log = logging.getLogger(__name__)


def inspect_store(url: str) -> dict[str, Any]:
    """Return a JSON-able summary of a store: header, shards committed/planned, counts, bytes, ratio, writers."""
    store = Store.open(url)
    ids = store.committed_ids()
    totals = Counter()
    writers: Counter[str] = Counter()
    unreadable = []
    for i in ids:
        try:
            rec = store.commit_record(i)
        except CorruptShard:
            unreadable.append(i)
            continue
        for key in ("num_samples", "num_tokens", "num_loss_tokens", "bytes", "raw_feature_bytes"):
            totals[key] += int(rec.get(key, 0))
        w = rec.get("writer", {})
        writers[f"{w.get('host', '?')}:{w.get('pid', '?')}"] += 1
    tokens = totals["num_tokens"]
    return {
        "store": store.url,
        "header": store.header,
        "shards_committed": len(ids),
        "shards_planned": store.num_shards,
        # From the records alone: a store with a record that does not even parse is not complete. Chunks are not
        # read here (that is `dflash verify`), so "complete" never vouches for the data.
        "complete": store.is_complete() and not unreadable,
        "chunks_checked": False,
        "samples": totals["num_samples"],
        "tokens": tokens,
        "loss_tokens": totals["num_loss_tokens"],
        "bytes_on_disk": totals["bytes"],
        "bytes_per_token": totals["bytes"] / tokens if tokens else None,
        # raw bf16 feature bytes over everything stored (features, token arrays, metadata)
        "compression_ratio": totals["raw_feature_bytes"] / totals["bytes"] if totals["bytes"] else None,
        "writers": dict(sorted(writers.items())),
        "unreadable_records": unreadable,
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def format_inspect(info: dict[str, Any]) -> str:
    """Return the human-readable form of inspect_store's summary."""
    h = info["header"]
    lines = [
        f"store        {info['store']}",
        f"format       v{h.get('format_version')}  codec {h.get('codec')}  layers {h.get('layer_ids')}  hidden {h.get('hidden_size')}",
        f"shards       {info['shards_committed']} / {info['shards_planned']} committed"
        + ("  (complete)" if info["complete"] else "  (not complete)")
        + f"; from the commit records only, no chunk was read: `dflash verify {info['store']}` checks them",
        f"samples      {info['samples']:,}",
        f"tokens       {info['tokens']:,}  ({info['loss_tokens']:,} loss tokens)",
        f"on disk      {_gb(info['bytes_on_disk'])}"
        + (f"  {info['bytes_per_token']:,.1f} B/token" if info["bytes_per_token"] else ""),
        f"compression  {info['compression_ratio']:.3f}x vs raw bf16" if info["compression_ratio"] else "compression  -",
        "writers      " + (", ".join(f"{w} ({n})" for w, n in info["writers"].items()) or "-"),
        # What the conversations were rendered with: a drafter must be served with the same template variables.
        f"template     {h.get('chat_template_hash')}  kwargs "
        + (json.dumps(h["chat_template_kwargs"], sort_keys=True) if h.get("chat_template_kwargs") else "none"),
    ]
    if info["unreadable_records"]:
        lines.append(f"UNREADABLE   commit records of shards {info['unreadable_records']}: run `dflash verify`")
    other = {k: v for k, v in h.items() if k not in ("format_version", "codec", "layer_ids", "hidden_size")}
    lines.append("header       " + json.dumps(other, sort_keys=True))
    return "\n".join(lines)


def verify_store(url: str, repair: bool = False) -> tuple[int, list[str]]:
    """Return (shards checked, one line per bad shard); with repair, withdraw each bad shard's commit record."""
    store = Store.open(url)
    ids = store.committed_ids()
    bad: list[str] = []
    unbound = 0
    for i in ids:
        problems = store.verify(i)
        if not problems:
            unbound += "header_xxh3" not in store.commit_record(i)
            continue
        line = f"shard {i:05d}: " + "; ".join(problems)
        if repair:
            store.withdraw(i)
            line += f" -> withdrew {store.fs.display(commit_path(i))}; rerun `dflash extract` to redo it"
        bad.append(line)
        log.debug("bad shard %d: %s", i, problems)
    if unbound:
        log.warning("%s: %d sound shards predate commit records naming their header; they are trusted as this "
                    "header's (re-extract into a new --out to bind them)", store.fs.display(), unbound)
    return len(ids), bad
