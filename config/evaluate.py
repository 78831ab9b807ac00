"""Options of `dflash eval`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import StageConfig
from .options import (DTYPE_CHOICES, cache_dir_option, cache_gb_option, check, check_budgets, check_cache,
                      option, tree_tau_nodes_option)

__all__ = ["EvalConfig"]


@dataclass(frozen=True, kw_only=True)
class EvalConfig(StageConfig):
    """Options of `dflash eval`: a drafter, a store, and which of its shards to score."""

    drafter: str = option(help="Run folder of `dflash train` (its newest checkpoint), one of its checkpoints, or an "
                               "export.")
    store: str | None = option(unless="prompts", help="Feature store made by `dflash extract` (teacher-forced "
                                                       "tau_hat); required unless --prompts.")
    prompts: str | None = option(
        None, help="Instead of a store: a prompt file in any format `dflash generate --prompts` reads (JSONL, JSON "
                   "array, Parquet, .jsonl.gz, text lines...): measured tau by speculative decoding against plain "
                   "greedy decoding, with tau_hat at the anchors decoding used.")
    decode: int = option(128, help="With --prompts: new tokens decoded per prompt.")
    max_prompts: int | None = option(None, help="With --prompts: decode the first N usable prompts only.")
    out: str | None = option(None, help="With --prompts: JSONL of one row per decoded prompt (a rerun resumes).")
    target: str | None = option(None, help="Target folder for embedding/lm_head [default: the run's or the store's].")
    shards: str = option("val", choices=("val", "all"), help="The held-out shards of the run, or every committed one.")
    val_fraction: float | None = option(None, help="Held-out fraction used in training (for an export).")
    batch_tokens: int = option(16384, help="Context tokens per batch (a run's own value is used for a run).")
    anchors: int = option(512, help="Blocks drawn per sample (a run's own value is used for a run).")
    skip_corrupt: bool = option(False, help="Skip (and count) corrupt shards instead of stopping.")
    cache_dir: str | None = cache_dir_option()
    cache_gb: float = cache_gb_option()
    chat_template_kwargs: dict[str, Any] | None = option(
        None, parse="parse_json_object", metavar="JSON",
        help='With --prompts: extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'.')
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Compute dtype (weights stay fp32), as training's validation: auto is bfloat16 on CUDA "
                             "and on CPUs with native bf16, float32 on other CPUs.")
    tree_budgets: tuple[int, ...] = tree_tau_nodes_option(" on the store")
    tree_budget: tuple[int, ...] | None = option(
        None, parse="parse_budgets", metavar="N[,N..]", flag="tree_decode_nodes", aliases=("tree_budget",),
        help="With --prompts: also decode with DDTrees of N nodes (one drafter pass, one target forward over "
             "the tree, greedy) and report tau, target forwards and wall clock beside greedy and the path, per N. "
             "Attention-only targets (Llama, Qwen2, Qwen3).")

    def __post_init__(self) -> None:
        check_cache(self.cache_gb)
        check(self.store is not None or self.prompts is not None,
               "--store is required (teacher-forced tau_hat on its held-out shards), unless --prompts FILE measures "
               "tau by decoding")
        check(self.store is None or self.prompts is None,
               f"--store {self.store} and --prompts {self.prompts}: pass one (a store is scored teacher-forced, "
               "prompts by decoding); run eval twice for both")
        check(self.decode >= 1, f"--decode must be >= 1, got {self.decode}")
        check(self.max_prompts is None or self.max_prompts >= 1, f"--max-prompts must be >= 1, got {self.max_prompts}")
        check(self.shards in ("val", "all"), f"--shards {self.shards!r}: use val or all")
        check(self.val_fraction is None or 0 < self.val_fraction < 1,
               f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        check(self.batch_tokens >= 1, f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        check(self.anchors >= 1, f"--anchors must be >= 1, got {self.anchors}")
        check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        check_budgets(self.tree_budgets, "--tree-tau-nodes")
        check_budgets(self.tree_budget or (), "--tree-decode-nodes")
        check(not self.tree_budget or self.prompts is not None,
               f"--tree-decode-nodes {','.join(map(str, self.tree_budget or ()))} decodes prompts: pass --prompts FILE "
               "(on a store, --tree-tau-nodes reports tree tau teacher-forced)")
