"""One extract worker (one process per device): claims uncommitted shards one at a time and fills them."""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InputError, StoreError
from .data import BadRowLog, Row
from .plan import shard_ranges

__all__ = ["WorkerSpec", "prepare_shard", "open_pipeline", "run_worker", "fill_shards"]

log = logging.getLogger(__name__)

Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs besides the config: its device, its number, and the header the store must have."""

    device: str
    index: int
    header: dict[str, Any]


def prepare_shard(rows: list[Row], encoder: Any, min_loss_tokens: int, strict: bool) -> tuple[list[Any], BadRowLog]:
    """Return the shard's trainable samples and the log of its dropped rows (bad rows and too few loss tokens)."""
    from .pipeline import Sample
    from .template import TemplateError

    samples: list[Sample] = []
    dropped = BadRowLog()
    for row in rows:
        reason, detail = row.error, row.detail
        if reason is None:
            try:
                enc = encoder.encode(row.messages)
            except TemplateError as e:
                reason, detail = "template_error", str(e)
            else:
                n = enc.num_loss_tokens
                if n == 0:
                    reason, detail = "no_loss_tokens", "no assistant token left after truncation"
                elif n < min_loss_tokens:
                    # Not a bad row, a filter: recorded the same way so a resumed run never redoes it.
                    dropped.add("too_few_loss_tokens", row.index)
                    continue
                else:
                    samples.append(Sample(row.index, enc.input_ids, enc.loss_mask))
                    continue
        if strict:
            raise InputError(f"{row.where}: bad row ({reason}: {detail}); fix or remove it, or rerun without --strict")
        dropped.add(reason, row.index)
    return samples, dropped


def _commit(writer: Any, shard_id: int, extra: dict, open_writers: dict, done: list, report: Report, index: int) -> None:
    record = writer.commit(extra)
    open_writers.pop(shard_id, None)
    done.append(shard_id)
    report({"kind": "shard", "worker": index, "shard": shard_id, "bytes": record.get("bytes", 0)})


def _disk_full(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return False


def open_pipeline(cfg: Any, header: dict[str, Any], device: str,
                  on_batch: Callable[[int, int], None] | None = None) -> tuple[Any, Any]:
    """Return (the chat encoder, the feature pipeline of the target on `device`) that a worker extracts with."""
    import torch
    from transformers import AutoTokenizer

    from .capture import TargetRunner, load_target
    from .pipeline import FeaturePipeline
    from .template import ChatEncoder, load_template

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    encoder = ChatEncoder(tokenizer, load_template(tokenizer, cfg.chat_template), cfg.max_length)
    model = load_target(cfg.model, dev, getattr(torch, cfg.dtype))
    runner = TargetRunner(model, header["layer_ids"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return encoder, FeaturePipeline(runner, cfg.batch_tokens, pad_id=pad_id, on_batch=on_batch)


def run_worker(cfg: Any, spec: WorkerSpec, rows: list[Row] | None, report: Report) -> dict[str, Any]:
    """Return this worker's totals after it has filled every shard it could claim; report() gets progress events."""
    from ..storage import Store
    from .data import read_rows

    rows = rows if rows is not None else read_rows(cfg.data)
    header = spec.header
    store = Store.open(cfg.out, expected=header)
    encoder, pipeline = open_pipeline(
        cfg, header, spec.device,
        on_batch=lambda n, t: report({"kind": "batch", "worker": spec.index, "samples": n, "tokens": t}),
    )
    ranges = shard_ranges(len(rows), header["shard_plan"]["rows_per_shard"])

    def samples_for(shard_id: int) -> tuple[list[Any], dict[str, Any]]:
        start, stop = ranges[shard_id]
        samples, dropped = prepare_shard(rows[start:stop], encoder, cfg.min_loss_tokens, cfg.strict)
        report({"kind": "dropped", "worker": spec.index, "samples": stop - start - len(samples)})
        return samples, {"rows": [start, stop], "dropped": dropped.to_dict()}

    try:
        result = fill_shards(store, samples_for, pipeline, report, spec, writer_threads=cfg.writer_threads)
    except BaseException as e:
        if _disk_full(e):
            raise StoreError(
                f"{cfg.out}: disk full (ENOSPC) while writing shards; every committed shard is intact. "
                "Free space (or move --out) and rerun the same command to resume"
            ) from None
        raise
    return result


def fill_shards(store: Any, samples_for: Callable, pipeline: Any, report: Report, spec: WorkerSpec, *,
                writer_threads: int | None = None) -> dict[str, Any]:
    """Return this worker's totals after claiming and committing every shard it could get, one claim at a time.

    samples_for(shard_id) gives the shard's samples and the commit extra (rows, drops). A shard is committed by
    the pipeline's writer thread after its last sample, while the device already runs the next shard, so at most
    two shards are open per worker; a failure aborts them (their claims are released, the data is garbage).
    """
    from .pipeline import PipelineStats

    totals = PipelineStats()
    open_writers: dict[int, Any] = {}
    done: list[int] = []
    t0 = time.perf_counter()
    # Start each worker at a different shard so peers do not race for the same claim first.
    committed = set(store.committed_ids())
    todo = [s for s in range(store.num_shards) if s not in committed]
    k = spec.index % max(1, len(todo))
    try:
        for shard_id in todo[k:] + todo[:k]:
            writer = store.try_claim(shard_id, threads=writer_threads)
            if writer is None:
                continue
            open_writers[shard_id] = writer
            samples, extra = samples_for(shard_id)
            stats = pipeline.submit(samples, writer)
            totals.add(stats)
            extra = {**extra, "device": spec.device, **stats.to_dict()}
            pipeline.then(lambda w=writer, sid=shard_id, x=extra: _commit(w, sid, x, open_writers, done, report, spec.index))
        totals.wait_s += pipeline.drain()
    except BaseException:
        try:
            pipeline.drain()
        except BaseException:
            pass  # the first failure is the one to report
        for w in list(open_writers.values()):
            w.abort()
        raise
    totals.seconds = time.perf_counter() - t0
    return {"device": spec.device, "shards": len(done), "pid": os.getpid(), **totals.to_dict()}
