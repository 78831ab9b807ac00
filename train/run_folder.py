"""A run folder before its first step: --out checked, the run record (RUN/config.json: the options and what they
resolved to) built, compared with a resumed run's and written, the lock that keeps one trainer per folder, and the
checkpoint to resume from. The step folders inside are checkpoint.py's."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.atomic import write_atomic
from ..drafter.folders import RUN_RECORD, read_run_record
from ..errors import ConfigError, ManifestMismatch
from ..runtime.nested import nested_diff
from .checkpoint import Checkpointer
from .metrics import METRICS_FILE
from .plan import split_shards

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..drafter.config import DrafterConfig
    from ..storage import Store

__all__ = ["RUN_LOCK", "RunFolder", "open_run", "check_out_folder", "preflight", "run_record",
           "resume_grad_accum", "resolve_train_dtype", "lock_run", "prepare_run_folder", "write_run_record",
           "check_resume"]

log = logging.getLogger(__name__)

RUN_LOCK = "train.lock"
# TrainConfig fields that may change between a run and its resume; every other change is refused by name.
# (val_fraction and val_shards may: the split they resolve to, resolved.train_shards/val_shards, is compared instead.)
RESUMABLE_CHANGES = frozenset(
    {"resume", "epochs", "max_steps", "save_every", "save_every_minutes", "keep", "log_every", "log_every_seconds",
     "tensorboard", "skip_corrupt", "prefetch_shards", "gpus", "follow", "out", "store", "target", "val_fraction",
     "val_shards",
     "grad_accum", "compile_layers", "cache_dir", "cache_gb"}
)
# Resolved facts that may change with them: another GPU count keeps the batches while the slots stay the same
# (grad_accum = slots / world, see resume_grad_accum); resolved.num_slots itself is still checked.
RESUMABLE_RESOLVED = ("resolved.store.path", "resolved.val_shards_note", "resolved.world_size")

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


def resume_grad_accum(cfg: "TrainConfig", world: int, saved: dict[str, Any] | None) -> "TrainConfig":
    """Return cfg with the grad-accum that keeps a resumed run's slots (its record `saved`) on `world` ranks (cfg
    itself otherwise).

    Batches are a function of the slots (world x grad-accum) alone, so a run resumed on another GPU count takes the
    same global batches when grad-accum = recorded slots / world; ConfigError naming the counts that divide them,
    or when --grad-accum was given (not the default 1) and makes other slots.
    """
    slots = ((saved if cfg.resume else None) or {}).get("resolved", {}).get("num_slots")
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


def resolve_train_dtype(cfg: "TrainConfig", dist: Any, saved: dict[str, Any] | None = None) -> "TrainConfig":
    """Return cfg with --dtype made concrete: rank 0 decides (targets/numerics.py, logging why), every rank takes it.

    A resumed run keeps the dtype it trained in when --dtype is auto, even where auto would now pick another (a run
    started on a GPU, resumed on a CPU without native bf16): changing numerics mid-run would break "resumed ==
    uninterrupted" silently, while keeping them costs speed, which the warning then measures. An explicit --dtype
    that differs from the run's is refused by check_resume, as any other changed option.
    """
    from ..config import DTYPES
    from ..targets.numerics import resolve_dtype

    dtype = None
    if dist.rank == 0:
        recorded = (((saved if cfg.resume else None) or {}).get("config") or {}).get("dtype")
        dtype = resolve_dtype(cfg.dtype, dist.device.type, auto=recorded if recorded in DTYPES else None,
                              auto_reason=f"the run being resumed ({Path(cfg.out) / 'config.json'}) trained in it")
    return dataclasses.replace(cfg, dtype=dist.broadcast(dtype))


def lock_run(run: Path) -> Any:
    """Return the held RUN/train.lock (a stale one of a dead process is taken over); ConfigError naming the
    live holder when another trainer has this run folder."""
    from ..runtime.locks import FileLock

    run.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run / RUN_LOCK)
    holder = lock.acquire()
    if holder is not None:
        raise ConfigError(
            f"--out {run}: another `dflash train` (pid {holder.get('pid')} on host {holder.get('host')}) is "
            f"training this run ({run / RUN_LOCK}); wait for it or stop it, or train into another --out"
        )
    return lock


def prepare_run_folder(cfg: "TrainConfig", run: Path, saved: dict[str, Any] | None, ckpt: Path | None,
                       record: dict[str, Any]) -> Path | None:
    """Return the checkpoint to resume from, `ckpt` (None: a fresh run); refuse to overwrite a run (one with a
    checkpoint or metrics) or to resume one whose record `saved` differs from `record`."""
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


def write_run_record(run: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write RUN/config.json atomically: {"config": TrainConfig fields, "resolved": facts of the run}."""
    write_atomic(Path(run) / RUN_RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")


def check_resume(run: str | os.PathLike, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Raise ManifestMismatch naming every field of the store, model shape, world or options that changed.

    An option the saved record lacks was added after the run was made, which then trained as the option did before
    it existed (config.LEGACY_DEFAULTS where today's default differs, else the default): only another value is a
    change.
    """
    from ..config import LEGACY_DEFAULTS, TrainConfig

    config = saved.get("config")
    if isinstance(config, dict):
        added = {f.name: LEGACY_DEFAULTS.get(f.name, f.default) for f in dataclasses.fields(TrainConfig)
                 if f.name not in config and f.default is not dataclasses.MISSING}
        saved = {**saved, "config": {**json.loads(json.dumps(added)), **config}}

    def resumable(key: str) -> bool:
        return ((key.startswith("config.") and key.split(".", 1)[1] in RESUMABLE_CHANGES)
                or key.startswith(RESUMABLE_RESOLVED))

    diffs = [f"{key}: run has {json.dumps(x)}, now {json.dumps(y)}"
             for key, x, y in nested_diff(saved, now, ignore=resumable)]
    if diffs:
        shown = "; ".join(diffs[:8]) + ("; ..." if len(diffs) > 8 else "")
        raise ManifestMismatch(
            f"{Path(run) / RUN_RECORD}: --resume refused, the run was made with other settings ({shown}); "
            "resume with the run's settings, or train into a new --out"
        )


@dataclass
class RunFolder:
    """An opened run folder: the config as the run keeps it, path, record, checkpoints, the lock (rank 0), and the
    checkpoint to resume from."""

    cfg: "TrainConfig"
    path: Path
    record: dict[str, Any]
    checkpoints: Checkpointer
    lock: Any
    resume_from: Path | None

    def release(self) -> None:
        """Give up the run folder's lock (rank 0)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def open_run(cfg: "TrainConfig", store: "Store", dcfg: "DrafterConfig", dist: Any) -> RunFolder:
    """Return the run folder of --out made ready for the first step: the config as a resumed run keeps it (its
    slots, its dtype), locked (one trainer per folder), refused if it holds another run or a changed one, its record
    written; the lock is given up again if that fails."""
    run = check_out_folder(cfg.out)
    saved = read_run_record(run)
    cfg = resolve_train_dtype(resume_grad_accum(cfg, dist.world, saved), dist, saved)
    record = run_record(cfg, store, dcfg, dist.world)
    checkpoints = Checkpointer(run, cfg.keep)
    folder = RunFolder(cfg, run, record, checkpoints, lock_run(run) if dist.rank == 0 else None, None)
    try:
        folder.resume_from = prepare_run_folder(cfg, run, saved, checkpoints.latest(), record)
        if dist.rank == 0:
            write_run_record(run, record)
    except BaseException:
        folder.release()
        raise
    return folder
