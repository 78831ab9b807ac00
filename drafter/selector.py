"""DFlash 2's candidate selector: the drafter's top-K tokens of each slot rescored with a predecessor term, chosen
along the block left to right.

score(slot i, candidate c | predecessor p) = unary_i(c) + <P[p] * (W h_i), S[c]>, with unary_i the drafter's own
(transformed) logits, h_i the slot's final hidden state, W = `hidden_projection` [r, H], P = `predecessor_codebook`
and S = `successor_codebook` [V, r] (bare parameters: exported without `.weight`). The predecessor of slot 1 is the
anchor; of a later slot, the token chosen at the slot before it (in training: the gold previous token).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CandidateSelector"]


class CandidateSelector(nn.Module):
    """The low-rank predecessor-successor scorer over each slot's top-K candidates."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Initialise as SpecForge's DFlash 2 trainer does: successor codebook 0, so a fresh selector picks exactly
        the drafter's argmax (the pair term is 0) and learns from there; predecessor codebook N(0, std)."""
        self.predecessor_codebook.normal_(0.0, std)
        self.successor_codebook.zero_()
        self.hidden_projection.weight.normal_(0.0, std)

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """Return the scores [N, K] (fp32 or wider) of candidates [N, K] given slot states hidden [N, H], their unary
        logits [N, K] and each slot's predecessor token [N]."""
        # F.embedding, not indexing: its backward sums repeated rows in a fixed order, so a step is reproducible
        # whatever the threads (indexing's accumulate changed the 7th digit of a resumed run's losses).
        state = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)  # [N, r]
        pair = torch.einsum("nr,nkr->nk", state, F.embedding(candidates, self.successor_codebook).to(state.dtype))
        acc = torch.promote_types(unary.dtype, torch.float32)
        return unary.to(acc) + pair.to(acc)

    @torch.no_grad()
    def path(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int | torch.Tensor) -> torch.Tensor:
        """Return the greedy path [S] through one block's slots: hidden [S, H] and unary logits [S, V] of slots
        1..S, each slot's pick conditioned on the pick before it (the anchor before slot 1: an int, or a one-element
        tensor on the logits' device, which keeps the path free of host copies for a CUDA graph).

        A slot's predecessor is one of the previous slot's K candidates, so the scores of every (previous candidate,
        candidate) pair of every slot are formed at once ([S-1, K, K] tables); the walk left to right is then a
        gather and an argmax per slot (a block of decoding was dominated by the per-slot scoring's small kernels).
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)  # [S, K]
        if isinstance(anchor_id, torch.Tensor):
            anchor = anchor_id.reshape(1).long()
        else:
            anchor = torch.tensor([int(anchor_id)], device=logits.device)
        acc = torch.promote_types(unary.dtype, torch.float32)
        # The dtype `scores` computes the pair term in: the codebook's and the projection's, promoted.
        state = self.hidden_projection(hidden)
        state = state.to(torch.promote_types(state.dtype, self.predecessor_codebook.dtype))  # [S, r]
        successors = F.embedding(candidates, self.successor_codebook).to(state.dtype)  # [S, K, r]
        first = F.embedding(anchor, self.predecessor_codebook).to(state.dtype) * state[:1]  # [1, r]
        score = unary[0].to(acc) + torch.einsum("nr,kr->k", first, successors[0]).to(acc)
        pick = score.argmax(-1, keepdim=True)  # index into the slot's candidates
        picks = [pick]
        if hidden.shape[0] > 1:
            before = F.embedding(candidates[:-1], self.predecessor_codebook).to(state.dtype) * state[1:, None]
            tables = unary[1:, None, :].to(acc) + torch.bmm(before, successors[1:].transpose(1, 2)).to(acc)
            for i in range(tables.shape[0]):
                pick = tables[i].index_select(0, pick).argmax(-1)
                picks.append(pick)
        return candidates.gather(1, torch.stack(picks).view(-1, 1))[:, 0]
