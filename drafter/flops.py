"""What a drafter training step costs in FLOPs, counted from a packed batch's shapes, and the devices' peaks."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .batch import PackedBatch
    from .config import DrafterConfig

__all__ = ["step_flops", "step_counts", "flops_of", "peak_flops", "H200_BF16_PEAK"]

H200_BF16_PEAK = 989.5e12  # dense bf16 tensor-core FLOP/s of an H100/H200 SXM (the vendor's datasheet)
# Dense bf16 peaks by device name, for MFU; a device not listed reports no MFU rather than a guess.
_PEAKS = {"H200": H200_BF16_PEAK, "H100": H200_BF16_PEAK, "A100": 312e12}


def step_flops(cfg: "DrafterConfig", batch: "PackedBatch") -> dict[str, float]:
    """Return the FLOPs of one forward + backward, by part, counted from the shapes of the batch.

    A trained product costs 3x its forward (input and weight gradients); the frozen lm_head's and the gathered
    candidate rows' 2x (input gradient only); fc's 2x (its input, the target features, takes no gradient).
    DFlash 2 adds "conv" (per layer two convolutions, each a kernel_projection matmul on the block tokens and its
    filter applied twice, 2 FLOPs per tap and channel) and "selector" (per counted slot: K + 1 candidate logits,
    the hidden_projection and the low-rank pair scores; train/selector_loss.py).
    """
    rows, anchors = step_counts(batch)
    return flops_of(cfg, batch.num_blocks, batch.ctx_pos.shape[0], int(rows), float(anchors))


def step_counts(batch: "PackedBatch") -> "torch.Tensor":
    """Return the two data-dependent counts step_flops needs, on the batch's device (no host sync): the counted
    slots and the anchor positions' sum."""
    import torch

    return torch.stack([(batch.weights[:, 1:] > 0).sum(), batch.anchor_pos.sum()])


def flops_of(cfg: "DrafterConfig", blocks: int, ctx_tokens: int, rows: int, anchor_sum: float) -> dict[str, float]:
    """Return step_flops from a batch's blocks, context tokens, counted slots and sum of anchor positions."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, L = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_hidden_layers
    Q = blocks * cfg.block_size
    N = ctx_tokens
    keys = (anchor_sum + blocks * cfg.block_size) * cfg.block_size  # visible keys summed over queries
    per_layer_block = 2 * Q * (H * hq + 2 * H * hkv + hq * H + 3 * H * I)
    per_layer_ctx = 2 * N * (2 * H * hkv)
    attn = 4 * keys * hq  # QK^T and PV over the visible keys only
    out = {
        "layers": 3 * L * (per_layer_block + per_layer_ctx),
        "attention": 3 * L * attn,
        "fc": 2 * 2 * N * len(cfg.target_layer_ids) * H * H,
        "lm_head": 2 * 2 * rows * H * cfg.vocab_size,
    }
    if cfg.drafter == "dflash2":
        k, groups = cfg.conv_kernel_size, H // cfg.conv_group_size
        per_conv = 2 * Q * H * (2 * k * groups) + 2 * (2 * k * Q * H)  # projection + the filter on both sides
        out["conv"] = 3 * L * 2 * per_conv
        cand, r = cfg.selector_top_k + 1, cfg.selector_rank  # the strict top-K and the gold token
        out["selector"] = 2 * 2 * rows * cand * H + 3 * (2 * rows * H * r + 2 * rows * cand * r)
    return out


def peak_flops(device_name: str) -> float | None:
    """Return the dense bf16 FLOP/s of a CUDA device by its name, or None when it is not known."""
    return next((v for k, v in _PEAKS.items() if k in device_name), None)
