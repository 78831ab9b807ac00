"""dflash.train: the DFlash drafter, its objective, the streaming loader and the training loop."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["run"]


def run(cfg: "TrainConfig") -> None:
    """Run `dflash train` with a validated config."""
    from ..errors import NotBuiltError

    raise NotBuiltError("`dflash train` is not built yet (it arrives with the training issue); nothing was done")
