"""dflash.train: the objective, the data plan and its streaming, the training loop, checkpoints, evaluation."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["run", "launch_ranks"]


def _rank_main(cfg: "TrainConfig", report: Any) -> None:
    from .loop import train_rank

    train_rank(cfg)


def launch_ranks(cfg: "TrainConfig", world: int) -> None:
    """Train in `world` spawned processes (ranks 0..world-1, gloo or NCCL), as torchrun would start them."""
    from ..runtime.process import launch

    launch(_rank_main, [(cfg,)] * world, what="training", dist_env=True)


def run(cfg: "TrainConfig") -> None:
    """Run `dflash train` with a validated config: here under torchrun (or for one device), else one process per GPU.

    torch is imported only now, so `dflash --help` stays fast, and only after the checks that need no model, so a
    wrong path fails at once.
    """
    from ..config import resolve_devices
    from ..runtime.process import ranks_from_env
    from .run_folder import preflight

    preflight(cfg)
    from .loop import train_rank

    # torchrun (or another launcher) made the processes, or one device: train here; else one process per GPU.
    world = 1 if ranks_from_env().launched else len(resolve_devices(cfg.gpus))
    if world == 1:
        train_rank(cfg)
    else:
        launch_ranks(cfg, world)
