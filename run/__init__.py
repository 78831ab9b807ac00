"""dflash.run: `dflash run` supervises `dflash extract` and `dflash train --follow` as child processes."""
from __future__ import annotations

from .supervise import grow_gpus, supervise

__all__ = ["supervise", "grow_gpus"]
