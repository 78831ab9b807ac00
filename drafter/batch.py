"""The drafter's input layout: several sequences packed into one batch of context features and blocks."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["PackedBatch"]


@dataclass(frozen=True)
class PackedBatch:
    """Several sequences packed for one drafter step (A blocks of B slots over N context tokens).

    features [N, n*H]: context features, sequences concatenated, each cut after its last anchor's context;
    ctx_pos [N], ctx_seq [N]: position in its sequence and sequence index of each context token;
    cu_ctx [S+1], cu_blocks [S+1]: offsets of each sequence's context tokens and blocks;
    block_ids [A, B]: anchor token then mask tokens; anchor_pos [A], block_seq [A];
    labels [A, B]: data token at anchor + k (0 where out of range); weights [A, B]: decay weight where the label
    is in the sequence and in its loss mask, else 0 (slot 0 always 0).
    """

    features: torch.Tensor
    ctx_pos: torch.Tensor
    ctx_seq: torch.Tensor
    cu_ctx: torch.Tensor
    block_ids: torch.Tensor
    anchor_pos: torch.Tensor
    block_seq: torch.Tensor
    cu_blocks: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor

    @property
    def block_size(self) -> int:
        """Return B."""
        return self.block_ids.shape[1]

    @property
    def num_blocks(self) -> int:
        """Return A, the number of blocks (anchors) in the batch."""
        return self.block_ids.shape[0]

    @property
    def block_pos(self) -> torch.Tensor:
        """Return the position ids [A, B] of every block slot: anchor + k."""
        return self.anchor_pos[:, None] + torch.arange(self.block_size, device=self.anchor_pos.device)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """Return the batch with every tensor on device."""
        return PackedBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})
