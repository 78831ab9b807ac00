"""DDTree (arXiv 2604.12989) over one drafter pass: the N best prefixes of a block's slots, and how deep a tree of
N nodes reaches along a gold continuation.

A drafter pass gives each slot d = 1..D (D = B-1) a distribution over tokens that does not depend on the tokens
drafted at the other slots. A prefix (t_1..t_d) scores sum_{i<=d} log p_i(t_i). The heap starts with the rank-0
token of slot 1; each pop adds the popped prefix to the tree as a node and pushes its next-ranked sibling and its
rank-0 child. No prefix scores above its parent, so N pops give the N best prefixes, ancestors included: a tree of N
nodes (the anchor is its root and not a node).

`build_tree` is that heap, as the eager tree decoder runs it once per block; `device_tree` builds the same nodes
with fixed shapes on the device (the static tree decoder's CUDA graph), and `ancestor_mask` their attention mask.
`best_scores` gives the same N best scores for many
blocks at once without a heap (the metric and the tree loss of training), and `tree_depths` the depth of the longest
gold prefix inside each block's tree: the tree accepts 1 + that depth tokens, teacher-forced. Ties between scores
are broken differently by the two (the heap: first pushed first), which only matters for exactly equal sums.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

__all__ = ["Tree", "build_tree", "best_scores", "tree_depths", "chain_best_scores", "prefix_levels", "level_pairs",
           "device_tree", "ancestor_mask", "TREE_BUDGETS"]

TREE_BUDGETS = (8, 16, 32, 64)  # the budgets the metric reports by default: DDTree's range


@dataclass
class Tree:
    """A tree of drafted tokens in pop order: node i holds tokens[i] at slot depths[i] (1-based), its parent node
    parents[i] (-1: the anchor) and its prefix's score scores[i]. A parent always comes before its children."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)


def build_tree(logp: torch.Tensor, ids: torch.Tensor, budget: int) -> Tree:
    """Return the tree of the `budget` best prefixes of one block: logp [D, K] each slot's top-K log-probabilities,
    largest first (-inf: that slot takes no node, nor anything deeper), ids [D, K] their tokens.

    K >= budget keeps the tree exact: a token of rank >= budget has `budget` better siblings in front of it."""
    lp, tok = logp.double().tolist(), ids.tolist()
    D, K = len(lp), len(lp[0]) if lp else 0
    tree = Tree([], [], [], [])
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, push order, slot, rank, parent node)
    order = 0

    def push(score: float, slot: int, rank: int, parent: int) -> None:
        nonlocal order
        if score > float("-inf"):
            heapq.heappush(heap, (-score, order, slot, rank, parent))
            order += 1

    if D and K:
        push(lp[0][0], 0, 0, -1)
    while heap and len(tree) < budget:
        neg, _, slot, rank, parent = heapq.heappop(heap)
        node, score = len(tree), -neg
        tree.tokens.append(int(tok[slot][rank]))
        tree.parents.append(parent)
        tree.depths.append(slot + 1)
        tree.scores.append(score)
        if rank + 1 < K:
            push(score - lp[slot][rank] + lp[slot][rank + 1], slot, rank + 1, parent)
        if slot + 1 < D:
            push(score + lp[slot + 1][0], slot + 1, 0, node)
    return tree


@lru_cache(maxsize=None)
def _pairs(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the (parent rank i, token rank j) pairs with (i + 1)(j + 1) <= n: any other pair has at least n pairs
    scoring at least as high (every i' <= i with every j' <= j), so it cannot be among the n best."""
    pi, pj = zip(*[(i, j) for i in range(n) for j in range(min(k, n // (i + 1)))])
    return torch.tensor(pi), torch.tensor(pj)


def level_pairs(budget: int, k: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `prefix_levels`' candidate pairs for `budget` prefixes and top-k slots, on device (a CUDA graph must
    find them there: it cannot copy from the host)."""
    return tuple(t.to(device) for t in _pairs(budget, k))  # type: ignore[return-value]


def prefix_levels(logp: torch.Tensor, budget: int,
                  pairs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (scores, parents, ranks), each [A, D, budget]: per block and prefix length d (slot d-1), its `budget`
    best prefixes of that length, largest score first (-inf past the prefixes there are): their scores, the index of
    their parent among the length d-1 ones (0 at d = 1) and their last token's rank in that slot's top-K, for logp
    [A, D, K] each slot's top-K log-probabilities, largest first, and pairs = level_pairs(budget, K).

    Level by level: the best `budget` prefixes of length d are among the extensions of the best `budget` of length
    d-1 by the slot's top tokens (no prefix scores above its parent), and the `budget` best prefixes of the whole
    tree (DDTree's heap) are the `budget` best of all levels together. About budget * ln(budget) candidate sums per
    block and level, in a few batched ops of fixed shapes, no host sync. Not differentiable."""
    with torch.no_grad():
        A, D, K = logp.shape
        lp = logp.detach().to(torch.promote_types(logp.dtype, torch.float32))
        n = budget
        pad = torch.full((A, max(0, n - K)), float("-inf"), dtype=lp.dtype, device=lp.device)
        level = torch.cat([lp[:, 0, :n], pad], 1)  # [A, n] sorted
        rank = torch.arange(n, device=lp.device).clamp(max=K - 1).expand(A, n)
        pi, pj = pairs
        scores, parents, ranks = [level], [torch.zeros_like(rank)], [rank]
        for d in range(1, D):
            best = torch.topk(level[:, pi] + lp[:, d, pj], n, dim=1)
            level = best.values
            scores.append(level)
            parents.append(pi[best.indices])
            ranks.append(pj[best.indices])
        return torch.stack(scores, 1), torch.stack(parents, 1), torch.stack(ranks, 1)


def best_scores(logp: torch.Tensor, budget: int) -> torch.Tensor:
    """Return [A, budget]: the scores of each block's `budget` best prefixes, largest first (-inf past the prefixes
    there are), for logp [A, D, K] each slot's top-K log-probabilities, largest first (`prefix_levels`). Not
    differentiable."""
    scores, _, _ = prefix_levels(logp, budget, level_pairs(budget, logp.shape[2], logp.device))
    return torch.topk(scores.flatten(1), budget, dim=1).values


def tree_depths(logp: torch.Tensor, gold: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
    """Return [A, len(budgets)] long: the depth of the longest gold prefix inside each block's tree of N nodes, for
    logp [A, D, K] (as best_scores), gold [A, D] the gold token's log-probability at each slot (-inf at a slot that
    does not count, which ends the prefix) and N in budgets (K >= max(budgets) keeps it exact).

    The gold prefix of length d is a node iff its score S_d = sum_{i<=d} gold_i is at least the N-th best score;
    S_d never grows with d, so the depth is how many d pass."""
    best = best_scores(logp, max(budgets))
    with torch.no_grad():
        s = torch.cumsum(gold.detach().to(best.dtype), 1)  # -inf from the first slot that does not count
        out = [((s >= best[:, n - 1:n]) & torch.isfinite(s)).sum(1) for n in budgets]
        return torch.stack(out, 1)


def chain_best_scores(first: torch.Tensor, trans: torch.Tensor, budget: int) -> torch.Tensor:
    """Return [A, budget]: the best prefix scores, largest first, of trees whose slot distributions depend on the
    token before (DFlash 2's selector tree): first [A, K] slot 1's log-probabilities over its K candidates, trans
    [A, D-1, K, K] slot d+1's over its candidates given the candidate (index) taken at slot d. -inf: no such node.

    The tree's N best prefixes are closed under taking the parent, so its nodes of length d are among the
    extensions of the N best of length d-1 (all K of them here, the scores not being separable). Not
    differentiable."""
    with torch.no_grad():
        A, K = first.shape
        n = budget
        acc = torch.promote_types(first.dtype, torch.float32)
        top = torch.topk(first.to(acc), min(n, K), dim=1)
        pad = torch.full((A, n - top.values.shape[1]), float("-inf"), dtype=acc, device=first.device)
        score = torch.cat([top.values, pad], 1)
        last = torch.cat([top.indices, torch.zeros_like(pad, dtype=torch.long)], 1)  # candidate index of each prefix
        found = [score]
        for d in range(trans.shape[1]):
            step = trans[:, d].to(acc).gather(1, last[..., None].expand(A, n, K))  # [A, n, K]
            best = torch.topk((score[..., None] + step).reshape(A, n * K), n, dim=1)
            score, last = best.values, best.indices % K
            found.append(score)
        return torch.topk(torch.cat(found, 1), n, dim=1).values


def device_tree(logp: torch.Tensor, ids: torch.Tensor, budget: int,
                pairs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (tokens, parents, depths), each [budget] long: `build_tree`'s nodes (ties aside) built on the device
    with fixed shapes and no host sync (what a CUDA graph can hold), for one block's logp [D, K] and ids [D, K] as
    build_tree takes them and pairs = level_pairs(budget, K).

    The nodes are the `budget` best of `prefix_levels`' candidates, ordered by depth, then by score (largest first):
    a parent always comes before its children. A node that is no prefix (score -inf: fewer prefixes than budget) or
    whose parent was not kept (an exact tie between a parent and its child) gets token -1, which no walk follows."""
    D = logp.shape[0]
    n = budget
    scores, parents, ranks = (t.reshape(D * n) for t in prefix_levels(logp[None], n, pairs))
    chosen = torch.topk(scores, n).indices.sort().values  # flat index = level * n + place: depth, then score
    level = chosen // n
    tokens = ids[level, ranks[chosen]]
    node_of = torch.full((D * n,), -1, dtype=torch.long, device=logp.device)
    node_of.index_copy_(0, chosen, torch.arange(n, device=logp.device))
    parent = torch.where(level > 0, node_of[((level - 1) * n + parents[chosen]).clamp(min=0)], -1)
    kept = torch.isfinite(scores[chosen]) & ((level == 0) | (parent >= 0))
    return torch.where(kept, tokens, -1), parent, level + 1


def ancestor_mask(parents: torch.Tensor | Sequence[int], max_depth: int | None = None) -> torch.Tensor:
    """Return [n, n] bool: node i sees node j iff j is i or one of its ancestors (parents[i] < i, -1: the root), by
    pointer doubling: "self or parent" squared ceil(log2(max_depth)) times (max_depth bounds a node's depth,
    default n). Fixed shapes on the device of parents: no host sync."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    n = parents.shape[0]
    idx = torch.arange(n, device=parents.device)
    seen = (idx[None, :] == idx[:, None]) | (idx[None, :] == parents[:, None])
    for _ in range(max(0, ((max_depth or n) - 1).bit_length())):
        step = seen.float()
        seen = (step @ step) > 0
    return seen
