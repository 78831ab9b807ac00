"""Process layout of `dflash train`: one process per GPU (spawned here or by torchrun), gloo on CPU, collectives."""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..config import resolve_devices
from ..errors import DflashError

if TYPE_CHECKING:
    import torch

__all__ = ["Dist", "launch"]

log = logging.getLogger(__name__)


@dataclass
class Dist:
    """This process's rank, the world size, its device, and collectives that are no-ops in a world of one."""

    rank: int
    world: int
    device: "torch.device"

    @classmethod
    def setup(cls, gpus: str) -> "Dist":
        """Return the layout from RANK/WORLD_SIZE/LOCAL_RANK (torchrun or our own launcher), initialising the group."""
        import torch
        import torch.distributed as dist

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", rank))
        devices = resolve_devices(gpus)
        device = torch.device(devices[local % len(devices)])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
        return cls(rank, world, device)

    def all_reduce(self, t: "torch.Tensor") -> "torch.Tensor":
        """Return the sum of t over ranks (in place)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def broadcast(self, obj: Any) -> Any:
        """Return rank 0's obj on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Return every rank's obj on every rank (small objects only)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                # Tear down together: a gloo rank that destroys its group while a peer is still busy (rank 0
                # plots the curves first) can abort the peer's process ("terminate called without an active
                # exception", seen once in CI).
                dist.barrier()
                dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], args: tuple, rank: int, world: int, port: int, errors: Any, level: int) -> None:
    logging.basicConfig(level=level if rank == 0 else max(level, logging.WARNING),
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        fn(*args)
    except DflashError as e:
        errors.put((rank, type(e).__name__, str(e)))
        raise SystemExit(2)


def launch(fn: Callable[..., Any], args: tuple, world: int) -> None:
    """Run fn(*args) in `world` spawned processes (ranks 0..world-1); re-raise the first DflashError of any."""
    import multiprocessing as mp

    from .. import errors as errors_mod

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    level = logging.getLogger().getEffectiveLevel()
    procs = [ctx.Process(target=_child, args=(fn, args, r, world, port, errors, level), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    failed = None
    try:
        while any(p.is_alive() for p in procs):
            bad = [p for p in procs if p.exitcode not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            time.sleep(0.2)
        failed = failed or next((p for p in procs if p.exitcode not in (None, 0)), None)
    finally:
        if failed is not None or any(p.is_alive() for p in procs):
            time.sleep(1.0)  # let the failing rank's message arrive before its peers are stopped
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if failed is not None:
        if not errors.empty():
            rank, kind, message = errors.get()
            cls = getattr(errors_mod, kind, DflashError)
            raise cls(message)
        raise DflashError(f"training process {procs.index(failed)} of {world} died with exit code {failed.exitcode}; "
                          "see its log above, then rerun with --resume")
