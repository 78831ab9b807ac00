"""Options of `dflash run`, and how its options map onto its stages' own."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .base import StageConfig
from .extract import ExtractConfig
from .options import check, option, parse_gpus
from .train import TrainConfig

__all__ = ["RunConfig", "RUN_SHARED", "run_stage_options"]


@dataclass(frozen=True, kw_only=True)
class RunConfig(StageConfig):
    """Options of `dflash run` itself; each stage's own options come from ExtractConfig and TrainConfig
    (see run_stage_options)."""

    model: str = option(help="Target model folder: extract's --model and train's --target.")
    data: tuple[str, ...] = option(help="Conversations (repeatable), as for `dflash extract --data`.", metavar="FILE")
    store: str = option(help="Feature store: extract's --out and train's --store.")
    out: str = option(help="Run folder of training (train's --out); the stages' logs go to RUN/logs/.")
    extract_gpus: str = option("0,1,2,3,4", help="GPUs of extraction (extract's --gpus), or cpu.")
    train_gpus: str = option("5,6,7", help="GPUs of training (train's --gpus), or cpu.")
    no_grow: bool = option(False, help="Keep training on --train-gpus when extraction ends (default: it grows onto "
                                       "the freed GPUs, same slots, same batches).")
    retries: int = option(3, help="Restarts of a stage that dies (SIGKILL, crash) without progress in between.")
    progress_every: float = option(30.0, help="Seconds between progress lines.")

    def __post_init__(self) -> None:
        check(bool(self.data), "--data needs at least one file or folder")
        parse_gpus(self.extract_gpus)
        parse_gpus(self.train_gpus)
        check(self.retries >= 0, f"--retries must be >= 0, got {self.retries}")
        check(self.progress_every > 0, f"--progress-every must be > 0, got {self.progress_every}")


# How `dflash run`'s options map onto its stages: these stage fields come from RunConfig (None: `dflash run` sets
# them itself: training always follows extraction and resumes its run folder).
RUN_SHARED: dict[str, dict[str, str | None]] = {
    "ExtractConfig": {"model": "model", "data": "data", "out": "store", "gpus": "extract_gpus"},
    "TrainConfig": {"target": "model", "store": "store", "out": "out", "gpus": "train_gpus", "follow": None,
                    "resume": None},
}


def run_stage_options(cls: type) -> dict[str, str]:
    """Return {field: `dflash run` option name} of the stage's fields that `dflash run` passes through as they are.

    A name both stages have (batch_tokens, dtype) takes the stage's prefix: --extract-batch-tokens, --train-dtype.
    """
    stages = {"ExtractConfig": ExtractConfig, "TrainConfig": TrainConfig}
    other = stages["TrainConfig" if cls.__name__ == "ExtractConfig" else "ExtractConfig"]
    both = {f.name for f in dataclasses.fields(other)}
    prefix = "extract_" if cls.__name__ == "ExtractConfig" else "train_"
    return {f.name: prefix + f.name if f.name in both else f.name
            for f in dataclasses.fields(cls) if f.name not in RUN_SHARED[cls.__name__]}
