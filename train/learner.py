"""One rank's optimizer step: the drafter (fp32 master weights, DDP when several ranks), the target's frozen head,
AdamW with a cosine schedule, bf16 autocast, gradient accumulation over the rank's slots, clipping, FLOP count."""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .dist import Dist

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..drafter.config import DrafterConfig
    from .objective import Metrics

log = logging.getLogger(__name__)

__all__ = ["Learner", "StepOptions", "compiles", "lr_factor", "warn_cpu_sizes"]


@dataclass(frozen=True)
class StepOptions:
    """Ways to run the same optimizer step (bench/train.py --variants A/Bs them); the defaults are `dflash train`'s.

    chunk_rows: rows of each chunk of the lm_head CE (None: about 2.3 GiB of fp32 logits; same loss to rounding).
    few_syncs: the loss denominators, metric sums, FLOP counts and grad norm stay on the device and come to the
    host in one copy at the end of the step (equal numbers; the forward still waits once, for the counted rows).
    compile_layers: torch.compile each layer's parts around attention (norms, projections, RoPE, MLP, DFlash 2's
    convolutions) with dynamic shapes; the same math to float rounding. None: as --compile-layers says (auto: on
    CUDA).
    adamw: "fused" (one kernel per step on CUDA; the loop's) or "foreach".
    """

    chunk_rows: int | None = None
    few_syncs: bool = False
    compile_layers: bool | None = None
    adamw: str = "fused"


def compiles(cfg: "TrainConfig", device: Any) -> bool:
    """Return whether the drafter's layers are compiled for --compile-layers on this device (auto: on CUDA)."""
    return cfg.compile_layers == "on" or (cfg.compile_layers == "auto" and device.type == "cuda")


class Learner:
    """Model, frozen target head, optimizer and schedule of one rank; `step` runs one optimizer step."""

    def __init__(self, cfg: "TrainConfig", dcfg: "DrafterConfig", dist: Dist,
                 options: StepOptions = StepOptions()) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from ..drafter.model import DFlashDrafter
        from ..targets.head import load_target_head
        from .packing import batch_capacity

        self.cfg, self.dist, dev = cfg, dist, dist.device
        self.options = options
        if dist.rank == 0 and dev.type == "cpu":
            warn_cpu_sizes(cfg)
        torch.manual_seed(cfg.seed)
        self.model = DFlashDrafter(dcfg).to(dev)  # fp32 master weights; compute is autocast to bf16
        if compiles(cfg, dev) if options.compile_layers is None else options.compile_layers:
            log.info("drafter layers: compiled with dynamic shapes (--compile-layers %s)", cfg.compile_layers)
            for layer in self.model.layers:
                layer.compile_parts(dynamic=True)  # batches differ in blocks and context: one graph for all
        self.ddp = DDP(self.model, device_ids=[dev] if dev.type == "cuda" else None) if dist.world > 1 else self.model
        assert cfg.dtype in ("bfloat16", "float32"), f"--dtype {cfg.dtype} reached the learner unresolved"
        self.bf16 = cfg.dtype == "bfloat16"
        self.head = load_target_head(cfg.target, dtype=torch.bfloat16 if self.bf16 else torch.float32, device=dev)
        self.attention = cfg.attention if cfg.attention != "auto" else ("flex" if dev.type == "cuda" else "sdpa")
        self.capacity = batch_capacity(cfg.batch_tokens)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     **({"fused": True} if dev.type == "cuda" and options.adamw == "fused"
                                        else {"foreach": True} if options.adamw == "foreach" else {}))
        self.total = 1
        self.last_flops = 0.0  # model FLOPs (forward + backward) of the last step on this rank
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, self.total, cfg.warmup_ratio))

    def autocast(self) -> Any:
        """Return the bf16 autocast context (or none for --dtype float32)."""
        from ..targets.numerics import compute_context

        return compute_context(self.dist.device.type, self.cfg.dtype)

    def objective_options(self, **extra: Any) -> dict[str, Any]:
        """Return objective.predict's options for this run's training steps."""
        return dict(attention=self.attention, capacity=self.capacity, position_weights=self.cfg.position_weights,
                    dpace_alpha=self.cfg.dpace_alpha, chunk_rows=self.options.chunk_rows,
                    tree_loss=self.cfg.tree_loss or 0, accept_loss=self.cfg.accept_loss, **extra)

    def step(self, micro: list[Any]) -> tuple["Metrics | None", float, float]:
        """Run one optimizer step over this rank's micro-batches; return (summed Metrics or None, grad norm, lr)."""
        import torch

        from ..drafter.flops import step_flops

        if self.options.few_syncs:
            return self._step_few_syncs(micro)
        metrics = self.backward(micro)
        self.last_flops = sum(sum(step_flops(self.model.config, b).values()) for b in micro if b is not None)
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip))
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return metrics, gnorm, lr

    def backward(self, micro: list[Any]) -> "Metrics | None":
        """Accumulate the gradient of this rank's micro-batches (reduced over ranks); return their summed Metrics.

        The loss of each micro-batch is normalised by the loss denominator of the whole global batch (all ranks,
        all micro-batches; objective.loss_denominator: the decay-weight total, or D-PACE's counted blocks), so the
        gradient equals that of one big batch whatever the world size, accumulation and anchors per rank.
        """
        import torch

        from .objective import drafter_loss, loss_denominator

        dev, weighting = self.dist.device, self.cfg.position_weights
        local = [loss_denominator(b.weights, weighting) if b is not None else 0.0 for b in micro]
        total = float(self.dist.all_reduce(torch.tensor([sum(local)], dtype=torch.float64, device=dev))[0])
        options = self.objective_options()
        metrics = None
        for i, (b, d) in enumerate(zip(micro, local)):
            sync = i == len(micro) - 1 or self.dist.world == 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self.autocast():
                if b is None or d == 0.0:
                    # Nothing to learn here, but DDP needs every rank to reduce every parameter's gradient.
                    loss = sum(p.sum() for p in self.ddp.parameters()) * 0.0
                    if b is not None:
                        _, m = drafter_loss(self.ddp, b, self.head.embed, self.head.lm_head, **options)
                        metrics = m if metrics is None else metrics + m
                else:
                    loss, m = drafter_loss(self.ddp, b, self.head.embed, self.head.lm_head, **options)
                    loss = loss * (d / max(total, 1e-12) * self.dist.world)
                    metrics = m if metrics is None else metrics + m
            loss.backward()
        return metrics

    def _step_few_syncs(self, micro: list[Any]) -> tuple["Metrics | None", float, float]:
        """`step` with one host copy at its end: the same losses, gradients, update and numbers (StepOptions)."""
        import torch

        from ..drafter.flops import flops_of, step_counts
        from .objective import Metrics, predict

        dev, weighting = self.dist.device, self.cfg.position_weights
        batches = [b for b in micro if b is not None]
        local = [_denominator(b.weights, weighting) for b in batches]
        total = self.dist.all_reduce(sum(local, torch.zeros((), dtype=torch.float64, device=dev)).reshape(1))[0]
        options = self.objective_options(host_sync=False)
        sums = []
        for i, (b, d) in enumerate(zip(batches, local)):
            sync = i == len(batches) - 1 or self.dist.world == 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self.autocast():
                p = predict(self.ddp, b, self.head.embed, self.head.lm_head, **options)
                # A batch holds a counted slot whenever it holds a block (an anchor's next token is in the loss
                # mask), so d > 0 here: `backward`'s d == 0 branch needs no host check.
                loss = p.loss * (d / total.clamp(min=1e-12) * self.dist.world).to(p.loss.dtype)
                sums.append(p.sums)
            loss.backward()
        if not batches:  # a rank whose step is all skipped samples still joins DDP's reduction
            with self.autocast():
                (sum(p.sum() for p in self.ddp.parameters()) * 0.0).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        counts = [step_counts(b).double() for b in batches]
        host = torch.cat([gnorm.double().reshape(1), *counts, *sums]).cpu()  # the step's one host copy
        n = len(batches)
        self.last_flops = sum(sum(flops_of(self.model.config, b.num_blocks, b.ctx_pos.shape[0], int(c[0]),
                                           float(c[1])).values())
                              for b, c in zip(batches, host[1:1 + 2 * n].view(n, 2)))
        size = (host.numel() - 1 - 2 * n) // max(1, n)
        metrics = None
        for j in range(n):
            m = Metrics.from_tensor(host[1 + 2 * n + j * size:1 + 2 * n + (j + 1) * size])
            metrics = m if metrics is None else metrics + m
        return metrics, float(host[0]), lr


def _denominator(weights: Any, position_weights: str) -> Any:
    """Return objective.loss_denominator as a float64 tensor on the weights' device (the same reduction)."""
    counted = weights[:, 1:]
    if position_weights == "dpace":
        return (counted > 0).any(dim=1).sum().double()
    return counted.sum().double()


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Return the learning-rate multiplier of a step: linear warmup over warmup_ratio of the run, then cosine to 0."""
    warm = max(1, math.ceil(warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# What `dflash train` defaults to for GPUs; on a CPU they make a step take minutes.
_GPU_SIZES = {"batch_tokens": 4096, "anchors": 128, "draft_layers": 2}


def warn_cpu_sizes(cfg: "TrainConfig") -> None:
    """Warn (one line) when a CPU run has options sized for GPUs."""
    big = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k, limit in _GPU_SIZES.items() if getattr(cfg, k) > limit]
    if big:
        log.warning("training on a CPU with options sized for GPUs (%s): a step may take minutes; for a CPU try "
                    "--batch-tokens 2048 --anchors 64 --draft-layers 1", ", ".join(big))
