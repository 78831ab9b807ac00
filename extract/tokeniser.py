"""A worker's shards tokenised in a child process beside its device (a CUDA worker's, from its second shard on).

Rendering a chat template is pure Python, and a thread of the worker's own process running it starves the main
thread's kernel launches: each launch lets go of the GIL and waits to take it back, and a thread that runs bytecode
keeps it until the interpreter's switch interval is up (5 ms by default). On 2026-12-07 (one H200, the
Qwen3-30B-A3B shape's compiled command) a shard's forward took 7.33 s of device time in the command against 6.65 s
with a 0.2 ms interval, about the 0.60 s its tokenising took; a CPU probe ran small torch ops 531x slower beside a
pure-Python thread at 5 ms, 17x at 0.2 ms (bench/RESULTS.md). In a child process the template holds its own GIL.

The child is spawned when the worker starts (its imports and tokenizer load beside the target's load) and gets the
config and the plan once (the plan is the data's index: plan.ExtractionPlan); each shard then costs its id out and its
samples back (two small arrays a sample).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from ..conversations import BadRowLog
from ..errors import ResourceError

__all__ = ["shard_samples", "ChildTokeniser", "Tokenised"]

# The child's own state: (config, plan, encoder) from its initializer.
_CHILD: dict[str, Any] = {}


def shard_samples(plan: Any, shard_id: int, encoder: Any, min_loss_tokens: int,
                  strict: bool) -> tuple[list[Any], dict[str, Any], int]:
    """Return one shard's trainable samples, its commit extra (rows, drops, altered rows) and how many rows were
    dropped."""
    from .worker import prepare_shard

    start, stop, rows = plan.shard_rows(shard_id)
    altered = BadRowLog()
    samples, dropped = prepare_shard(rows, encoder, min_loss_tokens, strict, altered)
    extra = {"rows": [start, stop], "dropped": dropped.to_dict(), "altered": altered.to_dict()}
    return samples, extra, stop - start - len(samples)


def _child_init(cfg_dict: dict[str, Any], plan: Any, parent: int) -> None:
    from ..config import ExtractConfig
    from .worker import open_encoder

    # A worker killed outright (SIGKILL, the OOM killer) cannot end its pool: the child ends itself once it is
    # orphaned (its queue's pipe stays open, held by the child itself, so it would wait for work forever).
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="dflash-orphan-watch", daemon=True).start()
    cfg = ExtractConfig.from_dict(cfg_dict)
    _CHILD.update(cfg=cfg, plan=plan, encoder=open_encoder(cfg)[0])


def _exit_when_orphaned(parent: int, every_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)


def _child_ready() -> bool:
    return True


def _child_shard(shard_id: int) -> tuple[list[tuple[int, Any, Any]], dict[str, Any], int, float]:
    t0 = time.perf_counter()
    cfg = _CHILD["cfg"]
    samples, extra, dropped = shard_samples(_CHILD["plan"], shard_id, _CHILD["encoder"], cfg.min_loss_tokens,
                                            cfg.strict)
    # Plain tuples back: the parent makes its Samples (the child's pickle need not name the pipeline's class).
    return [(s.row, s.input_ids, s.loss_mask) for s in samples], extra, dropped, time.perf_counter() - t0


def _died(shard_id: int) -> ResourceError:
    return ResourceError(
        f"shard {shard_id}: the worker's tokeniser process died (killed, or out of memory) before it tokenised the "
        "shard; every committed shard is intact: free memory and rerun the same command to resume")


class Tokenised:
    """One shard's samples on their way from the child: result() gives (samples, extra) as a thread's future does,
    and counts the shard's tokenising time and dropped rows (on_done) when they arrive."""

    def __init__(self, future: Future, shard_id: int, on_done: Callable[[int, float, int], None]) -> None:
        self._future, self._shard_id, self._on_done = future, shard_id, on_done

    def result(self) -> tuple[list[Any], dict[str, Any]]:
        from .pipeline import Sample

        try:
            rows, extra, dropped, seconds = self._future.result()
        except BrokenProcessPool:
            raise _died(self._shard_id) from None
        self._on_done(self._shard_id, seconds, dropped)
        return [Sample(row, ids, mask) for row, ids, mask in rows], extra


class ChildTokeniser:
    """The child process that tokenises a worker's shards: submit(shard_id) -> Tokenised; shutdown() ends it."""

    def __init__(self, cfg: Any, plan: Any, on_done: Callable[[int, float, int], None]) -> None:
        self._on_done = on_done
        self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_child_init,
                                         initargs=(cfg.to_dict(), plan, os.getpid()))
        self._pool.submit(_child_ready)  # starts the child now: its imports overlap the target's load

    def submit(self, shard_id: int) -> Tokenised:
        try:
            return Tokenised(self._pool.submit(_child_shard, shard_id), shard_id, self._on_done)
        except BrokenProcessPool:  # it died after the shard before: the pool refuses new work
            raise _died(shard_id) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
