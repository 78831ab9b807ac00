"""dflash's attention for extraction on Hopper and later: cuDNN's fused attention kernel with each batch's length
rounded up to `GRANULE` tokens, registered with transformers as the attention implementation `NAME`.

On one H100 (torch 2.11, cuDNN 9.19; bench/attention_probe.py, bench/RESULTS.md) cuDNN's kernel ran the attention of
issue 44's targets 1.8-4x faster than the kernel SDPA takes without it: 538 against 294 TFLOP/s at a Qwen3-30B-A3B
layer's shape (flash), 659 against 311 at the Qwen3.6-27B shape's head dim 256 (flash), 563 against 139 for
DeepSeek-V3's MLA heads (q and k 192, v 128, which flash does not take: SDPA ran its memory-efficient kernel), each
within the same rounding of a float32 reference. But cuDNN builds an execution plan for every new shape (about 40 ms
there, against 0.7 ms for that layer's attention) and extract's batches are packed to their samples' lengths, so
nearly every batch is a new shape: that is why extract has kept SDPA off cuDNN since issue 22
(kernels.attention_backends). Here the keys, queries and values are padded at the end to the next multiple of
`GRANULE` tokens, so the plans are a few dozen for a whole run (the packer's batches of a 10M-token run of issue 44's
benchmark data came to 112 shapes at 256 tokens against 1,280 exact ones; the padding adds 10% to the attention's
work, none to the rest of the layer). Padding at the end changes no real token: attention is causal, so a query
never sees a key after it, and the padded queries' outputs are cut off.

Only causal self-attention without a mask, dropout, sinks or soft-capping takes that path (every layer of a target
whose layers are full attention, as extract runs it: one sample a row, no padding mask); anything else, a sliding
window's masked layers among them, runs transformers' SDPA forward unchanged. kernels.attention_order tries it first
where the query-key and value head dims differ (MLA), on CUDA devices of compute capability 9.0 or more where cuDNN
is present; the start-up self-check keeps it, as every candidate, only where it equals the model's eager float32
forward within bf16's rounding. Where SDPA's flash kernel runs it is not tried: on one H100 a Qwen3-30B-A3B-shaped
command over 1M tokens with it ran 47,243 tok/s, its forwards 5 s longer than warm for the plans of new shapes,
while its warm forward gained 1.028x over flash (bench/RESULTS.md). Off CUDA the padded path runs SDPA's own kernels
(what the CPU tests check it with).
"""
from __future__ import annotations

from typing import Any

__all__ = ["NAME", "GRANULE", "register", "usable", "forward"]

NAME = "cudnn_padded"
GRANULE = 256


def register() -> bool:
    """Register `forward` with transformers' attention interface as NAME, and SDPA's masks for it (a window's layers
    get their mask as under sdpa and run transformers' SDPA forward); False where this transformers has neither."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(NAME, forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True


def usable(device: Any) -> bool:
    """Return True on a CUDA device of compute capability 9.0 or more (Hopper, Blackwell) with cuDNN, where its
    kernel was measured faster; then it is registered."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and register()


def forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
            scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Attention of [B, H, S, D] queries over [B, H_kv, S, D] keys and values -> ([B, S, H, D_v], None), as
    transformers' attention functions return it."""
    import torch

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    length = query.shape[2]
    if (attention_mask is not None or not causal or dropout or torch.is_grad_enabled() or length < 2
            or key.shape[2] != length or any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks",
                                                                                 "position_bias"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    pad = -length % GRANULE
    # padded in the [B, S, H, D] order the projections wrote them in, so that a compiled layer writes the padded
    # tensor in the pass that makes it (rotary's), and the output comes back in the order the next projection reads
    q, k, v = (torch.nn.functional.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
               for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.is_cuda:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False,
                                                                 scale=scale)[0]
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)[:, :length].contiguous(), None
