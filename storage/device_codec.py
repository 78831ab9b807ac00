"""The scaled codecs (fp8, uq8/6/4) in torch, for the device that makes or consumes the features: bit for bit the
numpy codecs of codec.py, which every CPU reader and writer uses.

Why on the device: on one H200 (bench/RESULTS.md, 2026-12-05) the GPU demo's drafter trained from a uq6 store at
0.43x the blosc store's steps a second with the trainer waiting 0% on data, and extracted at 0.62x: the store's
15-16 pool threads quantised and dequantised in numpy, and every numpy call they make takes the GIL, which the
training or forward loop's thread gives up at every torch op and then has to win back from them. On the device the
codec is a handful of elementwise kernels, and the pool threads only run blosc and the checksum (without the GIL).

Exactness: every step is one IEEE operation rounded to nearest (a division, a product, a rint, a selection, a
conversion), which CUDA and the CPU compute alike, with one trap: on CUDA, torch divides a tensor by a Python number
as a product with its float32 reciprocal, up to an ulp off the quotient (x / 448 differs for about half of all x;
a review found it in ATen's BinaryDivTrueKernel.cu). So every divisor here is a tensor (_div), and the test checks
that no division by a number is left. tests/test_storage_device_codec.py compares these with the numpy codecs on
the CPU, and its gpu-marked test on CUDA.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .codec import _BF16_MAX, _F32_TINY, FP8_MAX, QUANT_DIVISORS, SCALED_CODECS, ZIGZAG_MAX

if TYPE_CHECKING:
    import torch

__all__ = ["encode_on_device", "decode_on_device", "stored_torch_dtype"]


def stored_torch_dtype(codec: str) -> "torch.dtype":
    """Return the torch dtype holding a scaled codec's stored features: uint8 fp8 bits, or the uq codecs' uint16
    zigzagged integers as int16 (the same bits; torch's uint16 lacks CUDA kernels)."""
    import torch

    if codec not in SCALED_CODECS:
        raise ValueError(f"codec {codec!r} is not one of the scaled codecs {SCALED_CODECS}")
    return torch.uint8 if codec == "fp8" else torch.int16


def _div(a: "torch.Tensor", b: float) -> "torch.Tensor":
    """Return a / b correctly rounded on any device: b as a tensor (on CUDA a number divisor becomes a product)."""
    import torch

    return a / torch.full_like(a, b)


def encode_on_device(features: "torch.Tensor", codec: str) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Return (stored features [t, L, H] in stored_torch_dtype, float32 scales [t, L]) of features [t, L, H] (any
    float dtype; rounded to bf16 first, as the store does) on their own device: codec.encode_scaled's bits."""
    import torch

    if codec == "fp8":
        x = features.to(torch.bfloat16).to(torch.float32)
        amax = x.abs().amax(dim=-1)
        amax = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
        scale = _div(amax, FP8_MAX)
        # NaN is coded by hand, 0x7F with its sign as numpy's codec codes it: whatever sign CUDA's division and
        # conversion would leave a NaN with, the bits are the CPU's.
        nan = torch.isnan(x)
        q = torch.where(nan, torch.zeros_like(x), x / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX)
        q = q.to(torch.float8_e4m3fn).view(torch.uint8)
        nan_code = torch.where(torch.signbit(x), torch.full_like(q, 0xFF), torch.full_like(q, 0x7F))
        return torch.where(nan, nan_code, q), scale
    # The uq codecs in as few passes over the features as exactness allows (on a GPU they are memory-bound: each
    # pass over a forward's features is a share of the forward): the reductions read the bf16 features (their
    # maximum and order are the float32 copies'), the product upcasts them as it reads them, and the zigzag runs in
    # int16, whose shifts and exclusive-or give the int32 zigzag's low 16 bits.
    x = features.to(torch.bfloat16)
    divisor = QUANT_DIVISORS[codec]
    H = x.shape[-1]
    stride = max(1, H // 256)
    middle = (len(range(0, H, stride)) - 1) // 2
    amax = torch.maximum(x.amax(dim=-1), -x.amin(dim=-1)).float()
    if x.shape[0] == 0:
        median = amax
    else:
        median = torch.kthvalue(x[..., ::stride].float().abs(), middle + 1, dim=-1).values
    step = torch.maximum(_div(median, divisor), _div(amax, ZIGZAG_MAX))
    step = torch.where(step > 0, step.clamp(min=_F32_TINY), torch.ones_like(step))
    finite = torch.isfinite(amax)
    step = torch.where(finite, step, torch.full_like(step, float("nan")))
    inv = torch.where(finite, torch.ones_like(step) / step, torch.zeros_like(step))
    # A row with a NaN or an infinity has inv 0: its finite values become (signed) zeros and the others NaN, coded 0
    # as numpy's codec codes the whole row.
    q = (x * inv[..., None]).nan_to_num_(nan=0.0).round_().clamp_(-ZIGZAG_MAX, ZIGZAG_MAX).to(torch.int16)
    return (q << 1) ^ (q >> 15), step  # zigzag: 0..65535 as int16 bits


def decode_on_device(stored: "torch.Tensor", scales: "torch.Tensor", codec: str) -> "torch.Tensor":
    """Return bf16 features [t, L, H] of a scaled codec's stored features [t, L, H] and float32 scales [t, L], on
    their device: codec.decode_scaled_into's values (a NaN may carry other NaN bits)."""
    import torch

    scales = scales.to(torch.float32)
    if codec == "fp8":
        x = stored.view(torch.float8_e4m3fn).to(torch.float32) * scales[..., None]
        return x.to(torch.bfloat16)
    if codec not in QUANT_DIVISORS:
        raise ValueError(f"codec {codec!r} is not one of the scaled codecs {SCALED_CODECS}")
    u = stored.to(torch.int32) & 0xFFFF
    v = ((u >> 1) ^ -(u & 1)).to(torch.float32) * scales[..., None]
    return v.clamp_(-_BF16_MAX, _BF16_MAX).to(torch.bfloat16)
