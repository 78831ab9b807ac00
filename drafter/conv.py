"""DFlash 2's grouped dynamic causal convolution: a short causal filter along each block, around every sublayer.

Each layer holds two, `attention_conv` and `mlp_conv`. `prepare` filters a sublayer's (normed) input and returns
the taps its output will be filtered with; `finish` filters the sublayer's output with them. A tap's weight is a
static per-channel `base_kernel[side, tap, H]` plus a dynamic per-group value that the token itself computes from
the sublayer's input (`kernel_projection`: H -> [side 2 (in, out), taps k, groups H/g]). The filter runs along
the block's slots, causally and within the block: slot t sees slots t, t-1, ..., t-k+1 of its own block (zeros
before slot 0), so a later slot never changes an earlier one, and blocks packed side by side never mix. Context
features are not filtered (they enter attention as keys and values only).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GroupedDynamicCausalConv", "grouped_causal_filter"]

_IN, _OUT = 0, 1  # the two sides of base_kernel and of the projected taps


def grouped_causal_filter(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int,
                          group_size: int) -> torch.Tensor:
    """Return x [Q, H] filtered along each block of `block_size` rows: out[t] = sum_o (base[o] + dynamic[t, o]) * x[t-o].

    dynamic [Q, k, H/g] holds one value per tap and channel group (shared by its g channels), base [k, H] one per tap
    and channel. Q is a whole number of blocks laid out one after another.
    """
    Q, H = x.shape
    taps, groups = base.shape[0], H // group_size
    blocks = x.view(Q // block_size, block_size, groups, group_size)
    dyn = dynamic.reshape(Q // block_size, block_size, taps, groups, 1)
    base = base.to(x.dtype).view(taps, 1, 1, groups, group_size)
    out = torch.zeros_like(blocks)
    for o in range(taps):
        # The value o slots back in the same block; zeros before its first slot.
        past = blocks if o == 0 else F.pad(blocks[:, : block_size - o], (0, 0, 0, 0, o, 0))
        out = out + base[o] * past
        out = torch.addcmul(out, dyn[:, :, o], past)
    return out.view(Q, H)


class GroupedDynamicCausalConv(nn.Module):
    """The filter pair around one sublayer: parameters `base_kernel` [2, k, H] and `kernel_projection` (H -> 2*k*H/g)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Start as the identity (tap 0 = 1, other taps and every dynamic tap 0), as the DFlash 2 trainers do: a
        fresh convolution leaves the DFlash backbone's function unchanged and learns from there."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (x [Q, H] filtered for the sublayer's input, the output-side taps [Q, k, H/g] for `finish`)."""
        taps = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        filtered = grouped_causal_filter(x, taps[:, _IN], self.base_kernel[_IN], self.block_size, self.group_size)
        return filtered, taps[:, _OUT]

    def finish(self, y: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """Return the sublayer's output y [Q, H] filtered with the taps `prepare` computed from its input."""
        return grouped_causal_filter(y, taps, self.base_kernel[_OUT], self.block_size, self.group_size)
