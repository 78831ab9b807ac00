"""Greedy DDTree decoding (arXiv 2604.12989): one drafter pass, a tree of N drafted prefixes, one target forward over
all of them, the walk down the target's own tokens.

Per block, with P tokens committed and the anchor (the newest token, not yet run through the target) at position P:
- the drafter gives each slot's logits once (drafter_proposer(logits=True); for DFlash 2 the unary logits: the
  tree is DDTree's, not the selector's beam) and drafter/tree.build_tree pops the N best prefixes of their
  log-softmax (each slot's top-N tokens are enough);
- the target runs [anchor, node 1..N] in one forward over its static cache (targets/static_kv.StaticTarget): node i goes
  to cache column P+i, takes position P + depth(i) for its rotary embedding, and sees the committed columns, the
  anchor, its ancestors and itself (the ancestor-only mask), so its logits equal those of its path run alone;
- the walk starts at the anchor and moves to the child whose token is the target's argmax there, while one exists;
  the target's argmax at the last node reached is the bonus token. The path's tokens and the bonus are accepted;
- the anchor and the path's nodes keep their keys and values, moved to columns P+1..P+d (their rotary positions
  already are those), and their feature rows join the drafter's context; what the other nodes wrote is never seen
  again (the next block's mask stops at its own columns).
At temperature 0 the output is the target's greedy decoding, token for token (tests/test_tree_decode.py). Trees
are greedy-only here: the sampled walk of the paper is not implemented, so temperature > 0 is refused.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..drafter.model import DFlashDrafter
from ..drafter.tree import ancestor_mask, build_tree
from ..errors import InputError
from ..targets.static_kv import StaticTarget, fast_unsupported
from .decoded import Decoded, cut_at_stop
from .drafting import drafter_proposer

__all__ = ["tree_unsupported", "check_tree", "check_greedy", "TreeDecoder"]


def tree_unsupported(config: Any) -> str | None:
    """Return why a target of this transformers config cannot verify a tree in one forward (None when it can)."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds & {"linear_attention", "mamba", "recurrent"}:
        return ("its recurrent (linear-attention) layers carry one state along the sequence, so a tree's branches "
                "cannot share a forward")
    return fast_unsupported(config)


def check_tree(target: Any, budget: int) -> None:
    """Raise InputError (one line) when this target cannot verify a tree or budget is no tree size."""
    why = tree_unsupported(target.config)
    if why is not None:
        raise InputError(f"--tree-decode-nodes {budget}: this target cannot verify a tree: {why}; decode without "
                         "--tree-decode-nodes")
    if budget < 1:
        raise InputError(f"--tree-decode-nodes must be >= 1 node, got {budget}")


def check_greedy(temperature: float) -> None:
    """Raise InputError (one line) for temperature > 0: trees decode greedily only."""
    if temperature > 0:
        raise InputError(f"--tree-decode-nodes decodes greedily only (temperature 0), got temperature {temperature}; "
                         "drop --tree-decode-nodes to sample with the path")


class TreeDecoder:
    """Greedy DDTree decoding of one target and drafter with trees of `budget` nodes (max_len bounds prompt + new
    tokens). `decode` returns Decoded, as the path decoders do: accepted = tokens gained per verified tree."""

    def __init__(self, target: Any, drafter: DFlashDrafter, *, budget: int, max_len: int) -> None:
        check_tree(target, budget)
        cfg = drafter.config
        self.budget, self.layer_ids = int(budget), list(cfg.target_layer_ids)
        self.device = target.lm_head.weight.device
        self.max_len = max_len + budget + 1
        self.target = StaticTarget(target, max_len=self.max_len, feature_layers=self.layer_ids)
        self.lm_head = target.lm_head
        self.propose = drafter_proposer(drafter, target, logits=True)

    def _verify(self, anchor: int, pos: int, tree: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (the target's argmax after the anchor and after each node [1 + n], feature rows [1 + n, n*H])."""
        n, dev = len(tree), self.device
        ids = torch.tensor([anchor] + tree.tokens, dtype=torch.long, device=dev)
        rope = pos + torch.tensor([0] + tree.depths, dtype=torch.long, device=dev)
        width = pos + 1 + n
        visible = torch.zeros(1 + n, width, dtype=torch.bool)
        visible[:, : pos + 1] = True  # the committed columns and the anchor
        visible[1:, pos + 1:] = ancestor_mask(tree.parents)
        h, feats = self.target.forward(ids, torch.tensor([pos], device=dev), width, features=True, rope_pos=rope,
                                       visible=visible.to(dev))
        return self.lm_head(h).argmax(-1), feats

    def _keep(self, pos: int, path: list[int]) -> None:
        """Move the path's nodes' keys and values (columns pos+1+node) to columns pos+1.. in every layer."""
        if not path:
            return
        src = torch.tensor([pos + 1 + c for c in path], device=self.device)
        dst = torch.arange(pos + 1, pos + 1 + len(path), device=self.device)
        self.target.move(src, dst)

    @torch.inference_mode()
    def decode(self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int] = (),
               temperature: float = 0.0) -> Decoded:
        """Return Decoded of greedy DDTree decoding of one prompt (temperature > 0 is refused: greedy only)."""
        check_greedy(temperature)
        S = len(prompt_ids)
        if not 0 < S or S + max_new_tokens + self.budget + 1 > self.max_len:
            raise InputError(f"a prompt of {S} tokens + {max_new_tokens} new ones does not fit the tree decoder's "
                             f"{self.max_len} columns")
        stops = {int(s) for s in stop_ids}
        dev = self.device
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=dev)
        h, context = self.target.forward(ids, torch.zeros(1, dtype=torch.long, device=dev), S, features=True)
        tokens, done = cut_at_stop([int(self.lm_head(h[-1:]).argmax(-1)[0])], max_new_tokens, stops)
        accepted: list[int] = []
        forwards = 1
        while not done:
            pos = context.shape[0]
            logp = torch.log_softmax(self.propose(context, tokens[-1], pos).float(), -1)
            top = torch.topk(logp, min(self.budget, logp.shape[-1]), dim=-1)
            tree = build_tree(top.values, top.indices, self.budget)
            choice, feats = self._verify(tokens[-1], pos, tree)
            forwards += 1
            children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents,
                                                                                              tree.tokens))}
            picks = choice.tolist()
            path, at = [], -1
            while (at, picks[at + 1]) in children:
                at = children[at, picks[at + 1]]
                path.append(at)
            new = [tree.tokens[c] for c in path] + [picks[at + 1]]
            kept, done = cut_at_stop(tokens + new, max_new_tokens, stops)
            accepted.append(len(kept) - len(tokens))
            tokens = kept
            self._keep(pos, path)
            context = torch.cat([context, feats[[0] + [1 + c for c in path]]])
        return Decoded(tokens=tokens, forwards=forwards, accepted=accepted)

