"""drafter/flops.py's count against torch's FlopCounterMode on a real forward + backward of tiny drafters."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash.drafter.attention import dense_masks
from dflash.drafter.flops import step_flops
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.train.objective import drafter_loss
from dflash.train.packing import pack_batch

V, H = 96, 32


def _cfg(drafter: str) -> DrafterConfig:
    return DrafterConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=V, block_size=4, mask_token_id=V - 1,
                         target_layer_ids=(1, 2, 3, 4, 5), drafter=drafter, conv_kernel_size=2, conv_group_size=8,
                         selector_rank=6, selector_top_k=5)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for T in (19, 30):
        mask = torch.rand(T, generator=g) > 0.2
        seqs.append(dict(input_ids=torch.randint(0, V - 1, (T,), generator=g), loss_mask=mask,
                         features=torch.randn(T, 5, H, generator=g)))
    return pack_batch(seqs, block_size=4, mask_token_id=V - 1, max_anchors=6, seed=seed)


def matmul_flops(counter: FlopCounterMode) -> float:
    """Return the FLOPs a FlopCounterMode counted outside attention kernels.

    Which attention kernels it counts depends on torch: 2.13 counts none of the CPU's (its SDPA runs
    aten._scaled_dot_product_flash_attention_for_cpu, which has no formula there), 2.15 counts them, as dense
    (query x key, the mask ignored). Attention is checked against the pairs the mask lets through instead."""
    counts = counter.get_flop_counts().get("Global", {})
    return float(sum(v for op, v in counts.items() if "attention" not in str(op)))


def _counted(cfg: DrafterConfig, batch, position_weights: str) -> float:
    """Return every FLOP FlopCounterMode counts outside attention in one step (forward + backward) of a tiny
    drafter in fp64."""
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():  # a DFlash 2 drafter starts with zero dynamic taps and codebook: make every part live
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(V, H, generator=g).double(), torch.randn(V, H, generator=g).double()
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = drafter_loss(model, batch, embed, head, attention="sdpa", position_weights=position_weights)
        loss.backward()
    return matmul_flops(counter)


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
@pytest.mark.parametrize("seed", [0, 3])
def test_step_flops_equal_the_flop_counter_on_every_matmul(drafter: str, position_weights: str, seed: int) -> None:
    cfg, batch = _cfg(drafter), _batch(seed)
    parts = step_flops(cfg, batch)
    assert set(parts) == ({"layers", "attention", "fc", "lm_head"}
                          | ({"conv", "selector"} if drafter == "dflash2" else set()))
    # The counter's matmuls (its attention kernels left out: matmul_flops) and no elementwise work: the conv's
    # filter (2 FLOPs per tap and channel, on both sides, 3x for forward and backward) is counted by hand here.
    Q, k = batch.num_blocks * cfg.block_size, cfg.conv_kernel_size
    filt = 3 * cfg.num_hidden_layers * 2 * 2 * (2 * k * Q * H) if drafter == "dflash2" else 0
    assert _counted(cfg, batch, position_weights) == sum(parts.values()) - parts["attention"] - filt


@pytest.mark.parametrize("seed", [0, 3])
def test_attention_counts_the_query_key_pairs_the_mask_lets_through(seed: int) -> None:
    cfg, batch = _cfg("dflash2"), _batch(seed)
    pairs = int(dense_masks(batch, cfg)["full_attention"].sum())
    hq = cfg.num_attention_heads * cfg.head_dim
    # QK^T and PV: 2 multiply-adds a visible pair and head channel, 3x for forward and backward, every layer.
    assert step_flops(cfg, batch)["attention"] == 3 * cfg.num_hidden_layers * 2 * 2 * pairs * hq
