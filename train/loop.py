"""The training loop of one rank: `Trainer.train -> epoch -> round -> step`, with save, validate and log beside.

The optimizer step is learner.py's; here: epochs and follow-mode rounds, streaming, logging, validation and
checkpoints. Logging and checkpoints are due by steps or by time; the time is rank 0's,
turned into a step number at each log line and broadcast, so every rank takes the same decision.
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..drafter.config import for_store
from ..errors import ConfigError, StoreError
from .checkpoint import Checkpointer, rng_state, set_rng_state, write_run_record
from .dist import Dist
from .follow import FollowRounds, estimate_total
from .learner import Learner
from .metrics import RunLog, Window, plot_run, require_tensorboard, truncate_metrics
from .plan import LoaderState, Round, plan_round, planned_total
from .prepare import (ShardLengths, check_out_folder, prepare_run_folder,
                      resolve_train_dtype, resume_grad_accum, run_record, warn_cpu_sizes)

if TYPE_CHECKING:
    from ..config import TrainConfig
    from .objective import Metrics
    from .stream import StepData

__all__ = ["Trainer", "train_rank"]

log = logging.getLogger(__name__)

# Follow mode decides the next round (the shards committed by then) once the current one has this many steps left,
# so its first shards are read while these steps train; earlier would leave later commits to the round after.
FOLLOW_AHEAD_STEPS = 4


class Trainer:
    """One rank's run: the store, the run folder, the learner, the loader state; `train()` does the whole run."""

    read_ahead = True  # read the next round's first shards while a round ends (off: each round starts cold)

    def __init__(self, cfg: "TrainConfig") -> None:
        from ..storage import Store
        from ..storage.follow import wait_for_store

        if cfg.tensorboard:
            require_tensorboard()
        self.dist = dist = Dist.setup(cfg.gpus)
        self.cfg = cfg = resolve_train_dtype(resume_grad_accum(cfg, dist.world), dist)
        if dist.rank == 0 and dist.device.type == "cpu":
            warn_cpu_sizes(cfg)
        self.store = wait_for_store(cfg.store) if cfg.follow else Store.open(cfg.store)
        self.dcfg = for_store(cfg, self.store.header)
        record = run_record(cfg, self.store, self.dcfg, dist.world)
        self.run = check_out_folder(cfg.out)
        self.checkpoints = Checkpointer(self.run, cfg.keep)
        self.lock = self.checkpoints.lock() if dist.rank == 0 else None  # one trainer per run folder
        try:
            self._setup(cfg, record)
        except BaseException:
            self.release()
            raise

    def _setup(self, cfg: "TrainConfig", record: dict[str, Any]) -> None:
        from .packing import max_blocks_for
        from .stream import RoundStreams, StreamSpec

        dist = self.dist
        self.resume_from = prepare_run_folder(cfg, record)
        if dist.rank == 0:
            write_run_record(self.run, record)
        self.train_ids, self.val_ids = record["resolved"]["train_shards"], record["resolved"]["val_shards"]
        self.num_slots = dist.world * cfg.grad_accum
        slots = list(range(dist.rank * cfg.grad_accum, (dist.rank + 1) * cfg.grad_accum))
        self.lengths = ShardLengths(self.store, cfg.skip_corrupt)
        self.learner = Learner(cfg, self.dcfg, dist)
        self.state = LoaderState(world_size=dist.world, num_slots=self.num_slots, seed=cfg.seed)
        self.plan_kw = dict(num_slots=self.num_slots, seed=cfg.seed, batch_tokens=cfg.batch_tokens,
                            buffer_tokens=4 * cfg.batch_tokens)
        self.spec = StreamSpec(slots=slots, seed=cfg.seed, block_size=self.dcfg.block_size,
                               mask_token_id=self.dcfg.mask_token_id, anchors=cfg.anchors,
                               max_blocks=max_blocks_for(cfg.batch_tokens), device=dist.device,
                               depth=cfg.prefetch_shards, skip_corrupt=cfg.skip_corrupt)
        self.step = 0
        self.last_saved = -1
        self.next_log = 1  # the first step is logged at once; then by steps and by rank 0's clock
        self.save_at = -1  # the step that rank 0's clock says is --save-every-minutes after the last save
        self.saved_time = time.perf_counter()
        self.stopped = False
        self.corrupt: set[int] = set()
        self.stream: Any = None
        self.streams = RoundStreams(self.store, self.spec)
        self.planned: dict[tuple[Any, ...], Round] = {}  # the plans of this round and the next one
        self.runlog: RunLog | None = None
        self.peak = self.device_peak(dist.device)

    def note_checkpoint(self, step: int) -> None:
        """Record that step's checkpoint is published (metrics.jsonl: what `dflash run` waits for to grow)."""
        if self.runlog is not None:
            self.runlog.write({"event": "checkpoint", "step": step})

    @staticmethod
    def device_peak(device: Any) -> float | None:
        """Return the dense bf16 FLOP/s of a CUDA device (None on a CPU or an unknown GPU: no MFU then)."""
        if device.type != "cuda":
            return None
        import torch

        from ..drafter.flops import peak_flops

        return peak_flops(torch.cuda.get_device_name(device))

    def finish_saving(self) -> None:
        """Let a background checkpoint write finish (an interrupt or an error is unwinding the run): it is
        published whole, or its temp folder is removed and the previous checkpoint stays the newest."""
        try:
            self.checkpoints.wait()
        except Exception as e:  # the run's own error is the one being reported
            log.error("the checkpoint being written when the run stopped was abandoned: %s", e)

    def release(self) -> None:
        """Give up the run folder's lock (rank 0)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- planning ----------------------------------------------------------------------------------------------
    @property
    def following(self) -> bool:
        """Return True while the run is in follow mode's first epoch (rounds of newly committed shards)."""
        return self.cfg.follow and self.state.epoch == 0 and not self.state.follow_done

    def plan(self, ids: list[int], epoch: int, round_index: int) -> Round:
        """Return the plan of one round of shards."""
        return plan_round(self.lengths.load(ids), ids, epoch=epoch, round_index=round_index, **self.plan_kw)

    def plan_of(self, ids: list[int], epoch: int, round_index: int) -> Round:
        """Return `plan`, made once for the round that is read ahead and then trained."""
        key = (tuple(ids), epoch, round_index)
        if key not in self.planned:
            self.planned = {k: v for k, v in self.planned.items() if k[1:] >= (epoch, round_index)}
            self.planned[key] = self.plan(ids, epoch, round_index)
        return self.planned[key]

    def upcoming(self, rounds: Any, following: bool, epoch: int, index: int) -> Round | None:
        """Return the plan of the round after round `index` of `epoch` if it is known now (None if not, or if there
        is none). Following, this looks at the store once, on every rank together (FollowRounds.ahead)."""
        if following:
            nxt = rounds.ahead()
            if nxt is None:
                return None
            if nxt != "done":
                return self.plan_of(nxt, epoch, index + 1)
            shards = sorted({s for r in self.state.rounds for s in r})  # what epoch() takes for the next epochs
        else:
            shards = self.state.shards
        return self.plan_of(shards, epoch + 1, 0) if epoch + 1 < self.cfg.epochs else None

    def epoch_steps(self, epoch: int) -> int:
        """Return the steps of a full epoch over the run's training shards."""
        return self.plan(self.state.shards, epoch, 0).steps

    def set_total(self, total: int) -> None:
        """Take the run's (new) length: the schedule and the progress display follow it."""
        self.learner.total = total
        if self.runlog is not None:
            self.runlog.set_total(total)

    # -- start ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume from the newest checkpoint, or plan a fresh run; then open the run log on rank 0."""
        if self.resume_from is not None:
            self.resume(self.resume_from)
        else:
            if self.cfg.resume and self.dist.rank == 0:
                truncate_metrics(self.run, 0)  # a killed attempt with no checkpoint: its steps are taken again
            self.start_fresh()
            if self.cfg.resume and self.dist.rank == 0:
                truncate_metrics(self.run, 0)  # steps a run killed before its first checkpoint logged are redone
        self.dist.barrier()
        if self.dist.rank == 0:
            self.runlog = RunLog(self.run, total_steps=self.learner.total, start_step=self.step,
                                 tensorboard=self.cfg.tensorboard)

    def resume(self, folder: Path) -> None:
        """Load every part of the checkpoint in `folder` and replan the schedule for the options given now."""
        cfg, learner = self.cfg, self.learner
        ts = self.checkpoints.load(folder, learner.model, self.parts())
        self.step, learner.total = int(ts["step"]), int(ts["total_steps"])
        self.last_saved = self.step
        if not self.state.rounds or self.state.follow_done:  # --epochs or --max-steps may have changed
            first = (sum(self.plan(r, 0, i).steps for i, r in enumerate(self.state.rounds)) if self.state.rounds
                     else self.epoch_steps(0))
            learner.total = planned_total(self.epoch_steps, 1, cfg.epochs, cfg.max_steps, done=first)
        # A rank beyond the saved ones (resumed on more GPUs) takes rank 0's generators: nothing in a step draws
        # from them (anchors come from batch_seed, init from --seed), so losses do not depend on it.
        rank = self.dist.rank
        set_rng_state(ts["rng"][rank] if rank < len(ts["rng"]) else ts["rng"][0])
        if rank == 0:
            truncate_metrics(self.run, self.step)
        log.info("resumed %s at step %d (epoch %d, step %d of it)", folder, self.step, self.state.epoch,
                 self.state.step_in_epoch)

    def start_fresh(self) -> None:
        """Take the committed training shards (or, following, none yet) and plan the schedule."""
        cfg = self.cfg
        if cfg.follow:
            self.learner.total = cfg.max_steps or 1  # re-estimated once the first shards arrive
            return
        committed = set(self.store.committed_ids())
        self.state.shards = [s for s in self.train_ids if s in committed]
        if not self.state.shards:
            raise ConfigError(f"--store {cfg.store}: none of its {len(self.train_ids)} training shards is committed "
                              "yet; run `dflash extract` first, or pass --follow to train while it writes")
        if len(self.state.shards) < len(self.train_ids):
            log.warning("%s: %d of %d training shards are committed; training on those (--follow waits for all)",
                        cfg.store, len(self.state.shards), len(self.train_ids))
        lengths = self.lengths.load(self.state.shards)
        if not any(len(v) for v in lengths.values()):
            # An "untrained checkpoint after 0 steps" would look like success; an empty store is a data problem.
            raise StoreError(
                f"--store {cfg.store}: its {len(self.state.shards)} committed training shards hold 0 samples (0 "
                f"tokens), nothing to train on; re-extract from data with usable rows (`dflash inspect {cfg.store}`)"
            )
        self.learner.total = planned_total(self.epoch_steps, 0, cfg.epochs, cfg.max_steps)
        if self.learner.total == 0:
            raise ConfigError(
                f"--store {cfg.store}: {sum(map(len, lengths.values()))} samples plan 0 training steps at "
                f"--batch-tokens {cfg.batch_tokens} on {self.num_slots} slots; extract more data or use fewer slots"
            )

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
            self.finish_saving()
            if self.runlog is not None:
                self.runlog.close()
        if self.dist.rank == 0:
            png = plot_run(self.run)
            log.info("trained %d steps into %s%s", self.step, self.run, f"; curves in {png}" if png else "")
        self.dist.close()

    def rounds(self) -> Any:
        """Return the shard sets of the current epoch: one of every training shard, or follow mode's rounds."""
        if not self.following:
            return [list(self.state.shards)]
        say = self.runlog.waiting if self.runlog is not None else None
        return FollowRounds(self.store, self.dist, self.state, self.train_ids, self.num_slots, say)

    def epoch(self) -> None:
        """Train one epoch round by round; then record it, and validate."""
        epoch, offset, dropped = self.state.epoch, 0, [0, 0]
        following = self.following
        rounds = self.rounds()
        for index, ids in enumerate(rounds):
            plan = self.plan_of(ids, epoch, index)
            dropped = [dropped[0] + plan.dropped_samples, dropped[1] + plan.dropped_tokens]
            if following and not self.cfg.max_steps and self.resume_from is None and index == 0:
                self.set_total(estimate_total(plan.steps, len(ids), len(self.train_ids), self.cfg.epochs,
                                              self.cfg.max_steps))
            self.round(plan, epoch, offset, functools.partial(self.upcoming, rounds, following, epoch, index))
            offset += plan.steps
            if self.stopped:
                return
        if following:
            self.state.follow_done = True
            self.state.shards = sorted({s for r in self.state.rounds for s in r})
            if not self.cfg.max_steps:
                self.set_total(planned_total(self.epoch_steps, 1, self.cfg.epochs, 0, done=self.step))
        self.end_epoch(epoch, offset, dropped, following)
        self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
        self.validate(epoch)

    def round(self, plan: Round, epoch: int, offset: int, upcoming: Callable[[], Round | None] | None = None) -> None:
        """Train the steps of one round this run has not taken yet, streaming its shards; `upcoming` gives the
        next round's plan, whose first shards are then read while this round's last steps train."""
        start = max(0, self.state.step_in_epoch - offset)
        if start >= plan.steps:
            return
        self.stream = self.streams.open(plan, epoch=epoch, step_offset=offset, start=start)
        told = upcoming is None or not self.read_ahead
        try:
            while True:
                if self.cfg.max_steps and self.step >= self.cfg.max_steps:
                    self.stopped = True
                    return
                if not told:
                    told = self.tell_ahead(plan.steps - (self.state.step_in_epoch - offset), upcoming)
                item, waited = self.stream.get()
                if item is None:
                    return
                self.take_step(item, waited, epoch)
        finally:
            self.corrupt.update(self.stream.corrupt)
            self.streams.end()
            self.stream = None

    def tell_ahead(self, left: int, upcoming: Callable[[], Round | None]) -> bool:
        """Hand the stream the next round to read ahead, if it is known now; return False to be asked again at the
        next step (follow mode, until the store has a round ready). `left`: this round's steps not taken yet."""
        if self.cfg.max_steps and self.step + left >= self.cfg.max_steps:
            return True  # the run stops within this round
        if self.following and left > FOLLOW_AHEAD_STEPS:
            return False
        nxt = upcoming()
        if nxt is None:
            return not self.following
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
            self.runlog.validation({"split": "val", "step": self.step, "epoch": epoch, **{k: out[k] for k in (
                "loss", "loss_weights", "acc", "tau_hat", "slot_accuracy", "accept_rate", "blocks", "tokens", "shards",
                "tree_budgets", "tree_tau", "selector_tree_tau") if k in out}})
        self.dist.barrier()

    def log_window(self, epoch: int, gnorm: float, lr: float) -> None:
        """Reduce the window's metrics over ranks and record one step line (rank 0); start a new window."""
        import torch

        from .objective import Metrics

        win, dist = self.window, self.dist
        B1 = self.dcfg.block_size - 1
        vec = win.metrics.to_tensor() if win.metrics is not None else Metrics(0.0, 0.0, [0] * B1, [0] * B1, 0, 0).to_tensor()
        extra = torch.tensor([win.tokens, win.wait, win.flops], dtype=torch.float64)
        both = dist.all_reduce(torch.cat([vec, extra]).to(dist.device)).cpu()
        m = Metrics.from_tensor(both[:-3])
        tokens, wait, flops = (float(x) for x in both[-3:])
        elapsed = time.perf_counter() - win.start
        peak = self.peak * dist.world if self.peak else None
        if self.runlog is not None:
            rate = (time.perf_counter() - self.started) / max(1, self.step - self.start_step)
            counted = sum(m.slot_count)
            # D-PACE's mean weight per slot shows where its credit goes; decay's would be its constants.
            dpace = {"slot_weight": m.slot_mean_weight} if self.cfg.position_weights == "dpace" else {}
            self.runlog.step({
                "split": "train", "step": self.step, "epoch": epoch, "loss": m.loss,
                "loss_weights": self.cfg.position_weights, **dpace,
                "acc": sum(m.slot_correct) / counted if counted else float("nan"), "tau_hat": m.tau_hat,
                "streak": m.tau_hat - 1.0, "slot_accuracy": m.slot_accuracy, "lr": lr,
                "grad_norm": gnorm, "tokens_per_s": tokens / max(elapsed, 1e-9),
                # Query tokens (blocks x block size) and MFU compare runs whose samples differ in length.
                "query_tokens_per_s": m.blocks * self.dcfg.block_size / max(elapsed, 1e-9),
                "tflops_per_s": flops / max(elapsed, 1e-9) / 1e12,
                "mfu": flops / max(elapsed, 1e-9) / peak if peak else None,
                "data_wait": wait / dist.world / max(elapsed, 1e-9),
                "prefetch_depth": self.stream.depth() if self.stream is not None else 0,
                "eta_s": rate * max(0, self.learner.total - self.step), "blocks": m.blocks,
                **m.selector_dict(),  # DFlash 2's loss terms and selector metrics; none for DFlash 1
                **m.objective_dict(),  # --tree-loss and --accept-loss terms; none when off
                # This rank's peak device memory so far (what a larger drafter or batch has to fit in).
                "peak_mem_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30
                if torch.device(dist.device).type == "cuda" else None,
            })
        self.schedule(elapsed / max(1, win.steps))
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

    def end_epoch(self, epoch: int, steps: int, dropped: list[int], following: bool) -> None:
        """Record the end of an epoch: its steps, rounds, the samples the tail cut dropped, corrupt shards."""
        if self.runlog is None:
            return
        self.runlog.write({"event": "epoch_end", "step": self.step, "epoch": epoch, "steps": steps,
                           "rounds": [list(r) for r in self.state.rounds] if following else [self.state.shards],
                           "dropped_samples": dropped[0], "dropped_tokens": dropped[1],
                           "corrupt_shards": sorted(self.corrupt | set(self.lengths.corrupt))})
        log.info("epoch %d done at step %d: %d steps; the tail cut to keep ranks in step dropped %d samples "
                 "(%d tokens)", epoch, self.step, steps, dropped[0], dropped[1])


def train_rank(cfg: "TrainConfig") -> None:
    """Train on this process's rank (RANK/WORLD_SIZE from torchrun or our launcher; a world of one otherwise)."""
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.release()
