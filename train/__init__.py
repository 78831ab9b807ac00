"""dflash.train: the objective, the data plan and its streaming, the training loop, checkpoints, evaluation."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["run"]


def run(cfg: "TrainConfig") -> None:
    """Run `dflash train` with a validated config: here under torchrun (or for one device), else one process per GPU.

    torch is imported only now, so `dflash --help` stays fast.
    """
    from ..config import resolve_devices
    from .dist import launch
    from .loop import train_rank

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or another launcher) made the processes
        train_rank(cfg)
        return
    devices = resolve_devices(cfg.gpus)
    if len(devices) == 1:
        train_rank(cfg)
        return
    launch(train_rank, (cfg,), len(devices))
