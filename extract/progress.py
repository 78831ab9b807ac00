"""Progress of an extract run aggregated over workers, and its final summary."""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["Progress", "summarise", "format_summary"]

log = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0


class Progress:
    """Counts rows, tokens and bytes as workers report them; a tqdm bar on a terminal, periodic log lines otherwise."""

    def __init__(self, total_rows: int, *, show: bool = True) -> None:
        self.total_rows = total_rows
        self.rows = 0
        self.samples = 0
        self.tokens = 0
        self.bytes = 0
        self.shards = 0
        self.t0 = time.perf_counter()
        self._last_log = self.t0
        self._bar = None
        self.show = show
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_rows, unit="row", dynamic_ncols=True, desc="extract")

    def update(self, event: dict[str, Any]) -> None:
        """Fold one worker event (batch, dropped, shard) into the totals and refresh the display."""
        kind = event.get("kind")
        rows = 0
        if kind == "batch":
            rows = event["samples"]
            self.samples += event["samples"]
            self.tokens += event["tokens"]
        elif kind == "dropped":
            rows = event["samples"]
        elif kind == "shard":
            self.shards += 1
            self.bytes += int(event.get("bytes", 0))
        self.rows += rows
        self._show(rows)

    def _show(self, rows: int) -> None:
        if not self.show:
            return
        elapsed = max(1e-9, time.perf_counter() - self.t0)
        tok_s = self.tokens / elapsed
        if self._bar is not None:
            self._bar.update(rows)
            self._bar.set_postfix_str(f"{tok_s:,.0f} tok/s {self.samples / elapsed:,.1f} samples/s {self.bytes / 1e9:.2f} GB", refresh=False)
            return
        now = time.perf_counter()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            left = self.total_rows - self.rows
            eta = left / (self.rows / elapsed) if self.rows else float("nan")
            log.info(
                "%d/%d rows, %d shards, %.0f tok/s, %.1f samples/s, %.2f GB written, ETA %.0f s",
                self.rows, self.total_rows, self.shards, tok_s, self.samples / elapsed, self.bytes / 1e9, eta,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def summarise(store: Any, worker_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Return dataset-level totals over every committed shard, plus this run's per-device rates and disk waits."""
    samples = tokens = loss_tokens = nbytes = raw = 0
    # dropped: rows that gave no sample; altered: rows kept but changed (invalid UTF-8 replaced, cut at max length)
    counts: dict[str, dict[str, int]] = {"dropped": {}, "altered": {}}
    rows_of: dict[str, dict[str, list[int]]] = {"dropped": {}, "altered": {}}
    for sid in store.committed_ids():
        rec = store.commit_record(sid)
        samples += rec.get("num_samples", 0)
        tokens += rec.get("num_tokens", 0)
        loss_tokens += rec.get("num_loss_tokens", 0)
        nbytes += rec.get("bytes", 0)
        raw += rec.get("raw_feature_bytes", 0)
        for what in counts:
            d = (rec.get("extra") or {}).get(what, {})
            for reason, n in d.get("counts", {}).items():
                counts[what][reason] = counts[what].get(reason, 0) + n
            for reason, rows in d.get("rows", {}).items():
                rows_of[what].setdefault(reason, []).extend(rows)
    devices = [
        {
            "device": r["device"],
            "shards": r["shards"],
            "tokens": r["tokens"],
            "tokens_per_s": round(r["tokens"] / r["seconds"], 1) if r.get("seconds") else 0.0,
            "disk_wait_s": r["wait_s"],
            "padding": round(1 - r["tokens"] / r["padded_tokens"], 4) if r.get("padded_tokens") else 0.0,
        }
        for r in worker_results
    ]
    return {
        "samples": samples,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        **{what: dict(sorted(counts[what].items())) for what in counts},
        # every row is in its shard's record
        **{f"{what}_rows": {k: sorted(v)[:100] for k, v in sorted(rows_of[what].items())} for what in rows_of},
        "bytes": nbytes,
        "raw_feature_bytes": raw,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else 0.0,
        "devices": devices,
    }


def format_summary(s: dict[str, Any], where: str, shown_rows: int = 5) -> str:
    """Return the human summary of an extract run: counts, drops with first row numbers, bytes, rates, waits."""
    lines = [
        f"extract -> {where}: {s['samples']:,} samples, {s['tokens']:,} tokens ({s['loss_tokens']:,} loss tokens), "
        f"{s['bytes'] / 1e9:.3f} GB, {s['bytes_per_token']:,.0f} bytes/token",
    ]
    for what in ("dropped", "altered"):
        for reason, n in s.get(what, {}).items():
            rows = s[f"{what}_rows"].get(reason, [])
            more = ", ..." if len(rows) > shown_rows else ""
            lines.append(f"  {what} {n:,} rows ({reason}): rows {', '.join(map(str, rows[:shown_rows]))}{more}")
    for d in s["devices"]:
        lines.append(
            f"  {d['device']}: {d['shards']} shards, {d['tokens']:,} tokens, {d['tokens_per_s']:,.0f} tok/s, "
            f"waited {d['disk_wait_s']:.1f} s on the disk, padding {100 * d['padding']:.2f}%"
        )
    return "\n".join(lines)
