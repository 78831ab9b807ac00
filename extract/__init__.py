"""dflash.extract: conversations -> target forward with layer capture -> committed shards of a store."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ExtractConfig

__all__ = ["run"]


def run(cfg: "ExtractConfig") -> None:
    """Run `dflash extract` with a validated config."""
    from ..errors import NotBuiltError

    raise NotBuiltError("`dflash extract` is not built yet (it arrives with the extract issue); nothing was done")
