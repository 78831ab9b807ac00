"""The drafter's side of decoding: the target's layer outputs it drafts from, the Proposer that drafts a block from
them, and teacher-forced drafting over a known answer (what `dflash eval`'s tau_hat measures, set beside the tau that
speculative decoding measures on the same blocks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..drafter.model import DFlashDrafter, draft_logits, draft_tokens
from ..errors import InputError
from .decoded import Decoded

__all__ = ["Proposer", "layer_features", "drafter_proposer", "block_anchors", "decoding_walk", "TeacherForced",
           "teacher_forced"]

# propose(context_features [S, n*H], anchor_id, anchor_pos) -> draft token ids [B-1] for positions anchor_pos+1...
Proposer = Callable[[torch.Tensor, int, int], torch.Tensor]


def layer_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Return [T, n*H]: the outputs of decoder layers layer_ids (hidden_states[i + 1]) of batch row 0, layer-major."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def drafter_proposer(drafter: DFlashDrafter, target: Any, *, logits: bool = False) -> Proposer:
    """Return the Proposer that drafts greedily with a DFlash drafter and the target's own embedding and lm_head
    (argmax per slot; a DFlash 2 drafter's candidate selector path, see `draft_tokens`); with logits=True it
    returns each slot's logits [B-1, V] instead (`draft_logits`: what a tree is built from).

    The context's projection (fc + hidden_norm, one row per token) is kept between calls and only new rows are
    projected: a decoding's context only grows, so re-projecting all of it for every block is waste (measured on
    the 2-core CPU, SmolLM2 shape, 250-token context: 30.7 -> 29.2 ms a block; the 49K-row lm_head dominates).
    The cache is reused only while the context still ends its cached part with the same features row (a new
    prompt, or any other context, starts it again).
    """
    dtype = drafter.fc.weight.dtype
    embed = target.get_input_embeddings().weight.detach().to(dtype)  # once, not per block
    head = target.get_output_embeddings().weight.detach().to(dtype)
    cache: dict[str, torch.Tensor] = {}

    def project(features: torch.Tensor, upto: int) -> torch.Tensor:
        done = cache.get("projected")
        n = 0 if done is None else done.shape[0]
        if n > upto or (n and not torch.equal(features[n - 1], cache["last"])):
            done, n = None, 0
        if done is None or n < upto:
            new = drafter.project_context(features[n:upto].to(dtype))
            done = new if done is None else torch.cat([done, new])
            cache.update(projected=done, last=features[upto - 1].clone() if upto else features[:0])
        return done[:upto]

    @torch.inference_mode()
    def propose(features: torch.Tensor, anchor_id: int, anchor_pos: int) -> torch.Tensor:
        ctx = project(features, min(features.shape[0], int(anchor_pos)))
        return (draft_logits if logits else draft_tokens)(drafter, ctx, anchor_id, embed, head, anchor_pos,
                                                          projected=True)

    return propose


def block_anchors(decoded: Decoded) -> list[int]:
    """Return the index into decoded.tokens of each verified block's anchor: 0, then after each block's gain."""
    out, at = [], 0
    for gained in decoded.accepted:
        out.append(at)
        at += gained
    return out


def decoding_walk(streaks: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """Return (anchors, gains) of the blocks a greedy speculative decoding of an n-token answer takes, given the
    teacher-forced streak at every anchor 0..n-2: each block gains min(1 + streak, tokens left) and the next block
    starts where it ends. Decoding visits hard stretches block by block and crosses easy ones in a few long
    blocks, so the mean of its gains is below the mean over every anchor (tau_hat) even when both agree per anchor.
    """
    anchors, gains, i = [], [], 0
    while i < n - 1:
        g = min(1 + int(streaks[i]), n - 1 - i)
        anchors.append(i)
        gains.append(g)
        i += g
    return anchors, gains


@dataclass
class TeacherForced:
    """Teacher-forced drafting over one decoded answer, at chosen anchors (indices into the answer's tokens).

    streaks[j]: leading drafts equal to the answer's own next tokens at anchor j (slots past the answer's end do
    not count, as in training); gains[j] = min(1 + streaks[j], tokens left after the anchor): what a verification
    at that anchor adds to the answer, since decoding gains no target token beyond the answer's end.
    """

    anchors: list[int]
    streaks: list[int]
    gains: list[int]

    @property
    def tau_hat(self) -> float:
        """Return 1 + mean streak: what `dflash eval` reports, over these anchors (0 if none)."""
        return 1.0 + sum(self.streaks) / len(self.streaks) if self.streaks else 0.0

    @property
    def tau(self) -> float:
        """Return the mean gain: what speculative decoding measures when its blocks start at these anchors."""
        return sum(self.gains) / len(self.gains) if self.gains else 0.0


@torch.inference_mode()
def teacher_forced(target: Any, propose: Proposer, prompt_ids: Sequence[int], tokens: Sequence[int], *,
                   block_size: int, layer_ids: Sequence[int], anchors: Sequence[int] | None = None) -> TeacherForced:
    """Return teacher-forced drafting over the answer `tokens` of a prompt, as `dflash eval` scores a stored one.

    The drafter sees what training gives it: the features of one target forward over prompt + answer without a
    cache (what `extract` stores), and at anchor i (position len(prompt) + i, token tokens[i]) the features of
    the positions before it. anchors: indices into tokens; default every i with a next token (training's
    candidates). With `block_anchors` of a speculative decoding of the same answer, gains are what that decoding
    accepted, block for block, unless the decoding loop hands the drafter something else.
    """
    S, n = len(prompt_ids), len(tokens)
    picked = list(range(n - 1)) if anchors is None else [int(i) for i in anchors]
    if any(not 0 <= i < n for i in picked):
        raise InputError(f"anchors must index the answer's {n} tokens, got {picked}")
    ids = torch.tensor([list(prompt_ids) + list(tokens)], device=target.device)
    out = target(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
    features = layer_features(out.hidden_states, layer_ids)
    streaks, gains = [], []
    for i in picked:
        drafts = propose(features[: S + i], int(tokens[i]), S + i)[: block_size - 1].tolist()
        truth = list(tokens[i + 1: i + block_size])
        streak = next((k for k, (d, t) in enumerate(zip(drafts, truth)) if d != t), min(len(drafts), len(truth)))
        streaks.append(streak)
        gains.append(min(1 + streak, n - 1 - i))
    return TeacherForced(anchors=picked, streaks=streaks, gains=gains)
