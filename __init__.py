"""dflash: train DFlash drafters from an offline, resumable cache of target hidden states.

Importing the package is cheap on purpose (no torch, no transformers): `dflash --help` must answer at once.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
