"""Ranks that share a sharded target move in lockstep: every forward all-gathers each layer's weights from all of
them, so each calls the forward the same number of times. Before each forward the ranks agree whether any of them
still has rows; one that has none runs an empty forward until none has. A collective that fails or hangs (a peer
killed) ends the rank with one line, never a hang."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Iterator

import torch

from ..errors import PeerError

__all__ = ["Lockstep", "collective", "agree_any"]

log = logging.getLogger(__name__)


def _where() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Watchdog:
    """Ends the process with one line when a collective has not returned within --collective-timeout: the process
    group's own timeout is a minute longer (target.sharded.init_group), since NCCL's aborts the process with a core
    dump; a peer that is gone is usually reported at once by the backend (gloo: connection reset)."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline_s = timeout_s
        self._since: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="dflash-collective-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def armed(self, what: str) -> Iterator[None]:
        with self._lock:
            self._since, self._what = time.monotonic(), what
        try:
            yield
        finally:
            with self._lock:
                self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                late = self._since is not None and time.monotonic() - self._since > self.deadline_s
                what = self._what
            if late:
                rank, world = _where()
                sys.stderr.write(f"dflash: error: rank {rank} of {world}: {what} waited {self.deadline_s:.0f} s for "
                                 "its peers (one was killed or hangs); every committed shard is intact; rerun the "
                                 "same command to resume\n")
                sys.stderr.flush()
                os._exit(PeerError.exit_code)


_watchdog: _Watchdog | None = None


@contextlib.contextmanager
def collective(what: str, timeout_s: float) -> Iterator[None]:
    """Run a block that holds collectives of the sharded target: a failure of the backend (a peer gone) becomes one
    PeerError line, and a block that outlives the timeout ends the process with one line."""
    import torch.distributed as dist

    global _watchdog
    if _watchdog is None:
        _watchdog = _Watchdog(timeout_s)
    try:
        with _watchdog.armed(what):
            yield
    except RuntimeError as e:
        if not _lost_peer(e):
            raise
        rank, world = _where()
        first = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [type(e).__name__])[0])
        first = first.split(". ")[0][:160]
        raise PeerError(f"rank {rank} of {world}: {what} failed in a collective ({first}): a peer rank stopped "
                        f"(killed, failed, or hung past --collective-timeout {timeout_s:.0f} s); every committed "
                        "shard is intact; rerun the same command to resume") from None


# What the backends' errors of a lost peer say (gloo raises a plain RuntimeError: "Connection reset by peer").
_PEER_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe")


def _lost_peer(e: RuntimeError) -> bool:
    """Return True if a RuntimeError is the process group's (a peer lost, a collective timed out)."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    if isinstance(e, torch.OutOfMemoryError):
        return False
    text = str(e).lower()
    return any(w in text for w in _PEER_WORDS)


def agree_any(flag: bool) -> bool:
    """Return True if any rank of the process group passed True (every rank gets the same answer)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Lockstep:
    """The runner of a sharded target, called by the pipeline as any runner: each forward is preceded by the ranks'
    agreement that some rank has rows; finish() runs empty forwards while any other rank still has some."""

    # A forward that runs out of memory half-way has left its peers inside a layer's all-gather: the pipeline must
    # not retry it in halves (extract/pipeline.py), the rank ends with one line and its peers with theirs.
    in_lockstep = True

    def __init__(self, runner: Any, timeout_s: float) -> None:
        self.runner = runner
        self.timeout_s = timeout_s
        self.empty_forwards = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def features(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Return the runner's features of a batch, in step with the other ranks."""
        with collective("a forward of the sharded target", self.timeout_s):
            agree_any(True)
            return self.runner.features(input_ids, lengths)

    def finish(self) -> int:
        """Run empty forwards until no rank has rows left; return how many this rank ran."""
        empty = torch.zeros((1, 1), dtype=torch.long, device=self.runner.device)
        while True:
            with collective("an empty forward of the sharded target (this rank has no rows left)", self.timeout_s):
                if not agree_any(False):
                    break
                self.runner.features(empty, [1])
            self.empty_forwards += 1
        if self.empty_forwards:
            log.info("ran %d empty forward(s) while peers finished their rows", self.empty_forwards)
        return self.empty_forwards
