"""`dflash run`: the plan, then `dflash extract` and `dflash train --follow` as child process groups, one progress
view, restarts of a stage that dies, and training grown onto the extract GPUs once extraction is complete.

The stages are real `dflash` subprocesses (their own process groups, logs in RUN/logs/), so this module knows them
only through their configs, their exit codes and the files they write: the store's commit records and the run's
metrics.jsonl. Exit codes: 0 done; 2 a DflashError (bad option, bad data, mismatch): reported once, never retried;
130/143 stopped by a signal; anything else (a crash, -9) died: restarted with backoff, at most --retries times
without progress in between.
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..config import ExtractConfig, RunConfig, TrainConfig, parse_gpus
from ..runtime.process import format_eta
from .stage import STOP_TIMEOUT_S, Stage
from .watch import Metrics, StoreView

__all__ = ["supervise", "grow_gpus", "Stage", "Supervisor"]

log = logging.getLogger(__name__)

DETERMINISTIC = 2  # a DflashError: the same command fails the same way again
STOPPED = (130, 143, -signal.SIGINT, -signal.SIGTERM)
RUN_RECORD = "config.json"  # written by `dflash train` in its run folder: its "resolved" part records the slots
POLL_S = 0.2


def grow_gpus(train: str, extract: str, slots: int) -> list[int] | None:
    """Return the GPUs training grows onto once extraction is done: the train GPUs, then the extract GPUs, as many
    as keep `slots` divisible (same slots, same batches); None when no larger count does, or a stage is on cpu."""
    have, freed = parse_gpus(train), parse_gpus(extract)
    if have is None or freed is None:
        return None
    pool = have + [g for g in freed if g not in have]
    for n in range(len(pool), len(have), -1):
        if slots % n == 0:
            return pool[:n]
    return None


class Supervisor:
    """The whole `dflash run`: see the module docstring."""

    def __init__(self, cfg: RunConfig, extract: ExtractConfig, train: TrainConfig) -> None:
        self.cfg, self.extract_cfg, self.train_cfg = cfg, extract, train
        self.run = Path(cfg.out)
        self.logs = self.run / "logs"
        self.extract = Stage("extract", self.logs / "extract.log")
        self.train = Stage("train", self.logs / "train.log")
        self.metrics = Metrics(self.run)
        self.store = StoreView(cfg.store)
        self.signum: int | None = None
        self.pressed_again = False
        self.train_gpus = cfg.train_gpus
        self.grow_at: int | None = None  # the checkpoint step after which training is stopped to grow
        self.extract_done = False
        self.level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()

    # -- commands ------------------------------------------------------------------------------------------------
    def argv(self, stage: str, **extra: Any) -> list[str]:
        """Return the `dflash` arguments of a stage's command."""
        import dataclasses

        cfg = self.extract_cfg if stage == "extract" else dataclasses.replace(self.train_cfg, gpus=self.train_gpus)
        return ["--log-level", self.level, stage, *dataclasses.replace(cfg, **extra).to_argv()]

    def slots(self) -> int:
        """Return the run's slots: its record's, else the train GPUs x --grad-accum."""
        try:
            return int(json.loads((self.run / RUN_RECORD).read_text())["resolved"]["num_slots"])
        except (OSError, ValueError, KeyError, TypeError):
            n = parse_gpus(self.cfg.train_gpus)
            return (len(n) if n else 1) * self.train_cfg.grad_accum

    # -- the job -------------------------------------------------------------------------------------------------
    def plan(self) -> int:
        """Print `dflash extract --dry-run`'s plan (kept in RUN/logs/plan.log); return its exit code."""
        self.logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "dflash.cli", *self.argv("extract", dry_run=True)]
        # Its own session, as the stages': a terminal's Ctrl-C reaches the supervisor alone, which stops it.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        asked = False
        while True:
            try:
                out, err = proc.communicate(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if self.signum is not None and not asked:
                    proc.terminate()  # the plan is not waited for
                    asked = True
        (self.logs / "plan.log").write_text(err + out)
        if self.signum is not None:
            pass  # main says the one line of a stop
        elif proc.returncode == 0:
            print(out.rstrip(), file=sys.stderr, flush=True)
        else:
            lines = [x for x in (err + out).splitlines() if x.strip()]
            print(lines[-1] if lines else f"dflash run: the plan failed with exit code {proc.returncode}",
                  file=sys.stderr, flush=True)
        return proc.returncode

    def on_signal(self, signum: int, frame: Any) -> None:
        """Note Ctrl-C or SIGTERM for the main loop; the first one sets the exit code."""
        if self.signum is None:
            self.signum = signum
        else:
            self.pressed_again = True  # said by stop_all: printing here could re-enter a print of the main thread

    def main(self) -> int:
        """Return the exit code of the whole job (0: store complete and training done)."""
        self.store.poll()
        self.extract_done = self.store.complete
        if not self.extract_done:
            code = self.plan()
            if self.signum is not None:
                return self.interrupted()
            if code != 0 or self.extract_cfg.dry_run:
                return code
            self.extract.start(self.argv("extract"))
        elif not self.cfg.no_grow:
            self.train_gpus = self.grown() or self.train_gpus
        self.train.start(self.argv("train"))
        last_line = 0.0
        while True:
            if self.signum is not None:
                return self.interrupted()
            self.store.poll()
            self.metrics.poll()
            code = self.watch_extract()
            if code is None:
                code = self.watch_train()
            if code is not None:
                return code
            if time.monotonic() - last_line >= self.cfg.progress_every:
                self.show()
                last_line = time.monotonic()
            time.sleep(POLL_S)

    def watch_extract(self) -> int | None:
        """Handle extract's end; return the job's exit code when it must stop."""
        st = self.extract
        if self.extract_done or st.proc is None:
            return None
        if st.restart_at is not None:
            return self.maybe_restart(st, "extract")
        code = st.poll()
        if code is None:
            return None
        if code == 0:
            self.extract_done = True
            log.info("dflash run: extraction complete (%d shards)", len(self.store.tokens))
            if not self.cfg.no_grow and self.grown() is not None:
                self.grow_at = self.metrics.checkpoint
                log.info("dflash run: training grows onto %s at its next checkpoint",
                         ",".join(map(str, self.grown())))
            return None
        return self.died(st, code, "extract")

    def watch_train(self) -> int | None:
        """Handle training's end, growth and restarts; return the job's exit code when it is over."""
        st = self.train
        if st.restart_at is not None:
            return self.maybe_restart(st, "train")
        if self.grow_at is not None and st.running and self.metrics.checkpoint > self.grow_at:
            gpus = self.grown()
            log.info("dflash run: checkpoint at step %d; restarting training on GPUs %s", self.metrics.checkpoint,
                     ",".join(map(str, gpus)))
            code = st.stop()
            self.grow_at = None
            if code == 0:
                return self.finished()
            self.train_gpus = ",".join(map(str, gpus))
            st.start(self.argv("train"))
            return None
        code = st.poll()
        if code is None:
            return None
        if code == 0:
            if self.extract_done:
                return self.finished()
            if not st.stop_asked:
                log.info("dflash run: training finished; waiting for extraction to complete the store")
                st.stop_asked = True  # said once
            return None
        return self.died(st, code, "train")

    def grown(self) -> list[int] | None:
        """Return the GPUs training grows onto (None: it stays)."""
        return grow_gpus(self.train_gpus, self.cfg.extract_gpus, self.slots())

    def died(self, st: Stage, code: int, name: str) -> int | None:
        """Decide what an unexpected exit of a stage means: stop the job, or restart the stage after a backoff."""
        st.sweep()
        if code == DETERMINISTIC:
            print(f"dflash run: {name} failed: {st.last_line()}", file=sys.stderr, flush=True)
            self.stop_all()
            return DETERMINISTIC
        if code in STOPPED:
            print(f"dflash run: {name} was stopped by a signal (exit {code}); stopping; rerun the same command "
                  "to resume", file=sys.stderr, flush=True)
            self.stop_all()
            return 143 if code in (143, -signal.SIGTERM) else 130
        progress = self.progress_mark(name)
        if progress != getattr(st, "mark", None):
            st.failures = 0
        st.mark = progress
        st.failures += 1
        if st.failures > self.cfg.retries:
            print(f"dflash run: {name} died {st.failures} times without progress (last exit {code}): "
                  f"{st.last_line()}; see {st.log_path}; rerun the same command to resume", file=sys.stderr, flush=True)
            self.stop_all()
            return 1
        delay = min(60.0, 2.0 ** (st.failures - 1))
        log.warning("dflash run: %s died (exit %d); restarting in %.0f s (%d of %d)", name, code, delay,
                    st.failures, self.cfg.retries)
        st.restart_at = time.monotonic() + delay
        return None

    def progress_mark(self, name: str) -> int:
        """Return what counts as a stage's progress: shards committed (extract), newest checkpoint (train)."""
        return len(self.store.tokens) if name == "extract" else self.metrics.checkpoint

    def maybe_restart(self, st: Stage, name: str) -> None:
        """Restart a dead stage once its backoff has passed."""
        if time.monotonic() >= st.restart_at:
            st.start(self.argv(name))
        return None

    def show(self) -> None:
        """Log one progress line of both stages and the whole job."""
        ext, ext_eta = ("extract done", 0.0) if self.extract_done else self.store.line()
        m = self.metrics.last
        if m is None:
            tr, tr_eta = "train: waiting for its first step", float("inf")
        else:
            tr_eta = float(m.get("eta_s", float("inf")))
            tr = (f"train step {m['step']} loss {m['loss']:.4f} tau_hat {m['tau_hat']:.3f} data wait "
                  f"{m['data_wait']:.0%}, ETA {format_eta(tr_eta)}")
        log.info("dflash run: %s | %s | job ETA %s", ext, tr, format_eta(max(ext_eta, tr_eta)))

    def stop_all(self) -> None:
        """Stop both stages: SIGTERM to each group, wait STOP_TIMEOUT_S for both, then SIGKILL what is left.

        A second Ctrl-C meanwhile is answered once: the stages unwind (claims released, a checkpoint published),
        which a kill would cut short, so it is not escalated.
        """
        stages = [st for st in (self.extract, self.train) if st.proc is not None]
        for st in stages:
            st.signal(signal.SIGTERM)
        deadline, said = time.monotonic() + STOP_TIMEOUT_S, False
        while any(st.running for st in stages) and time.monotonic() < deadline:
            if self.pressed_again and not said:
                said = True
                print("dflash run: still stopping: "
                      + ", ".join(f"{st.name} (pid {st.proc.pid})" for st in stages if st.running)
                      + f" finishing a checkpoint or a shard; killed {STOP_TIMEOUT_S:.0f} s after the stop began",
                      file=sys.stderr, flush=True)
            time.sleep(POLL_S / 4)
        for st in stages:
            st.stop(timeout=0)  # SIGKILL to a group still running; what a stage left in its group is swept

    def interrupted(self) -> int:
        """Stop both stages after Ctrl-C or SIGTERM; return 130 or 143."""
        self.stop_all()
        print("dflash run: stopped; rerun the same command to resume extraction and training", file=sys.stderr,
              flush=True)
        return 130 if self.signum == signal.SIGINT else 143

    def finished(self) -> int:
        """Report the end of the job; return 0."""
        self.stop_all()
        m = self.metrics.last or {}
        print(f"dflash run: done: store {self.cfg.store} complete, training at step {m.get('step', 0)} in "
              f"{self.cfg.out}", file=sys.stderr, flush=True)
        return 0


def supervise(cfg: RunConfig, extract: ExtractConfig, train: TrainConfig) -> int:
    """Run `dflash run`; return its exit code (0 done, 2 a stage's deterministic error, 130/143 stopped)."""
    sup = Supervisor(cfg, extract, train)
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return sup.main()
    finally:
        sup.stop_all()  # a no-op after a stop; after an error, no stage is left running
        for s, handler in old.items():
            # Once a signal has stopped the job, nothing is left to stop: a further Ctrl-C while the process exits
            # would only print a second message (or kill the interpreter mid-exit), so it is ignored.
            signal.signal(s, handler if sup.signum is None else signal.SIG_IGN)
