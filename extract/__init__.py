"""dflash.extract: conversations -> target forward with layer capture -> committed shards of a store."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ExtractConfig

__all__ = ["run"]


def run(cfg: "ExtractConfig") -> dict[str, Any]:
    """Return the summary of `dflash extract` run with a validated config (torch is imported only now)."""
    from .orchestrate import run as _run

    return _run(cfg)
