"""`dflash demo`'s run: every stage left, in order, each timed and recorded in OUT/demo-state.json, then the final
table (OUT/summary.json) and the training curve."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import LEGACY_DEFAULTS
from ..errors import ConfigError
from ..runtime.atomic import write_atomic
from .budgets import BUDGETS
from .stages import STAGES, Demo
from .table import summary_table

if TYPE_CHECKING:
    from ..config import DemoConfig

__all__ = ["run"]

log = logging.getLogger(__name__)

STATE_FILE = "demo-state.json"
SUMMARY_FILE = "summary.json"
CURVE_FILE = "training-curve.png"


def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class _State:
    """The demo's record of finished stages (OUT/demo-state.json), rewritten atomically after each stage."""

    def __init__(self, out: Path, cfg: "DemoConfig") -> None:
        self.path = out / STATE_FILE
        self.data: dict[str, Any] = {"config": cfg.to_dict(), "stages": {}}
        if self.path.is_file():
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            # What decides the data and the training; a rerun resumes only the same (an option the saved run
            # predates had its default then).
            for name in ("budget", "self_prompts", "position_weights", "drafter"):
                was = saved.get("config", {}).get(name, LEGACY_DEFAULTS.get(name))
                now = getattr(cfg, name)
                if was != now:
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(f"--out {out}: holds a demo run with {flag} {was}, asked for {flag} {now}; "
                                      "rerun with the same value or choose a new --out")
            self.data["stages"] = saved.get("stages", {})

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Return the stage's recorded result, or run it now, time it, and record it."""
        done = self.data["stages"].get(name)
        if done is not None:
            log.info("demo: %s already done (%.0f s); skipping", name, done["seconds"])
            return done
        log.info("demo: %s ...", name)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        result = fn()
        result["seconds"] = round(time.perf_counter() - t0, 1)
        # CPU seconds of this process and its children: on a shared machine, wall time says little about speed.
        result["cpu_seconds"] = round(_cpu_seconds() - c0, 1)
        self.data["stages"][name] = result
        write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        log.info("demo: %s done in %.0f s", name, result["seconds"])
        return result


def run(cfg: "DemoConfig") -> dict[str, Any]:
    """Return the final table (also printed and written to OUT/summary.json) after running every stage left."""
    from .assets import smollm2_folder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budget = BUDGETS[cfg.budget]
    # The budget's drafter and weights unless the command names others; the state records what was trained.
    cfg = dataclasses.replace(cfg, drafter=cfg.drafter or budget.drafter,
                              position_weights=cfg.position_weights or budget.position_weights)
    out = Path(cfg.out).resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: expected a folder for the demo's outputs, found a file; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    state = _State(out, cfg)
    cfg.save(out / "demo-config.json")
    started = time.perf_counter()
    d = Demo(cfg=cfg, budget=budget, out=out, target=smollm2_folder())
    stages = {name: state.stage(name, lambda fn=fn: fn(d)) for name, fn in STAGES.items()}
    curve = d.run_dir / "curves.png"
    if curve.is_file():
        shutil.copyfile(curve, out / CURVE_FILE)
    table = summary_table(d, stages, time.perf_counter() - started,
                          curve=str(out / CURVE_FILE) if (out / CURVE_FILE).is_file() else None,
                          summary=str(out / SUMMARY_FILE))
    write_atomic(out / SUMMARY_FILE, json.dumps(table, indent=2) + "\n")
    return table
