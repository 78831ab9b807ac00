"""Progress of an extract run aggregated over workers, and its final summary."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from ..runtime.process import Progress as Display
from ..runtime.process import prune_window, window_rate
from .perf import perf_line

__all__ = ["Progress", "summarise", "format_summary"]

log = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0


class Progress:
    """Counts rows, tokens and bytes as workers report them, shown with rate and ETA (see runtime.Progress)."""

    def __init__(self, total_rows: int, *, show: bool = True, run_rows: Any = None, world: int = 1) -> None:
        self.total_rows = total_rows
        self.rows = self.samples = self.tokens = self.bytes = self.shards = 0
        # run_rows(): the rows of the shards every rank has committed since the start, for a rank that shows the
        # progress of a launched run (its own events are 1/world of it): read from the store at most every 5 s.
        self.run_rows, self.world, self._counted = run_rows, world, -1e9
        self.display = Display(total_rows, unit="row", desc="extract", show=show, every_s=_LOG_EVERY_S, logger=log)
        # (time, samples, tokens) at each batch: the rates shown are over the last minute of batches
        # (runtime.process.window_rate), not since the process started, whose start-up (the target's load, the
        # self-check, kernels compiled and autotuned on the first batches: minutes for a large or hybrid target)
        # would hold them down for a long while; the ETA likewise (the display's own)
        self._seen: deque[tuple[float, int, int]] = deque()

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
        now = time.perf_counter()
        if kind == "batch":
            self._seen.append((now, self.samples, self.tokens))
            prune_window(self._seen, now)
        rate = window_rate(self._seen)
        speed = (f"{rate[1]:,.0f} tok/s, {rate[0]:,.1f} samples/s" if rate is not None
                 else "rates from the second batch on")
        detail = f"{self.shards} shards, {speed}, {self.bytes / 1e9:.2f} GB written"
        if self.run_rows is None or not self.display.show:
            self.display.update(rows, detail=detail)
        elif now - self._counted >= 5.0 or kind == "shard":
            self._counted = now
            self.display.update(to=self.run_rows(), detail=f"{self.world} ranks; this one: {detail}")

    def close(self) -> None:
        """Close the display."""
        self.display.close()


def summarise(store: Any, worker_results: list[dict[str, Any]],
              since: tuple[set[int], int, float] | None = None) -> dict[str, Any]:
    """Return dataset-level totals over every committed shard, plus this run's per-device rates and disk waits;
    with `since` (the shards committed before this run, its ranks, its seconds), also what every rank committed in
    this run ("this_run")."""
    samples = tokens = loss_tokens = nbytes = raw = 0
    run_shards = run_tokens = 0
    # dropped: rows that gave no sample; altered: rows kept but changed (invalid UTF-8 replaced, cut at max length)
    counts: dict[str, dict[str, int]] = {"dropped": {}, "altered": {}}
    rows_of: dict[str, dict[str, list[int]]] = {"dropped": {}, "altered": {}}
    for sid in store.committed_ids():
        rec = store.commit_record(sid)
        samples += rec.get("num_samples", 0)
        tokens += rec.get("num_tokens", 0)
        if since is not None and sid not in since[0]:
            run_shards += 1
            run_tokens += int(rec.get("num_tokens", 0))
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
            "load_s": r.get("load_s"),
            "first_commit_s": r.get("first_commit_s"),
            "steady_tokens_per_s": round(r["tokens"] / r["steady_s"], 1) if r.get("steady_s") else 0.0,
            "writer_copy_wait_s": r.get("writer_copy_wait_s"),
            "writer_sink_s": r.get("writer_sink_s"),
            "perf": r.get("perf") or None,
        }
        for r in worker_results
    ]
    this_run = ({"this_run": {"ranks": since[1], "shards": run_shards, "tokens": run_tokens,
                              "seconds": round(since[2], 1)}} if since is not None else {})
    return {
        **this_run,
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
    run = s.get("this_run")
    if run:
        rate = run["tokens"] / run["seconds"] if run["seconds"] else 0.0
        lines.append(f"  all {run['ranks']} ranks: {run['shards']} shards, {run['tokens']:,} tokens committed in "
                     f"{run['seconds']:.1f} s, {rate:,.0f} tok/s to disk (the lines below are this rank's devices)")
    for d in s["devices"]:
        lines.append(
            f"  {d['device']}: {d['shards']} shards, {d['tokens']:,} tokens, {d['tokens_per_s']:,.0f} tok/s forward, "
            f"{d['steady_tokens_per_s']:,.0f} tok/s to disk (first forward to last commit), waited "
            f"{d['disk_wait_s']:.1f} s on the disk, padding {100 * d['padding']:.2f}%"
        )
        if d.get("load_s") is not None:
            first = f"{d['first_commit_s']:.1f} s" if d.get("first_commit_s") is not None else "none"
            lines.append(f"  {d['device']}: model loaded in {d['load_s']:.1f} s, first commit {first} after that")
        if d.get("perf"):
            lines.append(f"  {d['device']}: {perf_line(d['perf'])}")
        if d.get("writer_sink_s") is not None:
            lines.append(f"  {d['device']}: writer thread waited {d['writer_copy_wait_s']:.1f} s for the device's "
                         f"copies and spent {d['writer_sink_s']:.1f} s handing features to the store")
    return "\n".join(lines)
