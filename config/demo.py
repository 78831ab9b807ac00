"""Options of `dflash demo`."""
from __future__ import annotations

from dataclasses import dataclass

from .base import StageConfig
from .options import DRAFTERS, POSITION_WEIGHTS, check, drafter_option, option, position_weights_option

__all__ = ["DEMO_BUDGETS", "DemoConfig"]

DEMO_BUDGETS = ("auto", "full", "gpu", "tiny")


@dataclass(frozen=True, kw_only=True)
class DemoConfig(StageConfig):
    """Options of `dflash demo`: the whole recipe on the embedded target."""

    out: str = option("dflash-demo", help="Folder for every stage's output (rerun to resume).")
    device: str = option("cpu", choices=("cpu", "cuda"), help="Where every stage runs.")
    budget: str = option("auto", choices=DEMO_BUDGETS,
                         help="How much data and training: auto picks full on cpu, gpu on cuda; tiny is a smoke run.")
    self_prompts: int | None = option(
        None, help="Prompts the target writes itself and answers, besides the bundled ones (default: the budget's, "
                   "10,000 for gpu, 0 for full).")
    position_weights: str | None = position_weights_option(
        None, " Default: the budget's (gpu: dpace; full, on a CPU: decay).")
    drafter: str | None = drafter_option(None, " Default: the budget's (gpu: dflash2; full, on a CPU: dflash, whose "
                                               "steps cost a CPU far less).")

    def __post_init__(self) -> None:
        check(self.device in ("cpu", "cuda"), f"--device {self.device!r}: use cpu or cuda")
        check(self.position_weights in (None,) + POSITION_WEIGHTS,
               f"--position-weights {self.position_weights!r}: use {' or '.join(POSITION_WEIGHTS)}")
        check(self.drafter in (None,) + DRAFTERS, f"--drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        check(self.budget in DEMO_BUDGETS, f"--budget {self.budget!r}: use one of {', '.join(DEMO_BUDGETS)}")
        check(self.self_prompts is None or self.self_prompts >= 0,
               f"--self-prompts must be >= 0, got {self.self_prompts}")
        if self.budget == "auto":
            object.__setattr__(self, "budget", "gpu" if self.device == "cuda" else "full")
