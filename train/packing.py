"""A step's batch for the DFlash objective: anchors sampled per sequence, blocks packed with their labels and decay
weights.

A batch packs several sequences: the context features of all of them concatenated (with `cu_ctx` offsets), and
all their blocks (anchor token, then B-1 mask tokens) one after another. `drafter/attention.py` turns the index
tensors into the mask; objective.py runs the drafter on it and takes the loss.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..drafter.batch import PackedBatch
from ..errors import InputError
from ..facts import decay_gamma

__all__ = ["max_blocks_for", "batch_capacity", "block_quotas", "sample_anchors", "decay_weights", "pack_batch"]

# Blocks a batch may hold per token of its budget. The reference's 512 anchors on 4,096-token sequences is 1/8;
# short sequences would otherwise each take up to --anchors blocks, and a 16K-token batch of 200-token answers
# asked for ~15K blocks of 16 slots (an H200 ran out of memory). 1/4 leaves the reference shape uncut.
BLOCKS_PER_BATCH_TOKEN = 0.25


def max_blocks_for(batch_tokens: int) -> int:
    """Return the most blocks (anchors) one batch of `batch_tokens` tokens may hold."""
    return max(1, int(batch_tokens * BLOCKS_PER_BATCH_TOKEN))


def batch_capacity(batch_tokens: int) -> tuple[int, int]:
    """Return (context tokens, blocks) that no batch of `batch_tokens` exceeds: the fixed attention shape."""
    return batch_tokens, max_blocks_for(batch_tokens)


def _candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    m = loss_mask.to(torch.bool).cpu()
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False)[:, 0]


def block_quotas(candidates: Sequence[int], max_anchors: int, max_blocks: int | None) -> list[int]:
    """Return the anchors to draw from each sequence: min(max_anchors, candidates), all scaled down alike (largest
    remainders first, then the earlier sequence) when their sum exceeds max_blocks."""
    quota = [min(max_anchors, int(c)) for c in candidates]
    total = sum(quota)
    if max_blocks is None or total <= max_blocks:
        return quota
    exact = [q * max_blocks / total for q in quota]
    out = [int(x) for x in exact]
    spare = max_blocks - sum(out)
    for i in sorted(range(len(out)), key=lambda i: (out[i] - exact[i], i))[:spare]:
        out[i] += 1
    return out


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Return sorted anchor positions: up to max_anchors, without replacement, among p with mask[p] and mask[p+1]."""
    return _pick(_candidates(loss_mask), max_anchors, generator)


def _pick(candidates: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        candidates = candidates[pick]
    return torch.sort(candidates).values


def decay_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Return the per-slot loss weights [B]: 0 for slot 0 (the anchor), exp(-(k-1)/gamma) for slot k >= 1."""
    g = decay_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / g)
    w[0] = 0.0
    return w.float()


def pack_batch(
    sequences: Sequence[Mapping[str, Any]],
    *,
    block_size: int,
    mask_token_id: int,
    max_anchors: int = 512,
    max_blocks: int | None = None,
    seed: int = 0,
    gamma: float | None = None,
) -> PackedBatch:
    """Return one PackedBatch of sequences (each a mapping with input_ids [T], loss_mask [T], features [T, n, H]).

    Each sequence gives up to max_anchors blocks, and the batch at most max_blocks (see block_quotas). Anchors are
    drawn by a generator seeded with `seed`, sequence after sequence, so the batch is a pure function of
    (sequences, seed). Tensors stay on the device of the inputs' features.
    """
    gen = torch.Generator().manual_seed(int(seed))
    candidates = [_candidates(torch.as_tensor(q["loss_mask"])) for q in sequences]
    quotas = block_quotas([c.numel() for c in candidates], max_anchors, max_blocks)
    decay = decay_weights(block_size, gamma)
    feats, ctx_pos, ctx_seq, ids, anchors, bseq, labels, weights = [], [], [], [], [], [], [], []
    cu_ctx, cu_blocks = [0], [0]
    k = torch.arange(block_size)
    for s, seq in enumerate(sequences):
        input_ids = torch.as_tensor(seq["input_ids"]).long().cpu()
        loss_mask = torch.as_tensor(seq["loss_mask"]).bool().cpu()
        f = seq["features"]
        T = input_ids.shape[0]
        if loss_mask.shape[0] != T or f.shape[0] != T:
            raise InputError(
                f"sequence {s} of the batch: input_ids has {T} tokens but loss_mask has {loss_mask.shape[0]} and "
                f"features {f.shape[0]}; the store is inconsistent, run `dflash verify STORE`"
            )
        a = _pick(candidates[s], quotas[s], gen)
        n_ctx = int(a[-1]) if a.numel() else 0  # the last block sees positions < its anchor, no further
        feats.append(f[:n_ctx].flatten(1) if f.dim() == 3 else f[:n_ctx])
        ctx_pos.append(torch.arange(n_ctx))
        ctx_seq.append(torch.full((n_ctx,), s))
        pos = a[:, None] + k  # [a, B]
        inside = pos < T
        lab = torch.where(inside, input_ids[pos.clamp(max=T - 1)], 0)
        valid = inside & loss_mask[pos.clamp(max=T - 1)]
        valid[:, 0] = False
        block = torch.full((a.numel(), block_size), mask_token_id, dtype=torch.long)
        block[:, 0] = input_ids[a]
        ids.append(block)
        anchors.append(a)
        bseq.append(torch.full((a.numel(),), s))
        labels.append(lab)
        weights.append(decay * valid)
        cu_ctx.append(cu_ctx[-1] + n_ctx)
        cu_blocks.append(cu_blocks[-1] + a.numel())
    if not sequences:
        raise InputError("pack_batch got no sequences; the loader must give each step at least one")
    device = sequences[0]["features"].device
    long = dict(dtype=torch.long, device=device)
    return PackedBatch(
        features=torch.cat(feats).to(device),
        ctx_pos=torch.cat(ctx_pos).to(**long),
        ctx_seq=torch.cat(ctx_seq).to(**long),
        cu_ctx=torch.tensor(cu_ctx, **long),
        block_ids=torch.cat(ids).to(device),
        anchor_pos=torch.cat(anchors).to(**long),
        block_seq=torch.cat(bseq).to(**long),
        cu_blocks=torch.tensor(cu_blocks, **long),
        labels=torch.cat(labels).to(device),
        weights=torch.cat(weights).to(device),
    )
