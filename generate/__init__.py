"""dflash.generate: the target answers prompts through its chat template (the drafter learns its own answers).

Imports nothing heavy: torch and transformers load inside `run`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import GenerateConfig

__all__ = ["run"]


def run(cfg: "GenerateConfig") -> Any:
    """Run `dflash generate` with a validated config (answers, or prompts with --self-prompts); return its
    GenerateResult."""
    if cfg.self_prompts is not None:
        from .self_prompts import run as write_prompts

        return write_prompts(cfg)
    from .answer import run as answer

    return answer(cfg)
