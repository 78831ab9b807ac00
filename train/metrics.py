"""What a run tells its user: metrics.jsonl records, log lines or a progress bar, TensorBoard, and the final PNG."""
from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.atomic import write_atomic
from ..errors import DflashError
from ..runtime.process import Progress

if TYPE_CHECKING:
    from .objective import Metrics
    from .stream import StepData

__all__ = ["METRICS_FILE", "PLOT_FILE", "require_tensorboard", "read_metrics", "truncate_metrics", "RunLog", "Window",
           "plot_run", "device_peak", "step_record"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"


def require_tensorboard() -> Any:
    """Return tensorboard's SummaryWriter class; DflashError naming the install command if it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise DflashError(
            "--tensorboard needs the tensorboard package, which is not installed; run `pip install tensorboard` "
            "or train without --tensorboard (metrics.jsonl has the same numbers)"
        ) from None
    return SummaryWriter


def read_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    """Return the records of RUN/metrics.jsonl, skipping a torn last line left by a killed run."""
    path = Path(run) / METRICS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def truncate_metrics(run: str | os.PathLike, step: int) -> int:
    """Rewrite metrics.jsonl without what was logged after the checkpoint we resume from (later steps and events,
    and the epoch-end and validation records of its own step), which the resumed run logs again; return how many
    went."""
    path = Path(run) / METRICS_FILE
    if not path.is_file():
        return 0
    records = read_metrics(run)
    # Kept of the checkpoint's own step: its training record, and the event that says it was published (a rerun
    # does not publish it again).
    keep = [r for r in records if int(r.get("step", 0)) < step
            or (r.get("step") == step and (r.get("split") == "train" or r.get("event") == "checkpoint"))]
    if step and not any(r.get("event") == "checkpoint" and r.get("step") == step for r in keep):
        # A run killed between publishing this checkpoint and logging that it did: it is published (we resume it).
        keep.append({"event": "checkpoint", "step": step})
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))
    return len(records) - len(keep)


# What a validation line of metrics.jsonl holds, in this order.
_VALIDATION_KEYS = ("split", "step", "epoch", "loss", "loss_weights", "acc", "tau_hat", "slot_accuracy", "accept_rate",
                    "blocks", "tokens", "shards", "tree_budgets", "tree_tau", "selector_tree_tau")


class RunLog:
    """Rank 0's sink for step records: metrics.jsonl, a tqdm bar on a terminal or log lines, TensorBoard."""

    def __init__(self, run: str | os.PathLike, *, total_steps: int, start_step: int, tensorboard: bool) -> None:
        self.run = Path(run)
        self.file = open(self.run / METRICS_FILE, "a", encoding="utf-8")
        self.progress = Progress(total_steps, unit="step", desc="train", initial=start_step, logger=log)
        self.tb = require_tensorboard()(log_dir=str(self.run / "tensorboard")) if tensorboard else None

    @property
    def total(self) -> int:
        """Return the run's (estimated) length in steps."""
        return self.progress.total

    def set_total(self, total: int) -> None:
        """Take a new estimate of the run's length (follow mode learns it as shards arrive)."""
        self.progress.set_total(total)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record to metrics.jsonl (flushed, so a killed run keeps what it logged)."""
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()

    def step(self, record: dict[str, Any]) -> None:
        """Record a training step: file, TensorBoard, and the bar or a log line."""
        self.write(record)
        step = record["step"]
        if self.tb is not None:
            for key in ("loss", "acc", "tau_hat", "lr", "grad_norm", "tokens_per_s", "query_tokens_per_s",
                        "tflops_per_s", "mfu", "data_wait"):
                if record.get(key) is not None:  # no MFU on a device of unknown peak
                    self.tb.add_scalar(f"{record.get('split', 'train')}/{key}", record[key], step)
        text = (f"loss {record['loss']:.4f} acc {record['acc']:.3f} tau {record['tau_hat']:.3f} "
                f"lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} ctx tok/s "
                f"{record.get('query_tokens_per_s', 0):,.0f} query tok/s"
                + (f" MFU {record['mfu']:.1%}" if record.get("mfu") is not None else "")
                + f" wait {record['data_wait']:.0%}")
        if self.progress.bar is None:
            text = (f"epoch {record['epoch']}: {text} gnorm {record['grad_norm']:.3f} "
                    f"prefetch {record['prefetch_depth']}")
        self.progress.update(to=step, detail=text, force=True)

    def validation(self, record: dict[str, Any]) -> None:
        """Record a validation pass: its split, step and epoch, and evaluate_shards' numbers that a run tracks."""
        record = {k: record[k] for k in _VALIDATION_KEYS if k in record}
        self.write(record)
        if self.tb is not None:
            for key in ("loss", "acc", "tau_hat"):
                self.tb.add_scalar(f"val/{key}", record[key], record["step"])
        trees = "".join(f" tree{n} {t:.3f}" for n, t in zip(record.get("tree_budgets", ()), record.get("tree_tau", ())))
        log.info("validation at step %d: loss %.4f acc %.3f tau_hat %.3f%s on %d blocks", record["step"],
                 record["loss"], record["acc"], record["tau_hat"], trees, record["blocks"])

    def waiting(self, text: str) -> None:
        """Show that training has caught up with the store and waits for shards."""
        self.progress.note(text)

    def close(self) -> None:
        """Close the file, the bar and TensorBoard."""
        self.file.close()
        self.progress.close()
        if self.tb is not None:
            self.tb.close()


def plot_run(run: str | os.PathLike) -> Path | None:
    """Return RUN/curves.png: loss and tau_hat over steps, train and validation (None without any record)."""
    records = read_metrics(run)
    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("loss", "tau_hat")):
        for rows, label, style in ((train, "train", "-"), (val, "validation", "o-")):
            if rows:
                weights = rows[-1].get("loss_weights", "decay")  # D-PACE's train loss is on another scale
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], style,
                        label=f"{label} ({weights} weights)" if key == "loss" and weights != "decay" else label)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(run) / PLOT_FILE
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(out, buf.getvalue())
    return out


@dataclass
class Window:
    """What happened since the last log line: its start, seconds waiting for data, tokens, FLOPs, summed metrics."""

    start: float
    wait: float = 0.0
    tokens: int = 0
    steps: int = 0
    flops: float = 0.0
    metrics: "Metrics | None" = None

    def add(self, item: "StepData", waited: float, metrics: "Metrics | None", flops: float = 0.0) -> None:
        """Count one step."""
        self.steps += 1
        self.flops += flops
        self.wait += waited
        self.tokens += item.tokens
        if metrics is not None:
            self.metrics = metrics if self.metrics is None else self.metrics + metrics

    def reduce(self, dist: Any, block_size: int) -> tuple["Metrics", float, float, float]:
        """Return the window's metrics, tokens, data wait and FLOPs summed over every rank."""
        import torch

        from .objective import Metrics

        B1 = block_size - 1
        vec = self.metrics.to_tensor() if self.metrics is not None else Metrics(0.0, 0.0, [0] * B1, [0] * B1, 0, 0).to_tensor()
        extra = torch.tensor([self.tokens, self.wait, self.flops], dtype=torch.float64)
        both = dist.all_reduce(torch.cat([vec, extra]).to(dist.device)).cpu()
        tokens, wait, flops = (float(x) for x in both[-3:])
        return Metrics.from_tensor(both[:-3]), tokens, wait, flops


def device_peak(device: Any) -> float | None:
    """Return the dense bf16 FLOP/s of a CUDA device (None on a CPU or an unknown GPU: no MFU then)."""
    if device.type != "cuda":
        return None
    import torch

    from ..drafter.flops import peak_flops

    return peak_flops(torch.cuda.get_device_name(device))


def step_record(m: "Metrics", tokens: float, wait: float, flops: float, *, cfg: Any, dist: Any, step: int, epoch: int,
                lr: float, gnorm: float, elapsed: float, block_size: int, eta_s: float,
                prefetch_depth: int) -> dict[str, Any]:
    """Return one step line of metrics.jsonl from a window's metrics summed over the ranks."""
    import torch

    peak = device_peak(dist.device)
    peak = peak * dist.world if peak else None
    counted = sum(m.slot_count)
    # D-PACE's mean weight per slot shows where its credit goes; decay's would be its constants.
    dpace = {"slot_weight": m.slot_mean_weight} if cfg.position_weights == "dpace" else {}
    return {
        "split": "train", "step": step, "epoch": epoch, "loss": m.loss,
        "loss_weights": cfg.position_weights, **dpace,
        "acc": sum(m.slot_correct) / counted if counted else float("nan"), "tau_hat": m.tau_hat,
        "streak": m.tau_hat - 1.0, "slot_accuracy": m.slot_accuracy, "lr": lr,
        "grad_norm": gnorm, "tokens_per_s": tokens / max(elapsed, 1e-9),
        # Query tokens (blocks x block size) and MFU compare runs whose samples differ in length.
        "query_tokens_per_s": m.blocks * block_size / max(elapsed, 1e-9),
        "tflops_per_s": flops / max(elapsed, 1e-9) / 1e12,
        "mfu": flops / max(elapsed, 1e-9) / peak if peak else None,
        "data_wait": wait / dist.world / max(elapsed, 1e-9),
        "prefetch_depth": prefetch_depth,
        "eta_s": eta_s, "blocks": m.blocks,
        **m.selector_dict(),  # DFlash 2's loss terms and selector metrics; none for DFlash 1
        **m.objective_dict(),  # --tree-loss-nodes and --accept-loss terms; none when off
        # This rank's peak device memory so far (what a larger drafter or batch has to fit in).
        "peak_mem_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30
        if torch.device(dist.device).type == "cuda" else None,
    }
