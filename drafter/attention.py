"""Masks of a packed DFlash batch and the two kernels that apply them: SDPA (dense mask) and flex_attention.

Keys are laid out as [N context tokens ; A*B block tokens]. A block query sees context keys of its own sequence
at positions < its anchor, the keys of its own block (bidirectionally), nothing else; sliding-window layers also
drop keys at distance >= window.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from ..errors import ConfigError

if TYPE_CHECKING:
    from .config import DrafterConfig
    from .model import Attend
    from .batch import PackedBatch

__all__ = ["visible", "key_index", "query_index", "dense_masks", "make_attend", "bucket"]

log = logging.getLogger(__name__)


def visible(q_seq, q_anchor, q_pos, q_block, k_seq, k_pos, k_block, window: int | None):
    """Return whether each query sees each key (tensors broadcast; a key with k_block < 0 is a context token)."""
    ok = (k_block == q_block) | ((k_block < 0) & (k_seq == q_seq) & (k_pos < q_anchor))
    if window is not None:
        ok = ok & ((q_pos - k_pos).abs() < window)
    return ok


def query_index(batch: "PackedBatch") -> tuple[torch.Tensor, ...]:
    """Return (seq, anchor, pos, block) [A*B] of every block query."""
    B = batch.block_size
    blk = torch.arange(batch.num_blocks, device=batch.anchor_pos.device).repeat_interleave(B)
    return batch.block_seq[blk], batch.anchor_pos[blk], batch.block_pos.reshape(-1), blk


def key_index(batch: "PackedBatch") -> tuple[torch.Tensor, ...]:
    """Return (seq, pos, block) [N + A*B] of every key: context tokens (block -1), then block tokens."""
    q_seq, _, q_pos, q_blk = query_index(batch)
    neg = torch.full_like(batch.ctx_pos, -1)
    return torch.cat([batch.ctx_seq, q_seq]), torch.cat([batch.ctx_pos, q_pos]), torch.cat([neg, q_blk])


def _window(cfg: "DrafterConfig", kind: str) -> int | None:
    return cfg.sliding_window if kind == "sliding_attention" else None


def dense_masks(batch: "PackedBatch", cfg: "DrafterConfig") -> dict[str, torch.Tensor]:
    """Return the boolean mask [A*B, N + A*B] of each layer type used by the drafter."""
    qs, qa, qp, qb = (t[:, None] for t in query_index(batch))
    ks, kp, kb = (t[None, :] for t in key_index(batch))
    return {kind: visible(qs, qa, qp, qb, ks, kp, kb, _window(cfg, kind)) for kind in set(cfg.layer_types)}


def bucket(n: int, minimum: int = 256) -> int:
    """Return n rounded up to one of four sizes per power of two (>= minimum): few shapes, <= 25% padding."""
    if n <= minimum:
        return minimum
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


# Switches for diagnosing the flex kernel against SDPA (bench/drafter.py --check-only): hand flex the grouped k/v
# (enable_gqa) or k/v repeated to every query head, compiled or eager.
FLEX_GQA = True
FLEX_COMPILE = True


@functools.cache
def _compiled_flex(compiled: bool = True):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    # dynamic=False with bucketed shapes: one compiled kernel per bucket, reused across steps. A long run meets
    # more buckets than dynamo's default limit of 8 recompiles, and past it flex silently falls back to the eager
    # kernel, which materialises every score ([heads x Q x K]: hundreds of GiB at training shapes).
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    return torch.compile(flex_attention, dynamic=False)


def _pad(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
    return torch.cat([t, t.new_full((n - t.shape[0],), value)]) if n > t.shape[0] else t


def _make_mask_mod(q_idx: tuple[torch.Tensor, ...], k_idx: tuple[torch.Tensor, ...], window: int | None):
    """Return a flex mask_mod over index tensors; a factory, so the window is a closed-over constant per mask."""
    q_seq, q_anchor, q_pos, q_blk = q_idx
    k_seq, k_pos, k_blk = k_idx

    def mask_mod(b, h, qi, ki):
        return visible(q_seq[qi], q_anchor[qi], q_pos[qi], q_blk[qi], k_seq[ki], k_pos[ki], k_blk[ki], window)

    return mask_mod


def _round128(n: int) -> int:
    return -(-n // 128) * 128


def _flex_attend(batch: "PackedBatch", cfg: "DrafterConfig", capacity: tuple[int, int] | None) -> "Attend":
    from torch.nn.attention.flex_attention import create_block_mask

    N, Q = batch.ctx_pos.shape[0], batch.num_blocks * batch.block_size
    B = batch.block_size
    if capacity is not None and N <= capacity[0] and batch.num_blocks <= capacity[1]:
        # One shape for every batch of the run: flex and its block mask compile once. Bucketed shapes compiled
        # again for every new bucket, 7-16 s each on an H200 (five times in a 200-step demo run).
        Np, Qp = _round128(capacity[0]), _round128(capacity[1] * B)
    else:
        Np, Qp = bucket(N, 128), bucket(Q)
    L = Np + Qp
    q_seq, q_anchor, q_pos, q_blk = query_index(batch)
    # Padded block queries form blocks of their own (ids >= A) in sequence -2; padded context keys belong to
    # sequence -1 and are seen by nobody. So padding changes no real row and no padded block row is empty.
    pad_blk = batch.num_blocks + torch.arange(Qp - Q, device=q_blk.device) // B
    q_seq, q_anchor, q_pos = _pad(q_seq, Qp, -2), _pad(q_anchor, Qp, 0), _pad(q_pos, Qp, 0)
    q_blk = torch.cat([q_blk, pad_blk])
    k_seq = torch.cat([_pad(batch.ctx_seq, Np, -1), q_seq])
    k_pos = torch.cat([_pad(batch.ctx_pos, Np, 0), q_pos])
    k_blk = torch.cat([_pad(torch.full_like(batch.ctx_pos, -1), Np, -1), q_blk])
    # Queries are laid out like the keys (Q_LEN == KV_LEN): Np dead rows that see nothing, then the block
    # queries. The compiled flex backward has given wrong dK/dV for custom masks with KV_LEN != Q_LEN
    # (pytorch/pytorch#158212); the dead rows' tiles are empty, so they cost no attention work.
    dead = torch.full((Np,), -3, dtype=torch.long, device=q_seq.device)
    q_all = (torch.cat([dead, q_seq]), torch.cat([dead * 0, q_anchor]), torch.cat([dead * 0, q_pos]),
             torch.cat([dead - 2, q_blk]))
    masks = {
        kind: create_block_mask(_make_mask_mod(q_all, (k_seq, k_pos, k_blk), _window(cfg, kind)), None, None, L, L,
                                device=q_seq.device, _compile=True)
        for kind in set(cfg.layer_types)
    }
    flex = _compiled_flex(FLEX_COMPILE)
    gqa = FLEX_GQA

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from .model import expand_kv

        if not gqa:
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])

        def pad_kv(t: torch.Tensor) -> torch.Tensor:
            ctx, blk = t[:, :, :N], t[:, :, N:]
            return torch.cat([F.pad(ctx, (0, 0, 0, Np - N)), F.pad(blk, (0, 0, 0, Qp - Q))], dim=2)

        out = flex(F.pad(q, (0, 0, Np, Qp - Q)), pad_kv(k), pad_kv(v), block_mask=masks[cfg.layer_types[index]],
                   enable_gqa=q.shape[1] != k.shape[1])
        return out[:, :, Np:Np + Q]

    return attend


def make_attend(batch: "PackedBatch", cfg: "DrafterConfig", kind: str = "sdpa",
                capacity: tuple[int, int] | None = None) -> "Attend":
    """Return the Attend of a packed batch: "sdpa" (dense boolean mask, portable) or "flex" (CUDA block mask).

    capacity (context tokens, blocks) is the most any batch of the run holds (--batch-tokens and its block cap):
    flex then pads every batch to that one shape instead of to a size bucket; a batch over it falls back to
    buckets.

    SDPA runs once per packed sequence (its blocks against its own context and blocks): the dense mask of the
    whole batch would be S times larger and almost all False.
    """
    from .model import expand_kv

    if kind == "flex":
        return _flex_attend(batch, cfg, capacity)
    if kind != "sdpa":
        raise ConfigError(f"--attention {kind!r}: use flex or sdpa")
    N, B = batch.ctx_pos.shape[0], batch.block_size
    qs, qa, qp, qb = query_index(batch)
    ks, kp, kb = key_index(batch)
    spans, masks = [], []
    for s in range(batch.cu_ctx.shape[0] - 1):
        c0, c1 = int(batch.cu_ctx[s]), int(batch.cu_ctx[s + 1])
        q0, q1 = int(batch.cu_blocks[s]) * B, int(batch.cu_blocks[s + 1]) * B
        if q1 == q0:
            continue  # a sequence without anchors has no queries
        keys = torch.cat([torch.arange(c0, c1, device=kp.device), torch.arange(N + q0, N + q1, device=kp.device)])
        q = slice(q0, q1)
        per_kind = {
            kind_: visible(qs[q, None], qa[q, None], qp[q, None], qb[q, None], ks[None, keys], kp[None, keys],
                           kb[None, keys], _window(cfg, kind_))[None, None]
            for kind_ in set(cfg.layer_types)
        }
        spans.append((q, keys))
        masks.append([per_kind[t] for t in cfg.layer_types])

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        outs = [
            F.scaled_dot_product_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], attn_mask=m[index])
            for (rows, keys), m in zip(spans, masks)
        ]
        return torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape)

    return attend
