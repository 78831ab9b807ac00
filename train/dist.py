"""This rank of `dflash train` (one process per GPU, started by torchrun or `runtime.launch`): device, gloo or NCCL
group, and collectives that are no-ops in a world of one."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import resolve_devices
from ..runtime.process import ranks_from_env, setup_logging

if TYPE_CHECKING:
    import torch

__all__ = ["Dist"]

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

        ranks = ranks_from_env()
        rank, world = ranks.rank, ranks.world
        devices = resolve_devices(gpus)
        device = torch.device(devices[(ranks.local_rank or 0) % len(devices)])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world > 1:
            setup_logging(logging.getLogger().getEffectiveLevel(), rank)  # rank 0 alone prints progress
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
