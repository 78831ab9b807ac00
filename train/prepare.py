"""What a run is made of before its first step: the store checked against the target, the drafter shape, the split,
the run folder (new, or resumed with nothing changed), shard lengths, and the learning-rate schedule."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, CorruptShard
from .checkpoint import Checkpointer, check_resume, read_run_record
from .plan import split_shards
from .metrics import METRICS_FILE

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..storage import Store
    from ..drafter.config import DrafterConfig

__all__ = ["preflight", "check_out_folder", "warn_cpu_sizes", "run_record",
           "resume_grad_accum", "resolve_train_dtype", "prepare_run_folder", "ShardLengths", "lr_factor"]

log = logging.getLogger(__name__)

# Header fields that make two stores the same data for training purposes (a resumed run must see these unchanged).
_STORE_IDENTITY = ("layer_ids", "hidden_size", "mask_token_id", "codec", "tokenizer_hash", "chat_template_hash",
                   "max_length", "dataset", "shard_plan", "target")


def check_out_folder(out: str | os.PathLike) -> Path:
    """Return --out as a Path; ConfigError if it is a file."""
    run = Path(out)
    if run.exists() and not run.is_dir():
        raise ConfigError(f"--out {run}: exists and is not a folder; pass a new folder path")
    return run


def preflight(cfg: "TrainConfig") -> None:
    """Check what needs no model before torch is imported (seconds): --out is not a file, --store is a store."""
    from ..storage import Store

    check_out_folder(cfg.out)
    if not cfg.follow:  # a followed store may not exist yet
        Store.open(cfg.store)


# What `dflash train` defaults to for GPUs; on a CPU they make a step take minutes.
_GPU_SIZES = {"batch_tokens": 4096, "anchors": 128, "draft_layers": 2}


def warn_cpu_sizes(cfg: "TrainConfig") -> None:
    """Warn (one line) when a CPU run has options sized for GPUs."""
    big = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k, limit in _GPU_SIZES.items() if getattr(cfg, k) > limit]
    if big:
        log.warning("training on a CPU with options sized for GPUs (%s): a step may take minutes; for a CPU try "
                    "--batch-tokens 2048 --anchors 64 --draft-layers 1", ", ".join(big))


def run_record(cfg: "TrainConfig", store: "Store", dcfg: "DrafterConfig", world: int) -> dict[str, Any]:
    """Return RUN/config.json's content: the TrainConfig and what it resolved to (store identity, drafter, split)."""
    train_ids, val_ids = split_shards(store.num_shards, cfg.val_fraction, cfg.val_shards)
    header = {k: store.header.get(k) for k in _STORE_IDENTITY}
    return {
        "config": cfg.to_dict(),
        "resolved": {
            "store": {"path": os.path.abspath(cfg.store) if "://" not in cfg.store else cfg.store, "header": header},
            "drafter": dcfg.to_dict(),
            "world_size": world,
            "num_slots": world * cfg.grad_accum,
            "train_shards": train_ids,
            "val_shards": val_ids,
        },
    }


def resume_grad_accum(cfg: "TrainConfig", world: int) -> "TrainConfig":
    """Return cfg with the grad-accum that keeps a resumed run's slots on `world` ranks (cfg itself otherwise).

    Batches are a function of the slots (world x grad-accum) alone, so a run resumed on another GPU count takes the
    same global batches when grad-accum = recorded slots / world; ConfigError naming the counts that divide them,
    or when --grad-accum was given (not the default 1) and makes other slots.
    """
    import dataclasses

    saved = read_run_record(cfg.out) if cfg.resume else None
    slots = (saved or {}).get("resolved", {}).get("num_slots")
    if not slots or world * cfg.grad_accum == slots:
        return cfg
    if cfg.grad_accum != 1:  # asked for: another value would change every batch from here on
        raise ConfigError(
            f"--resume {cfg.out}: --grad-accum {cfg.grad_accum} on {world} GPU(s) makes {world * cfg.grad_accum} "
            f"slots, the run has {slots}; leave --grad-accum out (resume picks the value that keeps the run's slots) "
            "or train into a new --out")
    if slots % world:
        fits = [n for n in range(1, slots + 1) if slots % n == 0]
        raise ConfigError(
            f"--resume {cfg.out}: the run has {slots} slots (GPUs x --grad-accum), which {world} GPU(s) cannot "
            f"share; resume on {', '.join(map(str, fits))} GPU(s), or train into a new --out"
        )
    log.warning("--resume on %d GPU(s): --grad-accum %d keeps the run's %d slots", world, slots // world, slots)
    return dataclasses.replace(cfg, grad_accum=slots // world)


def resolve_train_dtype(cfg: "TrainConfig", dist: Any) -> "TrainConfig":
    """Return cfg with --dtype made concrete: rank 0 decides (target/numerics.py, logging why), every rank takes it.

    A resumed run keeps the dtype it trained in when --dtype is auto, even where auto would now pick another (a run
    started on a GPU, resumed on a CPU without native bf16): changing numerics mid-run would break "resumed ==
    uninterrupted" silently, while keeping them costs speed, which the warning then measures. An explicit --dtype
    that differs from the run's is refused by check_resume, as any other changed option.
    """
    import dataclasses

    from ..config import DTYPES
    from ..target.numerics import resolve_dtype

    dtype = None
    if dist.rank == 0:
        saved = read_run_record(cfg.out) if cfg.resume else None
        recorded = ((saved or {}).get("config") or {}).get("dtype")
        dtype = resolve_dtype(cfg.dtype, dist.device.type, auto=recorded if recorded in DTYPES else None,
                              auto_reason=f"the run being resumed ({Path(cfg.out) / 'config.json'}) trained in it")
    return dataclasses.replace(cfg, dtype=dist.broadcast(dtype))


def prepare_run_folder(cfg: "TrainConfig", record: dict[str, Any]) -> Path | None:
    """Return the checkpoint to resume from (None: a fresh run); refuse to overwrite a run or resume a changed one."""
    run = check_out_folder(cfg.out)
    ckpt = Checkpointer(run).latest()
    saved = read_run_record(run)
    if not cfg.resume:
        if ckpt is not None or (run / METRICS_FILE).exists():
            raise ConfigError(
                f"--out {run}: already holds a run ({ckpt.name if ckpt else METRICS_FILE}); pass --resume to "
                "continue it, or choose a new --out"
            )
        return None
    if saved is not None:
        check_resume(run, saved, record)
    if ckpt is None:  # a fresh folder (the demo always passes --resume) is no news
        say = log.warning if saved is not None or (run / METRICS_FILE).exists() else log.info
        say("--resume: %s has no complete checkpoint yet; starting from step 0", run)
    return ckpt


class ShardLengths:
    """Sample lengths of each shard, read once from its small `offsets` array (corrupt shards: none, counted)."""

    def __init__(self, store: "Store", skip_corrupt: bool) -> None:
        self.store, self.skip_corrupt = store, skip_corrupt
        self.cache: dict[int, np.ndarray] = {}
        self.corrupt: dict[int, str] = {}

    def __getitem__(self, sid: int) -> np.ndarray:
        if sid not in self.cache:
            try:
                self.cache[sid] = self.store.sample_lengths(sid)
            except CorruptShard as e:
                if not self.skip_corrupt:
                    raise CorruptShard(f"{e}; or rerun `dflash train` with --skip-corrupt to train without it") from None
                log.warning("skipping corrupt shard (--skip-corrupt): %s", e)
                self.corrupt[sid] = str(e)
                self.cache[sid] = np.zeros(0, np.int64)
        return self.cache[sid]

    def load(self, ids: list[int]) -> dict[int, np.ndarray]:
        """Return {id: lengths} for the shards."""
        return {s: self[s] for s in ids}


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Return the learning-rate multiplier of a step: linear warmup over warmup_ratio of the run, then cosine to 0."""
    warm = max(1, math.ceil(warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
