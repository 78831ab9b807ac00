"""`dflash export`: the newest complete checkpoint of a run (or a checkpoint folder) as a Hugging Face folder."""
from __future__ import annotations

import os
from pathlib import Path

from ..drafter.files import write_export
from ..drafter.folders import find_checkpoint

__all__ = ["export_drafter"]


def export_drafter(run: str | os.PathLike, out: str | os.PathLike, *, remote_code: bool = False) -> Path:
    """Write the drafter of a run's newest complete checkpoint (or of a checkpoint folder) to out; return out."""
    return write_export(find_checkpoint(run), out, remote_code=remote_code)
