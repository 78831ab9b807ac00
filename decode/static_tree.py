"""Greedy DDTree decoding on static caches: one CUDA graph replay and one host sync per verified tree.

decode/tree.py's TreeDecoder (the eager reference) re-runs the drafter over the whole context, builds the tree in a
Python heap after a host sync, verifies it and syncs again to walk it. Here a block is one fixed sequence of kernels
(`StaticTreeDecoder._tree`), with P tokens committed and the anchor at position P:
- the drafter over its cached context keys and values (StaticDrafter.logits; for DFlash 2 the unary logits, as
  TreeDecoder builds its tree from) gives each slot's log-softmax and its top-N tokens;
- drafter/tree.device_tree picks the N best prefixes (build_tree's nodes, ties aside) level by level with fixed
  shapes, ordered by depth so that a parent comes before its children, and drafter/tree.ancestor_mask builds their
  ancestor-only mask by pointer doubling;
- the target verifies [anchor, node 1..N] in one forward over StaticTarget: node i at cache column P+1+i, rotary
  position P + depth, seeing the committed columns, the anchor, its ancestors and itself, over a width bucket;
- the walk, without a loop: a node is accepted iff its token and every ancestor's equal the target's argmax after
  their parents (siblings hold distinct tokens, so the accepted nodes form one path); the target's argmax after the
  path's last node is the bonus token;
- the path's keys and values move to columns P+1.. in every layer (their rotary positions already are those), the
  feature rows of the anchor and the path join the drafter's cache at P.., and the path's tokens and the bonus go to
  the output buffer (rows past the path are filler, never read before they are overwritten).
On CUDA `_tree` is captured once per cache-width bucket (decode/static.StaticLoop) and replayed; the host reads one
pair of numbers per tree (accepted count, stop token seen) to pick the next bucket and to stop. Elsewhere the same
code runs eagerly. The output is the target's greedy decoding and the accepted lengths are TreeDecoder's
(tests/test_tree_decode.py). Greedy only, like TreeDecoder.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from ..drafter.model import DFlashDrafter
from ..drafter.tree import ancestor_mask, device_tree, level_pairs
from .decoded import Decoded
from .static import StaticLoop, static_unsupported
from .tree import TreeDecoder, check_greedy, check_tree

__all__ = ["StaticTreeDecoder", "tree_decoders"]

log = logging.getLogger(__name__)


class StaticTreeDecoder(StaticLoop):
    """Greedy DDTree decoding of one target and drafter with trees of `budget` nodes on static caches (max_len bounds
    prompt + new tokens). The tree graphs for every width bucket are captured here, on CUDA, and serve every prompt.
    `decode` returns Decoded, as TreeDecoder does: accepted = tokens gained per verified tree."""

    def __init__(self, target: Any, drafter: DFlashDrafter, *, budget: int, max_len: int,
                 cuda_graphs: bool | None = None) -> None:
        check_tree(target, budget)
        B = drafter.config.block_size
        # Room for the last tree's N node columns and for the B rows a block writes past its anchor.
        super().__init__(target, drafter, max_len=max_len, room=max(budget, B) + 1, cuda_graphs=cuda_graphs)
        self.budget = int(budget)
        self.top_k = min(self.budget, target.get_output_embeddings().weight.shape[0])
        self.pairs = level_pairs(self.budget, self.top_k, self.device)  # on the device before any capture
        self.nodes = torch.arange(self.budget, device=self.device)
        self.path = torch.full((B,), self.budget, dtype=torch.long, device=self.device)
        if self.graphs:
            self._capture_all()

    def _kinds(self) -> dict[str, Callable[[int], None]]:
        return {"tree": self._tree}

    def _tree(self, width: int) -> None:
        """Draft, build, verify and walk one tree, all in place on device tensors (CUDA-graph safe)."""
        N, D, pos = self.budget, self.B - 1, self.pos
        _, logits = self.drafter.logits(self.tok, pos, width)
        top = torch.topk(torch.log_softmax(logits.float(), -1), self.top_k, dim=-1)
        tokens, parents, depths = device_tree(top.values, top.indices, N, self.pairs)
        seen = ancestor_mask(parents, D)  # [N, N]
        node = self.target.cols[:width] - (pos + 1)  # the node each cache column holds (< 0: committed, anchor)
        done = (node < 0)[None]
        nodes_see = done | (seen[:, node.clamp(0, N - 1)] & (node < N)[None])
        h, feats = self.target.forward(torch.cat([self.tok, tokens.clamp(min=0)]), pos, width, features=True,
                                       rope_pos=pos + torch.cat([self.tok.new_zeros(1), depths]),
                                       visible=torch.cat([done, nodes_see]))
        choice = self.lm_head(h).argmax(-1)  # choice[r]: the target's token after verify row r (0: the anchor)
        right = tokens == choice[parents + 1]
        good = (~seen | right[None, :]).all(1)  # the node and all its ancestors match: on the accepted path
        n_ok = good.sum()
        # Path rows in depth order (nodes are sorted by depth), then filler rows (the last node's).
        place = torch.where(good, good.cumsum(0) - 1, D)
        path = self.path.fill_(N).scatter(0, place, self.nodes)[:D]
        rows = torch.cat([self.tok.new_zeros(1), path + 1]).clamp(max=N)
        self.target.move(pos + rows[1:], pos + 1 + self.slots[:D])
        self.drafter.add_context(feats[rows], pos)
        self._advance(choice[rows], n_ok)

    @torch.inference_mode()
    def decode(self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int] = (),
               temperature: float = 0.0) -> Decoded:
        """Return Decoded of greedy DDTree decoding of one prompt (temperature > 0 is refused: greedy only)."""
        check_greedy(temperature)
        return self._blocks("tree", self.budget + 1, prompt_ids, max_new_tokens, stop_ids)


def tree_decoders(target: Any, drafter: DFlashDrafter, budgets: Sequence[int], prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: int) -> dict[int, Any]:
    """Return {budget: tree decoder} sized for these prompts (none for no budgets or no prompts): on CUDA the
    StaticTreeDecoder (CUDA graphs, one host sync per tree) when the static machinery runs
    this target and drafter, else the eager TreeDecoder (on a CPU, where graphs save nothing, too; logged)."""
    if not prompts:
        return {}
    longest = max(len(p) for p in prompts) + max_new_tokens
    why = "not on CUDA" if target.lm_head.weight.device.type != "cuda" else static_unsupported(target, drafter)
    if why is not None and budgets:
        log.info("tree decoding: eager TreeDecoder (%s)", why)
    kind = TreeDecoder if why is not None else StaticTreeDecoder
    return {int(n): kind(target, drafter, budget=int(n), max_len=longest) for n in budgets}
