"""The DFlash 2 selector's training loss: a K-way cross-entropy over each slot's candidates, teacher-forced.

What the trainers do (SpecForge PR #772, vLLM speculators #1006), and the choices taken here:
- Candidates: the drafter's top-K (transformed) logits of the slot, as serving takes them. When the gold token is
  missing, it replaces the weakest candidate (rank K), so every counted slot has a K-way label (speculators; PR
  #772 "inserts the gold token"). SpecForge's later default drops such slots from the selector loss instead; we do
  not, so the selector loss covers exactly the slots the block loss covers, with the same weights.
- Scores: unary logit + the low-rank pair term with the teacher-forced predecessor: the gold previous token (the
  anchor for slot 1), as both trainers do.
- Weights and normalisation: each slot's selector CE carries the block loss's own weight (`scale` = w_k / sum w,
  the same per-position weights, decay or D-PACE), so total = (sum w CE_block + SELECTOR_WEIGHT * sum w CE_sel) /
  sum w: SpecForge's shared denominator, speculators' decay-weighted mass. The weights come from the block loss
  alone, so a top-K miss changes no position's weight.
- SELECTOR_WEIGHT (alpha) is 1.0, both trainers' default. The selector's gradient reaches the drafter (unary logits
  and hidden states): SpecForge's default (its stop-gradient switch is off by default).
Metrics use serving's rule: the selector's pick among the strict top-K; with gold predecessors the leading run of
right picks is exactly the run a self-conditioned path would accept, so its streak gives the selector's tau_hat.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn import functional as F

from ..drafter.linear_ce import candidate_logits
from ..drafter.config import DrafterConfig
from ..drafter.model import unary_logits
from ..drafter.selector import CandidateSelector

__all__ = ["SELECTOR_WEIGHT", "SelectorTerms", "training_candidates", "selector_loss", "selector_tree_depths"]

SELECTOR_WEIGHT = 1.0


@dataclass
class SelectorTerms:
    """The selector's part of one batch: loss (differentiable, already normalised like the block loss), and per
    counted slot its CE (detached), whether the serving pick is the gold token (correct) and whether the gold token
    is in the top-K (covered)."""

    loss: torch.Tensor
    ce: torch.Tensor
    correct: torch.Tensor
    covered: torch.Tensor


def training_candidates(candidates: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (training candidates [N, K], index of the gold token in them [N], gold in the top-K [N]).

    candidates [N, K] are sorted largest logit first; a missing gold token takes the last (weakest) place.
    """
    K = candidates.shape[1]
    hit = candidates == labels[:, None]
    covered = hit.any(-1)
    train = candidates.clone()
    train[:, -1] = torch.where(covered, candidates[:, -1], labels)
    return train, torch.where(covered, hit.int().argmax(-1), K - 1), covered


def selector_loss(selector: CandidateSelector, cfg: DrafterConfig, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                  candidates: torch.Tensor, labels: torch.Tensor, predecessors: torch.Tensor,
                  scale: torch.Tensor) -> SelectorTerms:
    """Return the SelectorTerms of counted slots: hidden [N, H] (the drafter's final states), their top-K candidates
    [N, K] (largest first), gold labels [N], gold previous tokens [N] and per-slot weights scale [N] (w / sum w)."""
    K = candidates.shape[1]
    # K + 1 columns: the strict top-K (serving's candidate set, for the metrics) and the gold token (the training
    # set's last candidate when it is missing); scoring one extra column is cheaper than scoring twice.
    both = torch.cat([candidates, labels[:, None]], 1)
    raw = candidate_logits(hidden, lm_head_weight, both)
    unary = unary_logits(cfg, raw.to(torch.promote_types(raw.dtype, torch.float32)))  # fp32 at least, fp64 stays
    scores = selector.scores(hidden, unary, both, predecessors)
    _, target, covered = training_candidates(candidates, labels)
    train = torch.where(covered[:, None], scores[:, :K], torch.cat([scores[:, :K - 1], scores[:, K:]], 1))
    ce = F.cross_entropy(train, target, reduction="none")
    loss = SELECTOR_WEIGHT * (ce * scale.to(ce.dtype)).sum()
    with torch.no_grad():
        pick = candidates.gather(1, scores[:, :K].argmax(-1, keepdim=True))[:, 0]
    return SelectorTerms(loss=loss, ce=ce.detach(), correct=pick == labels, covered=covered)


def selector_tree_depths(selector: CandidateSelector, cfg: DrafterConfig, hidden: torch.Tensor,
                         lm_head_weight: torch.Tensor, candidates: torch.Tensor, rows: torch.Tensor,
                         counted: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                         budgets: Sequence[int], blocks_per_chunk: int = 512) -> torch.Tensor:
    """Return [A, len(budgets)] long: the depth of the gold prefix inside the selector's tree of N nodes (SGLang's
    DFlash 2 beam tree, #36196), teacher-forced: a node's children are its slot's top-K candidates, scored by the
    log-softmax over those K of the selector's scores given the node's own token (the anchor before slot 1); a
    prefix scores the sum along it; the tree is the N best prefixes. hidden [n, H] and candidates [n, K] (largest
    logit first) are the counted rows `rows` of the [A, D] layout `counted`; anchors [A] the blocks' anchor tokens,
    labels [A, D] the gold tokens. The gold prefix ends where a slot does not count or its gold token is not among
    the slot's K candidates."""
    from ..drafter.tree import chain_best_scores

    A, D = counted.shape
    K = candidates.shape[1]
    out = torch.zeros(A, len(budgets), dtype=torch.long, device=counted.device)
    with torch.no_grad():
        unary = unary_logits(cfg, candidate_logits(hidden, lm_head_weight, candidates).float())
        state = selector.hidden_projection(hidden).float()
        grid = {"unary": torch.full((A * D, K), float("-inf"), device=hidden.device),
                "state": torch.zeros(A * D, state.shape[1], device=hidden.device),
                "cand": torch.zeros(A * D, K, dtype=torch.long, device=hidden.device)}
        for name, value in (("unary", unary), ("state", state), ("cand", candidates)):
            grid[name][rows] = value.to(grid[name].dtype)
        prefix = torch.cumprod(counted.to(torch.int32), 1).bool()
        P, S = selector.predecessor_codebook.float(), selector.successor_codebook.float()
        for a0 in range(0, A, blocks_per_chunk):
            a1 = min(A, a0 + blocks_per_chunk)
            un, st, ca = (grid[k].view(A, D, -1)[a0:a1] for k in ("unary", "state", "cand"))
            succ = F.embedding(ca, S)  # [a, D, K, r]
            first = un[:, 0] + torch.einsum("ar,akr->ak", F.embedding(anchors[a0:a1], P) * st[:, 0], succ[:, 0])
            before = F.embedding(ca[:, :-1], P) * st[:, 1:, None]  # [a, D-1, K, r]: each candidate of the slot before
            trans = un[:, 1:, None, :] + torch.einsum("adjr,adkr->adjk", before, succ[:, 1:])
            live = prefix[a0:a1]
            first = torch.where(live[:, :1], first.log_softmax(-1), torch.full_like(first, float("-inf")))
            trans = torch.where(live[:, 1:, None, None], trans.log_softmax(-1), torch.full_like(trans, float("-inf")))
            best = chain_best_scores(first, trans, max(budgets))
            hit = ca == labels[a0:a1, :, None]
            covered = hit.any(-1) & live
            g = hit.int().argmax(-1)  # the gold token's candidate index at each slot
            gold = torch.cat([first.gather(1, g[:, :1]),
                              trans.gather(3, g[:, 1:, None, None].expand(-1, -1, K, 1))[..., 0]
                                   .gather(2, g[:, :-1, None])[..., 0]], 1)
            s = torch.cumsum(torch.where(torch.cumprod(covered.int(), 1).bool(), gold,
                                         torch.full_like(gold, float("-inf"))), 1)
            for j, n in enumerate(budgets):
                out[a0:a1, j] = ((s >= best[:, n - 1:n]) & torch.isfinite(s)).sum(1)
    return out
