"""Options of `dflash train`."""
from __future__ import annotations

from dataclasses import dataclass

from .base import StageConfig
from .options import (COMPILES, DPACE_ALPHA, DRAFTERS, DTYPE_CHOICES, POSITION_WEIGHTS, cache_dir_option,
                      cache_gb_option, check, check_budgets, check_cache, drafter_option, option, parse_gpus,
                      position_weights_option, tree_tau_nodes_option)

__all__ = ["TrainConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig(StageConfig):
    """Options of `dflash train`: store, target, run folder, devices, model shape, optimisation, checkpoints."""

    store: str = option(help="Feature store made by `dflash extract`.")
    target: str = option(help="Target model folder (its embedding and lm_head are read, frozen).")
    out: str = option(help="Run folder: checkpoints, metrics.jsonl, config.json, curves.png.")
    gpus: str = option("5,6,7", help="GPU indices (one DDP process each), or cpu.")
    epochs: int = option(6, help="Passes over the training shards.")
    max_steps: int | None = option(None, help="Stop after this many optimizer steps (the schedule follows).")
    batch_tokens: int = option(16384, help="Context tokens per micro-batch (one slot's batch).")
    lr: float = option(6e-4, help="Peak learning rate of AdamW (cosine schedule after warmup).")
    warmup_ratio: float = option(0.04, help="Fraction of the run spent in linear warmup.")
    weight_decay: float = option(0.0, help="AdamW weight decay.")
    clip: float = option(1.0, help="Gradient-norm clip.")
    draft_layers: int = option(5, help="Decoder layers of the drafter.")
    drafter: str = drafter_option()
    conv_kernel_size: int = option(2, help="dflash2: taps of each layer's causal convolution along the block.")
    conv_group_size: int = option(16, help="dflash2: channels sharing one dynamic tap (must divide the hidden size).")
    selector_rank: int = option(256, help="dflash2: rank of the candidate selector's predecessor-successor term.")
    selector_top_k: int = option(16, help="dflash2: candidates per slot the selector rescores (the top-K logits).")
    block_size: int = option(16, help="Block size B: the anchor plus B-1 drafted tokens.")
    anchors: int = option(512, help="Blocks drawn per sample; a batch holds at most --batch-tokens/4 blocks in all.")
    grad_accum: int = option(1, help="Micro-batches per rank per step; the global batch is GPUs x this (slots).")
    seed: int = option(0, help="Seed of data order, anchors and initialisation.")
    val_fraction: float | None = option(
        None, cli_default="auto", parse="parse_val_fraction",
        help="Fraction of shards held out for validation (by shard); auto holds out 2% (1 to 8 shards) of a store "
             "of 20 shards or more and none of a smaller one (`dflash eval` then scores every shard, and says so).")
    val_shards: tuple[int, ...] | None = option(
        None, parse="parse_shard_ids", metavar="IDS",
        help="Hold out exactly these shards (comma-separated ids) instead of --val-fraction's pick: for data laid "
             "out so that its held-out prompts fill known shards.")
    follow: bool = option(False, help="Train while `dflash extract` is still writing the store.")
    resume: bool = option(False, help="Continue from the newest complete checkpoint of --out.")
    save_every: int = option(1000, help="Checkpoint every N steps (and at the end).")
    save_every_minutes: float = option(30.0, help="Also checkpoint once this many minutes passed since the last "
                                                  "checkpoint (0: by --save-every alone).")
    keep: int = option(3, help="Checkpoints to keep.")
    log_every: int = option(10, help="Log a progress line every N steps (and the first step at once).")
    log_every_seconds: float = option(60.0, help="Also log once this many seconds passed since the last line.")
    tensorboard: bool = option(False, help="Also write TensorBoard events to RUN/tensorboard.")
    skip_corrupt: bool = option(False, help="Skip (and count) corrupt shards instead of stopping.")
    prefetch_shards: int = option(2, help="Whole shards each rank reads ahead.")
    cache_dir: str | None = cache_dir_option()
    cache_gb: float = cache_gb_option()
    sliding_window: int | None = option(None, help="Window of sliding layers (with --full-every).")
    full_every: int | None = option(None, help="Every K-th drafter layer attends fully (with --sliding-window).")
    attention: str = option("auto", choices=("auto", "flex", "sdpa"),
                            help="Attention kernel: auto is flex on CUDA, sdpa on CPU.")
    compile_layers: str = option(
        "auto", choices=COMPILES,
        help="torch.compile each drafter layer's norms, projections, RoPE and MLP (attention is compiled apart), "
             "with dynamic shapes: one compile (~30 s) for the whole run. auto is on on CUDA (one H200, 8B-sized "
             "drafter, mixed lengths: MFU 37.0% -> 44.3%), off on CPU. The same math to float rounding.")
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Compute dtype (master weights stay fp32): auto is bfloat16 on CUDA and on CPUs with "
                             "native bf16, float32 on other CPUs (a run being resumed keeps its own). Recorded.")
    position_weights: str = position_weights_option()
    dpace_alpha: float = option(DPACE_ALPHA, help="D-PACE's confidence floor: q~ = (1 - alpha) q + alpha, in (0, 1] "
                                                  "(with --position-weights dpace; the paper's 0.5).")
    tree_budgets: tuple[int, ...] = tree_tau_nodes_option(" in validation")
    tree_loss: int | None = option(
        None, metavar="N", flag="tree_loss_nodes", aliases=("tree_loss",),
        help="Add the tree loss for DDTree serving with N nodes: sum_k w_k softplus(tau_N - S_k) per block, S_k the "
             "gold prefix's summed log-probs, tau_N the N-th best prefix score (no gradient), w_k the block loss's "
             "weights (docs/concepts/trees.md, train/tree_loss.py). Logged as loss_tree.")
    accept_loss: bool = option(
        False, help="Add minus the path's expected accepted length, sum_k prod_{i<=k} q_i(y_i) per block, over the "
                    "block loss's denominator. Logged as loss_accept.")

    def __post_init__(self) -> None:
        parse_gpus(self.gpus)
        check(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        check(self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}")
        check(self.batch_tokens >= 1, f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        check(0 <= self.warmup_ratio < 1, f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        check(self.clip > 0, f"--clip must be > 0, got {self.clip}")
        check(self.draft_layers >= 1, f"--draft-layers must be >= 1, got {self.draft_layers}")
        check(self.drafter in DRAFTERS, f"--drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        check(1 <= self.conv_kernel_size <= self.block_size,
               f"--conv-kernel-size must be in 1..--block-size ({self.block_size}), got {self.conv_kernel_size}")
        check(self.conv_group_size >= 1, f"--conv-group-size must be >= 1, got {self.conv_group_size}")
        check(self.selector_rank >= 1, f"--selector-rank must be >= 1, got {self.selector_rank}")
        check(self.selector_top_k >= 1, f"--selector-top-k must be >= 1, got {self.selector_top_k}")
        check(self.block_size >= 2, f"--block-size must be >= 2, got {self.block_size}")
        check(self.anchors >= 1, f"--anchors must be >= 1, got {self.anchors}")
        check(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        check(self.val_fraction is None or 0 <= self.val_fraction < 1,
               f"--val-fraction must be auto or in [0, 1), got {self.val_fraction}")
        check(self.val_shards is None or self.val_fraction is None,
               f"--val-shards {self.val_shards} and --val-fraction {self.val_fraction} both choose the held-out "
               "shards; pass one of them")
        check(self.val_shards is None or min(self.val_shards) >= 0,
               f"--val-shards must be shard ids >= 0, got {self.val_shards}")
        check(self.save_every_minutes >= 0, f"--save-every-minutes must be >= 0, got {self.save_every_minutes}")
        check(self.log_every_seconds > 0, f"--log-every-seconds must be > 0, got {self.log_every_seconds}")
        check(self.save_every >= 1, f"--save-every must be >= 1, got {self.save_every}")
        check(self.keep >= 1, f"--keep must be >= 1, got {self.keep}")
        check(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")
        check_cache(self.cache_gb)
        check(self.prefetch_shards >= 1, f"--prefetch-shards must be >= 1, got {self.prefetch_shards}")
        check(
            (self.sliding_window is None) == (self.full_every is None),
            "--sliding-window and --full-every go together (e.g. --sliding-window 2048 --full-every 5)",
        )
        check(self.sliding_window is None or self.sliding_window >= 1, "--sliding-window must be >= 1")
        check(self.full_every is None or self.full_every >= 1, "--full-every must be >= 1")
        check(self.attention in ("auto", "flex", "sdpa"), f"--attention {self.attention!r}: use auto, flex or sdpa")
        check(self.compile_layers in ("auto", "on", "off"),
               f"--compile-layers {self.compile_layers!r}: use auto, on or off")
        check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        check(self.position_weights in POSITION_WEIGHTS,
               f"--position-weights {self.position_weights!r}: use {' or '.join(POSITION_WEIGHTS)}")
        check(0 < self.dpace_alpha <= 1, f"--dpace-alpha must be in (0, 1], got {self.dpace_alpha}")
        check_budgets(self.tree_budgets, "--tree-tau-nodes")
        check(self.tree_loss is None or self.tree_loss >= 1,
               f"--tree-loss-nodes must be a node count >= 1, got {self.tree_loss}")
        check(self.dpace_alpha == DPACE_ALPHA or self.position_weights == "dpace",
               f"--dpace-alpha {self.dpace_alpha} applies to --position-weights dpace only (it is "
               f"{self.position_weights}); drop it or pass --position-weights dpace")
