"""`dflash demo`: the whole recipe on the embedded SmolLM2 target, ending in a measured acceptance length.

Stages: convert the target -> answer the bundled prompts with it -> extract the whole store -> train a small drafter
(some shards held out) -> tau_hat on the held-out shards -> export -> speculative decoding of the held-out prompts
against plain greedy decoding -> the final table (printed, and written as OUT/summary.json) and the training curve.
Every stage is resumable on its own (generate, extract and train resume themselves; decoding appends one line per
prompt), and OUT/demo-state.json records the finished stages, so a rerun after an interruption continues.
"""
from __future__ import annotations

from .budgets import BUDGETS, SMOLLM2_MASK_TOKEN, Budget
from .decoding import data_numerics, decode_prompts
from .recipe import run
from .stages import extract_config, train_config
from .table import format_table

__all__ = ["Budget", "BUDGETS", "SMOLLM2_MASK_TOKEN", "run", "format_table", "extract_config", "train_config",
           "data_numerics", "decode_prompts"]
