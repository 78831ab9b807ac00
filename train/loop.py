"""The training loop of one rank: DDP over slots, AdamW on fp32 master weights with bf16 compute, cosine schedule,
gradient accumulation, follow mode, logging, validation and checkpoints."""
from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import ConfigError
from .checkpoint import load_trainer_state, prune, rng_state, save_checkpoint, set_rng_state, write_run_record
from .dist import Dist
from .loader import LoaderState, plan_round
from .metrics import RunLog, plot_run, require_tensorboard, truncate_metrics
from .setup import ShardLengths, drafter_config, lr_factor, prepare_run_folder, run_record

__all__ = ["train_rank"]

log = logging.getLogger(__name__)


class Trainer:
    """Model, frozen target head, optimizer and schedule of one rank; `step` runs one optimizer step."""

    def __init__(self, cfg: Any, dcfg: Any, dist: Dist) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .model import DFlashDrafter
        from .objective import batch_capacity
        from .target_head import load_target_head

        self.cfg, self.dist, dev = cfg, dist, dist.device
        torch.manual_seed(cfg.seed)
        self.model = DFlashDrafter(dcfg).to(dev)  # fp32 master weights; compute is autocast to bf16
        self.ddp = DDP(self.model, device_ids=[dev] if dev.type == "cuda" else None) if dist.world > 1 else self.model
        self.bf16 = cfg.dtype == "bfloat16"
        self.head = load_target_head(cfg.target, dtype=torch.bfloat16 if self.bf16 else torch.float32, device=dev)
        self.attention = cfg.attention if cfg.attention != "auto" else ("flex" if dev.type == "cuda" else "sdpa")
        self.capacity = batch_capacity(cfg.batch_tokens)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     fused=dev.type == "cuda")
        self.total = 1
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, self.total, cfg.warmup_ratio))

    def autocast(self) -> Any:
        """Return the bf16 autocast context (or none for --dtype float32)."""
        import torch

        return torch.autocast(self.dist.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def step(self, micro: list[Any]) -> tuple[Any, float, float]:
        """Run one optimizer step over this rank's micro-batches; return (summed Metrics or None, grad norm, lr).

        The loss of each micro-batch is normalised by the decay-weight total of the whole global batch (all ranks,
        all micro-batches), so the gradient equals that of one big batch whatever the world size and accumulation.
        """
        import torch

        from .objective import drafter_loss

        dev = self.dist.device
        local = [float(b.weights[:, 1:].sum()) if b is not None else 0.0 for b in micro]
        total_w = float(self.dist.all_reduce(torch.tensor([sum(local)], dtype=torch.float64, device=dev))[0])
        metrics = None
        for i, (b, w) in enumerate(zip(micro, local)):
            sync = i == len(micro) - 1 or self.dist.world == 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self.autocast():
                if b is None or w == 0.0:
                    # Nothing to learn here, but DDP needs every rank to reduce every parameter's gradient.
                    loss = sum(p.sum() for p in self.ddp.parameters()) * 0.0
                    if b is not None:
                        _, m = drafter_loss(self.ddp, b, self.head.embed, self.head.lm_head,
                                            attention=self.attention, capacity=self.capacity)
                        metrics = m if metrics is None else metrics + m
                else:
                    loss, m = drafter_loss(self.ddp, b, self.head.embed, self.head.lm_head,
                                           attention=self.attention, capacity=self.capacity)
                    loss = loss * (w / max(total_w, 1e-12) * self.dist.world)
                    metrics = m if metrics is None else metrics + m
            loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip))
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return metrics, gnorm, lr


def _rounds(cfg: Any, state: LoaderState, store: Any, dist: Dist, train_ids: list[int], runlog: RunLog | None,
            num_slots: int) -> Iterator[list[int]]:
    """Yield the shard sets of the current epoch: all training shards, or (follow, first epoch) each newly
    committed set the ranks agree on through rank 0, replaying the sets a resumed run already had."""
    if not (cfg.follow and state.epoch == 0 and not state.follow_done):
        yield list(state.shards)
        return
    train = set(train_ids)
    used: set[int] = set()
    for r in list(state.rounds):
        used |= set(r)
        yield r
    wait, shown = 0.2, 0.0
    while True:
        msg: Any = "wait"
        if dist.rank == 0:
            complete = store.is_complete()
            new = [i for i in store.committed_ids() if i in train and i not in used]
            # Enough new shards to give every slot one, or the last ones: otherwise a slot would have nothing.
            msg = new if len(new) >= num_slots or (complete and new) else ("done" if complete else "wait")
        msg = dist.broadcast(msg)
        if msg == "done":
            return
        if msg == "wait":
            if runlog is not None and time.monotonic() - shown > 30:
                runlog.waiting(f"waiting for `dflash extract`: {len(used)} of {len(train)} training shards trained on, "
                               f"{len(store.committed_ids())} of {store.num_shards} committed")
                shown = time.monotonic()
            time.sleep(wait)
            wait = min(2.0, wait * 1.5)
            continue
        wait, shown = 0.2, 0.0
        state.rounds.append(list(msg))
        used |= set(msg)
        yield list(msg)


def _open_store(cfg: Any) -> Any:
    """Return the store; in follow mode, first wait for `dflash extract` to create it."""
    from ..storage import Store
    from ..storage.fs import open_fs

    if cfg.follow:
        fs, shown = open_fs(cfg.store), 0.0
        while not fs.exists("zarr.json"):
            if time.monotonic() - shown > 30:
                log.info("waiting for `dflash extract` to create the store %s", cfg.store)
                shown = time.monotonic()
            time.sleep(1.0)
    return Store.open(cfg.store)


def _estimate_total(cfg: Any, plans_steps: int, shards_seen: int, train_count: int) -> int:
    per_epoch = math.ceil(plans_steps * train_count / max(1, shards_seen))
    total = per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps else max(1, total)


def planned_total(epoch_steps: Callable[[int], int], first_epoch: int, epochs: int, max_steps: int,
                  done: int = 0) -> int:
    """Return the run's total steps: `done` plus the planned steps of epochs first_epoch.., capped by max_steps.

    Epochs are planned only until the cap is reached: a run of --epochs 100000 --max-steps 700 plans ~90 epochs,
    not 100,000 (which took minutes before its first step).
    """
    total = done
    for e in range(first_epoch, epochs):
        if max_steps and total >= max_steps:
            break
        total += epoch_steps(e)
    return min(total, max_steps) if max_steps else total


def train_rank(cfg: Any) -> None:
    """Train on this process's rank (RANK/WORLD_SIZE from torchrun or our launcher; a world of one otherwise)."""
    import torch
    from safetensors.torch import load_file

    from .evaluate import evaluate_shards
    from .objective import max_blocks_for
    from .stream import RoundStream

    if cfg.tensorboard:
        require_tensorboard()
    dist = Dist.setup(cfg.gpus)
    store = _open_store(cfg)
    dcfg = drafter_config(cfg, store)
    record = run_record(cfg, store, dcfg, dist.world)
    ckpt = prepare_run_folder(cfg, record)
    run = Path(cfg.out)
    if dist.rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        write_run_record(run, record)
    train_ids, val_ids = record["resolved"]["train_shards"], record["resolved"]["val_shards"]
    num_slots = dist.world * cfg.grad_accum
    my_slots = list(range(dist.rank * cfg.grad_accum, (dist.rank + 1) * cfg.grad_accum))
    lengths = ShardLengths(store, cfg.skip_corrupt)
    trainer = Trainer(cfg, dcfg, dist)
    state = LoaderState(world_size=dist.world, num_slots=num_slots, seed=cfg.seed)
    plan_kw = dict(num_slots=num_slots, seed=cfg.seed, batch_tokens=cfg.batch_tokens, buffer_tokens=4 * cfg.batch_tokens)

    def epoch_steps(epoch: int) -> int:
        return plan_round(lengths.load(state.shards), state.shards, epoch=epoch, round_index=0, **plan_kw).steps

    step = 0
    if ckpt is not None:
        ts = load_trainer_state(ckpt)
        trainer.model.load_state_dict(load_file(str(ckpt / "model.safetensors")))
        trainer.opt.load_state_dict(ts["optimizer"])
        trainer.sched.load_state_dict(ts["scheduler"])
        state.load_state_dict(ts["loader"], str(ckpt))
        step, trainer.total = int(ts["step"]), int(ts["total_steps"])
        if not state.rounds or state.follow_done:  # --epochs or --max-steps may have changed: the schedule follows
            first = (sum(plan_round(lengths.load(r), r, epoch=0, round_index=i, **plan_kw).steps
                         for i, r in enumerate(state.rounds)) if state.rounds else epoch_steps(0))
            trainer.total = planned_total(epoch_steps, 1, cfg.epochs, cfg.max_steps, done=first)
        set_rng_state(ts["rng"][dist.rank] if dist.rank < len(ts["rng"]) else ts["rng"][0])
        if dist.rank == 0:
            truncate_metrics(run, step)
        log.info("resumed %s at step %d (epoch %d, step %d of it)", ckpt, step, state.epoch, state.step_in_epoch)
    else:
        committed = set(store.committed_ids())
        if not cfg.follow:
            state.shards = [s for s in train_ids if s in committed]
            if not state.shards:
                raise ConfigError(f"--store {cfg.store}: none of its {len(train_ids)} training shards is committed "
                                  "yet; run `dflash extract` first, or pass --follow to train while it writes")
            if len(state.shards) < len(train_ids):
                log.warning("%s: %d of %d training shards are committed; training on those (--follow waits for all)",
                            cfg.store, len(state.shards), len(train_ids))
            trainer.total = planned_total(epoch_steps, 0, cfg.epochs, cfg.max_steps)
        else:
            trainer.total = cfg.max_steps or 1  # re-estimated once the first shards arrive
    dist.barrier()
    runlog = RunLog(run, total_steps=trainer.total, start_step=step, tensorboard=cfg.tensorboard) if dist.rank == 0 else None
    started, start_step = time.perf_counter(), step
    win = {"t": time.perf_counter(), "wait": 0.0, "tokens": 0, "metrics": None}
    last_saved = step if ckpt is not None else -1
    stream = None

    def save() -> None:
        nonlocal last_saved
        t0 = time.perf_counter()
        rngs = dist.gather(rng_state())
        if dist.rank == 0:
            ts = {"step": step, "total_steps": trainer.total, "optimizer": trainer.opt.state_dict(),
                  "scheduler": trainer.sched.state_dict(), "loader": state.state_dict(), "rng": rngs,
                  "config": cfg.to_dict()}
            folder = save_checkpoint(run, step, trainer.model, ts)
            prune(run, cfg.keep)
            log.info("saved %s", folder)
        last_saved = step
        dist.barrier()
        win["t"] += time.perf_counter() - t0  # a save is not training time: keep it out of tokens/s

    def validate(epoch: int) -> None:
        committed = set(store.committed_ids())
        ready = [s for s in val_ids if s in committed]
        if dist.rank == 0 and ready:
            with trainer.autocast():
                out = evaluate_shards(trainer.model, trainer.head, store, ready, batch_tokens=cfg.batch_tokens,
                                      anchors=cfg.anchors, seed=cfg.seed, attention=trainer.attention,
                                      device=dist.device, skip_corrupt=cfg.skip_corrupt)
            runlog.validation({"split": "val", "step": step, "epoch": epoch, **{k: out[k] for k in (
                "loss", "acc", "tau_hat", "slot_accuracy", "accept_rate", "blocks", "tokens", "shards")}})
        dist.barrier()

    def log_step(epoch: int, gnorm: float, lr: float) -> None:
        from .objective import Metrics

        m = win["metrics"]
        B1 = dcfg.block_size - 1
        vec = m.to_tensor() if m is not None else Metrics(0.0, 0.0, [0] * B1, [0] * B1, 0, 0).to_tensor()
        extra = torch.tensor([win["tokens"], win["wait"]], dtype=torch.float64)
        both = dist.all_reduce(torch.cat([vec, extra]).to(dist.device)).cpu()
        m = Metrics.from_tensor(both[:-2])
        elapsed = time.perf_counter() - win["t"]
        if runlog is not None:
            rate = (time.perf_counter() - started) / max(1, step - start_step)
            counted = sum(m.slot_count)
            runlog.step({
                "split": "train", "step": step, "epoch": epoch, "loss": m.loss,
                "acc": sum(m.slot_correct) / counted if counted else float("nan"), "tau_hat": m.tau_hat,
                "streak": m.tau_hat - 1.0, "slot_accuracy": m.slot_accuracy, "lr": lr,
                "grad_norm": gnorm, "tokens_per_s": float(both[-2]) / max(elapsed, 1e-9),
                "data_wait": float(both[-1]) / dist.world / max(elapsed, 1e-9),
                "prefetch_depth": stream.depth() if stream is not None else 0,
                "eta_s": rate * max(0, trainer.total - step), "blocks": m.blocks,
            })
        win.update(t=time.perf_counter(), wait=0.0, tokens=0, metrics=None)

    stop = False
    corrupt: set[int] = set()
    try:
        while state.epoch < cfg.epochs and not stop:
            epoch, offset, dropped, rounds_done = state.epoch, 0, [0, 0], 0
            for ids in _rounds(cfg, state, store, dist, train_ids, runlog, num_slots):
                plan = plan_round(lengths.load(ids), ids, epoch=epoch, round_index=rounds_done, **plan_kw)
                rounds_done += 1
                dropped = [dropped[0] + plan.dropped_samples, dropped[1] + plan.dropped_tokens]
                if cfg.follow and epoch == 0 and not cfg.max_steps and ckpt is None and rounds_done == 1:
                    trainer.total = _estimate_total(cfg, plan.steps, len(ids), len(train_ids))
                    if runlog is not None:
                        runlog.set_total(trainer.total)
                start = max(0, state.step_in_epoch - offset)
                if start < plan.steps:
                    stream = RoundStream(store, plan, slots=my_slots, epoch=epoch, step_offset=offset, start=start,
                                         seed=cfg.seed, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                                         anchors=cfg.anchors, max_blocks=max_blocks_for(cfg.batch_tokens),
                                         device=dist.device, depth=cfg.prefetch_shards,
                                         skip_corrupt=cfg.skip_corrupt)
                    try:
                        while True:
                            if cfg.max_steps and step >= cfg.max_steps:
                                stop = True
                                break
                            item, waited = stream.get()
                            if item is None:
                                break
                            metrics, gnorm, lr = trainer.step(item.micro)
                            step += 1
                            state.step_in_epoch = item.step_in_epoch + 1
                            win["wait"] += waited
                            win["tokens"] += item.tokens
                            if metrics is not None:
                                win["metrics"] = metrics if win["metrics"] is None else win["metrics"] + metrics
                            if step % cfg.log_every == 0:
                                log_step(epoch, gnorm, lr)
                            if step % cfg.save_every == 0:
                                save()
                    finally:
                        corrupt.update(stream.corrupt)
                        stream.close()
                        stream = None
                offset += plan.steps
                if stop:
                    break
            if stop:
                break
            if cfg.follow and epoch == 0:
                state.follow_done = True
                state.shards = sorted({s for r in state.rounds for s in r})
                if not cfg.max_steps:
                    trainer.total = planned_total(epoch_steps, 1, cfg.epochs, 0, done=step)
                    if runlog is not None:
                        runlog.set_total(trainer.total)
            if runlog is not None:
                runlog.write({"event": "epoch_end", "step": step, "epoch": epoch, "steps": offset,
                              "rounds": [list(r) for r in state.rounds] if cfg.follow and epoch == 0 else [state.shards],
                              "dropped_samples": dropped[0], "dropped_tokens": dropped[1],
                              "corrupt_shards": sorted(corrupt | set(lengths.corrupt))})
                log.info("epoch %d done at step %d: %d steps; the tail cut to keep ranks in step dropped %d samples "
                         "(%d tokens)", epoch, step, offset, dropped[0], dropped[1])
            state.epoch, state.step_in_epoch = epoch + 1, 0
            validate(epoch)
        if step != last_saved:
            save()
        if val_ids and stop:
            validate(state.epoch)
    finally:
        if runlog is not None:
            runlog.close()
    if dist.rank == 0:
        png = plot_run(run)
        log.info("trained %d steps into %s%s", step, run, f"; curves in {png}" if png else "")
    dist.close()
