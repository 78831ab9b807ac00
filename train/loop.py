"""The training loop of one rank: `Trainer.train -> epoch -> round -> step`, with save, validate and log beside.

The parts build themselves: the run folder (run_folder.py), the drafter's shape (drafter/config.py), the learner
(learner.py: the optimizer step) and the rounds of shards (rounds.py, or follow.py while extract still writes).
Here: epochs and rounds, streaming, logging, validation and checkpoints. Logging and checkpoints are due by steps or
by time; the time is rank 0's, turned into a step number at each log line and broadcast, so every rank takes the
same decision.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..drafter.config import for_store
from .checkpoint import rng_state, set_rng_state
from .dist import Dist
from .follow import FollowedRounds
from .learner import Learner
from .metrics import RunLog, Window, plot_run, require_tensorboard, step_record, truncate_metrics
from .plan import LoaderState, Round
from .rounds import Rounds
from .run_folder import open_run

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import TrainConfig
    from .stream import StepData

__all__ = ["Trainer", "train_rank"]

log = logging.getLogger(__name__)


class Trainer:
    """One rank's run: the store, the run folder, the learner, the rounds; `train()` does the whole run."""

    read_ahead = True  # read the next round's first shards while a round ends (off: each round starts cold)

    def __init__(self, cfg: "TrainConfig") -> None:
        from ..storage import Store
        from ..storage.follow import wait_for_store

        if cfg.tensorboard:
            require_tensorboard()
        self.dist = dist = Dist.setup(cfg.gpus)
        self.store = wait_for_store(cfg.store) if cfg.follow else Store.open(cfg.store)
        self.store.use_cache(cfg.cache_dir, cfg.cache_gb)
        self.dcfg = for_store(cfg, self.store.header)
        self.folder = folder = open_run(cfg, self.store, self.dcfg, dist)  # also the config a resumed run keeps
        self.cfg = cfg = folder.cfg
        self.run, self.checkpoints = folder.path, folder.checkpoints
        try:
            self._setup(cfg, self.folder.record["resolved"])
        except BaseException:
            self.release()
            raise

    def _setup(self, cfg: "TrainConfig", resolved: dict[str, Any]) -> None:
        from .stream import RoundStreams, StreamSpec

        dist = self.dist
        self.val_ids = resolved["val_shards"]
        num_slots = dist.world * cfg.grad_accum
        self.learner = Learner(cfg, self.dcfg, dist)
        self.state = LoaderState(world_size=dist.world, num_slots=num_slots, seed=cfg.seed)
        kind = FollowedRounds if cfg.follow else Rounds
        self.rounds = kind(cfg, self.store, dist, self.state, resolved["train_shards"], num_slots, self.set_total,
                           (lambda msg: self.runlog.waiting(msg)) if dist.rank == 0 else None)
        self.streams = RoundStreams(self.store, StreamSpec.of_run(cfg, self.dcfg, dist))
        self.step, self.last_saved, self.stopped = 0, -1, False
        self.next_log = 1  # the first step is logged at once; then by steps and by rank 0's clock
        self.save_at = -1  # the step that rank 0's clock says is --save-every-minutes after the last save
        self.saved_time = time.perf_counter()
        self.corrupt: set[int] = set()
        self.stream: Any = None
        self.runlog: RunLog | None = None

    def note_checkpoint(self, step: int) -> None:
        """Record that step's checkpoint is published (metrics.jsonl: what `dflash run` waits for to grow)."""
        if self.runlog is not None:
            self.runlog.write({"event": "checkpoint", "step": step})

    def release(self) -> None:
        """Give up the run folder's lock (rank 0) and stop fetching shards ahead."""
        self.folder.release()
        if self.store.cache is not None:
            self.store.cache.close()

    def set_total(self, total: int) -> None:
        """Take the run's (new) length: the schedule and the progress display follow it."""
        self.learner.total = total
        if self.runlog is not None:
            self.runlog.set_total(total)

    # -- start ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume from the newest checkpoint, or plan a fresh run; then open the run log on rank 0."""
        if self.folder.resume_from is not None:
            self.resume(self.folder.resume_from)
        else:
            if self.cfg.resume and self.dist.rank == 0:
                truncate_metrics(self.run, 0)  # a killed attempt with no checkpoint: its steps are taken again
            self.learner.total = self.rounds.fresh_total()
            if self.cfg.resume and self.dist.rank == 0:
                truncate_metrics(self.run, 0)  # steps a run killed before its first checkpoint logged are redone
        self.dist.barrier()
        if self.dist.rank == 0:
            self.runlog = RunLog(self.run, total_steps=self.learner.total, start_step=self.step,
                                 tensorboard=self.cfg.tensorboard)

    def resume(self, folder: "Path") -> None:
        """Load every part of the checkpoint in `folder` and replan the schedule for the options given now."""
        learner = self.learner
        ts = self.checkpoints.load(folder, learner.model, self.parts())
        self.step = self.last_saved = int(ts["step"])
        learner.total = self.rounds.resumed_total(int(ts["total_steps"]))
        # A rank beyond the saved ones (resumed on more GPUs) takes rank 0's generators: nothing in a step draws
        # from them (anchors come from batch_seed, init from --seed), so losses do not depend on it.
        rank = self.dist.rank
        set_rng_state(ts["rng"][rank] if rank < len(ts["rng"]) else ts["rng"][0])
        if rank == 0:
            truncate_metrics(self.run, self.step)
        log.info("resumed %s at step %d (epoch %d, step %d of it)", folder, self.step, self.state.epoch,
                 self.state.step_in_epoch)

    def parts(self) -> dict[str, Any]:
        """Return the stateful parts a checkpoint holds besides the model."""
        return {"optimizer": self.learner.opt, "scheduler": self.learner.sched, "loader": self.state}

    # -- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Run every epoch (or up to --max-steps), save the last step, and draw the curves."""
        self.start()
        self.window = Window(time.perf_counter())
        self.started, self.start_step = time.perf_counter(), self.step
        self.next_log, self.saved_time = self.step + 1, self.started
        try:
            while self.state.epoch < self.cfg.epochs and not self.stopped:
                self.epoch()
            if self.step != self.last_saved:
                self.save()
            if self.val_ids and self.stopped:
                self.validate(self.state.epoch)
            self.checkpoints.wait()  # the last checkpoint is on disk before the run says it is done
        finally:
            self.streams.close()
            self.checkpoints.finish()
            if self.runlog is not None:
                self.runlog.close()
        if self.dist.rank == 0:
            png = plot_run(self.run)
            log.info("trained %d steps into %s%s", self.step, self.run, f"; curves in {png}" if png else "")
        self.dist.close()

    def epoch(self) -> None:
        """Train one epoch round by round; then record it, and validate."""
        epoch, offset, dropped = self.state.epoch, 0, [0, 0]
        for index, plan in self.rounds.of_epoch(epoch, resumed=self.folder.resume_from is not None):
            dropped = [dropped[0] + plan.dropped_samples, dropped[1] + plan.dropped_tokens]
            self.round(plan, epoch, offset, index)
            offset += plan.steps
            if self.stopped:
                return
        self.end_epoch(epoch, offset, dropped, self.rounds.end_epoch(self.step))
        self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
        self.validate(epoch)

    def round(self, plan: Round, epoch: int, offset: int, index: int) -> None:
        """Train the steps of one round this run has not taken yet, streaming its shards; the next round's first
        shards are read while this round's last steps train."""
        start = max(0, self.state.step_in_epoch - offset)
        if start >= plan.steps:
            return
        self.stream = self.streams.open(plan, epoch=epoch, step_offset=offset, start=start)
        told = not self.read_ahead
        try:
            while True:
                if self.cfg.max_steps and self.step >= self.cfg.max_steps:
                    self.stopped = True
                    return
                if not told:
                    told = self.tell_ahead(plan.steps - (self.state.step_in_epoch - offset), epoch, index)
                item, waited = self.stream.get()
                if item is None:
                    return
                self.take_step(item, waited, epoch)
        finally:
            self.corrupt.update(self.stream.corrupt)
            self.streams.end()
            self.stream = None

    def tell_ahead(self, left: int, epoch: int, index: int) -> bool:
        """Hand the stream the next round to read ahead, if it is known now; return False to be asked again at the
        next step (follow mode, until the store has a round ready). `left`: this round's steps not taken yet."""
        if self.cfg.max_steps and self.step + left >= self.cfg.max_steps:
            return True  # the run stops within this round
        if not self.rounds.ahead_now(left):
            return False
        nxt = self.rounds.upcoming(epoch, index)
        if nxt is None:
            return not self.rounds.waiting()
        self.streams.read_ahead(nxt)
        return True

    def take_step(self, item: "StepData", waited: float, epoch: int) -> None:
        """Run one optimizer step on a step's data, then log and save when they are due."""
        metrics, gnorm, lr = self.learner.step(item.micro)
        self.step += 1
        self.state.step_in_epoch = item.step_in_epoch + 1
        self.window.add(item, waited, metrics, self.learner.last_flops)
        save = self.step % self.cfg.save_every == 0 or self.step == self.save_at  # before a log line moves save_at
        if self.step >= self.next_log:
            self.log_window(epoch, gnorm, lr)
        if save:
            self.save()

    # -- beside the loop -----------------------------------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint this step (rank 0 snapshots, its checkpointer writes in the background; every rank's RNGs go
        in), prune old ones, and keep it off the rate."""
        t0 = time.perf_counter()
        rngs = self.dist.gather(rng_state())
        if self.dist.rank == 0:
            extra = {"step": self.step, "total_steps": self.learner.total, "rng": rngs, "config": self.cfg.to_dict()}
            # The loop pays for host copies only; the checkpointer's thread serialises, writes and publishes.
            snap = self.checkpoints.snapshot(self.step, self.learner.model, self.parts(), extra)
            # `dflash run` watches for the event to stop training at a checkpoint: it comes once published.
            self.checkpoints.save_in_background(snap, on_saved=self.note_checkpoint)
        self.last_saved, self.saved_time = self.step, time.perf_counter()
        self.dist.barrier()
        self.window.start += time.perf_counter() - t0  # a save is not training time: keep it out of tokens/s

    def validate(self, epoch: int) -> None:
        """Evaluate on the committed held-out shards (rank 0) and record it."""
        from .evaluate import evaluate_shards

        committed = set(self.store.committed_ids())
        ready = [s for s in self.val_ids if s in committed]
        if self.dist.rank == 0 and ready:
            learner = self.learner
            with learner.autocast():
                out = evaluate_shards(learner.model, learner.head, self.store, ready, batch_tokens=self.cfg.batch_tokens,
                                      anchors=self.cfg.anchors, seed=self.cfg.seed, attention=learner.attention,
                                      device=self.dist.device, skip_corrupt=self.cfg.skip_corrupt,
                                      tree_budgets=self.cfg.tree_budgets)
            self.runlog.validation({**out, "split": "val", "step": self.step, "epoch": epoch})
        self.dist.barrier()

    def log_window(self, epoch: int, gnorm: float, lr: float) -> None:
        """Reduce the window's metrics over ranks and record one step line (rank 0); start a new window."""
        totals = self.window.reduce(self.dist, self.dcfg.block_size)
        elapsed = time.perf_counter() - self.window.start
        if self.runlog is not None:
            rate = (time.perf_counter() - self.started) / max(1, self.step - self.start_step)
            self.runlog.step(step_record(
                *totals, cfg=self.cfg, dist=self.dist, step=self.step, epoch=epoch, lr=lr, gnorm=gnorm,
                elapsed=elapsed, block_size=self.dcfg.block_size, eta_s=rate * max(0, self.learner.total - self.step),
                prefetch_depth=self.stream.depth() if self.stream is not None else 0))
        self.schedule(elapsed / max(1, self.window.steps))
        self.window = Window(time.perf_counter())

    def schedule(self, step_s: float) -> None:
        """Set the steps of the next log line and the next timed checkpoint from rank 0's clock and step time."""
        cfg, step = self.cfg, self.step
        by_steps = (step // cfg.log_every + 1) * cfg.log_every
        nxt = min(by_steps, step + max(1, int(cfg.log_every_seconds / max(step_s, 1e-9))))
        save_at = -1
        if cfg.save_every_minutes > 0:
            left = cfg.save_every_minutes * 60 - (time.perf_counter() - self.saved_time)
            save_at = step + max(1, int(left / max(step_s, 1e-9)))
        self.next_log, self.save_at = self.dist.broadcast((nxt, save_at))

    def end_epoch(self, epoch: int, steps: int, dropped: list[int], rounds: list[list[int]]) -> None:
        """Record the end of an epoch: its steps, rounds, the samples the tail cut dropped, corrupt shards."""
        if self.runlog is None:
            return
        self.runlog.write({"event": "epoch_end", "step": self.step, "epoch": epoch, "steps": steps, "rounds": rounds,
                           "dropped_samples": dropped[0], "dropped_tokens": dropped[1],
                           "corrupt_shards": sorted(self.corrupt | set(self.rounds.lengths.corrupt))})
        log.info("epoch %d done at step %d: %d steps; the tail cut to keep ranks in step dropped %d samples "
                 "(%d tokens)", epoch, self.step, steps, dropped[0], dropped[1])


def train_rank(cfg: "TrainConfig") -> None:
    """Train on this process's rank (RANK/WORLD_SIZE from torchrun or our launcher; a world of one otherwise)."""
    from ..runtime.memory import is_out_of_memory, out_of_memory_error

    trainer = Trainer(cfg)
    try:
        trainer.train()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise out_of_memory_error(
            f"dflash train (rank {trainer.dist.rank})", trainer.dist.device,
            "a smaller --batch-tokens or --anchors (one slot's micro-batch) and a new --out, since a resumed run "
            "keeps its batches; or on GPUs with more memory (--resume continues from the newest checkpoint)",
            e) from None
    finally:
        trainer.release()
