"""Objectives and metrics for tree verification (DDTree) and for the path's expected accepted length.

Every term works on one batch's counted slots in the [blocks, D] layout (D = B-1) and returns sums; predict divides
them by the block loss's own denominator (objective.loss_denominator), so the learner's global normalisation holds
for them unchanged: 2 ranks equal 1 rank accumulating both, whatever the weights (decay or D-PACE).

The choices, all of them:
- Which slots: a block's prefix of length k counts while slots 1..k all count (inside the sequence and the loss
  mask); the first slot that does not count ends it, as it ends the greedy streak. The tree is built from those
  slots alone (the others take no node): what the metric measures and what the loss raises is the same tree.
- Which distribution: the drafter's own per-slot softmax (for DFlash 2 the unary logits, before the selector), as
  DDTree builds its tree from one pass; its top-K log-probabilities come from the lm_head pass that gives the CE
  (K = the largest budget, which keeps the tree exact).
- Tree loss (`--tree-loss-nodes N`): S_k = sum_{i<=k} log q_i(y_i), the gold prefix's score (differentiable through every
  slot i <= k), tau_N = the N-th best prefix score of the block's tree (best_scores: no gradient, a moving target
  like a hinge's). The prefix of length k is a node of the N-node tree iff S_k >= tau_N; the term is
  sum_k w_k softplus(tau_N - S_k), with w_k the block loss's weight of slot k (decay or D-PACE): a smooth margin,
  about 0 once the prefix is safely inside the tree, slope 1 (per nat) when it is far outside. Weight TREE_WEIGHT.
- Acceptance loss (`--accept-loss`): minus the block's expected accepted length under the path, sum_k prod_{i<=k}
  q_i(y_i) over its counted prefix (the cumulative acceptance probability that online trainers optimise; its
  gradient in log q_i is the unsmoothed D-PACE credit of slot i). Weight ACCEPT_WEIGHT.
- Both add to the block loss (and to DFlash 2's selector loss); metrics.jsonl logs each apart (loss_tree,
  loss_accept: their sums over the same denominator as `loss`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn import functional as F

from ..drafter.tree import best_scores, tree_depths

__all__ = ["TREE_WEIGHT", "ACCEPT_WEIGHT", "TreeTerms", "tree_terms", "slot_grids"]

TREE_WEIGHT = 1.0
ACCEPT_WEIGHT = 1.0


@dataclass
class TreeTerms:
    """One batch's tree and acceptance terms: tree_sum and accept_sum (differentiable, not yet divided by the
    loss denominator; zero when off) and depths [blocks, len(budgets)] (the metric; None when not asked)."""

    tree_sum: torch.Tensor
    accept_sum: torch.Tensor
    depths: torch.Tensor | None


def slot_grids(ce: torch.Tensor, top_logp: torch.Tensor, rows: torch.Tensor,
               counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (gold log-probs [A, D] (differentiable, 0 outside the prefix), top-K log-probs [A, D, K] (-inf at a
    slot outside the prefix), prefix mask [A, D]) from the counted rows' CE [n] and top-K log-probs [n, K]."""
    A, D = counted.shape
    prefix = torch.cumprod(counted.to(torch.int32), 1).bool()
    gold = torch.zeros(A * D, dtype=ce.dtype, device=ce.device).index_copy(0, rows, -ce).view(A, D)
    gold = torch.where(prefix, gold, torch.zeros_like(gold))
    top = torch.full((A * D, top_logp.shape[1]), float("-inf"), dtype=top_logp.dtype, device=top_logp.device)
    top = top.index_copy(0, rows, top_logp.detach()).view(A, D, -1)
    return gold, top.masked_fill(~prefix[..., None], float("-inf")), prefix


def tree_terms(ce: torch.Tensor, top_logp: torch.Tensor, rows: torch.Tensor, counted: torch.Tensor,
               row_w: torch.Tensor, *, tree_budget: int = 0, accept: bool = False,
               budgets: Sequence[int] = ()) -> TreeTerms:
    """Return the TreeTerms of a batch: ce [n] and top_logp [n, K] of its counted rows `rows` (indices into the
    [A, D] layout of `counted`), row_w [n] their block-loss weights; tree_budget N > 0 adds the tree loss, accept the
    acceptance loss, budgets the metric (depth of the gold prefix in trees of those sizes)."""
    gold, top, prefix = slot_grids(ce, top_logp, rows, counted)
    zero = ce.sum() * 0.0  # keeps the dtype, device and graph
    tree_sum, accept_sum, depths = zero, zero, None
    if tree_budget:
        A, D = counted.shape
        w = torch.zeros(A * D, dtype=row_w.dtype, device=row_w.device).index_copy(0, rows, row_w.detach()).view(A, D)
        tau = best_scores(top, tree_budget)[:, tree_budget - 1:tree_budget]  # [A, 1], no gradient
        score = torch.cumsum(gold, 1)
        inside = prefix & torch.isfinite(tau)
        margin = F.softplus(torch.where(inside, tau - score, torch.zeros_like(score)))
        tree_sum = TREE_WEIGHT * (margin * w.to(margin.dtype) * inside).sum()
    if accept:
        reach = torch.exp(torch.cumsum(gold, 1)) * prefix  # prod_{i<=k} q_i over the counted prefix
        accept_sum = -ACCEPT_WEIGHT * reach.sum()
    if budgets:
        depths = tree_depths(top, torch.where(prefix, gold.detach(), torch.full_like(gold, float("-inf"))), budgets)
    return TreeTerms(tree_sum=tree_sum, accept_sum=accept_sum, depths=depths)
