"""Gated DeltaNet (linear-attention) layers under torch.compile: the layer compiles around its recurrent kernel.

transformers' Gated DeltaNet layers (qwen3_5, qwen3_next and their MoE kin) call module-level functions of their
modeling file: the chunked delta rule (flash-linear-attention's Triton kernels on CUDA where fla is installed,
transformers' torch loop otherwise) and a causal depthwise convolution (the causal-conv1d package's kernel where
installed, else F.conv1d). Compiled whole, torch traces into fla's autotuned Triton kernels and its autograd
Function: a Qwen3.6-27B-shaped layer was still tracing after 130 s on one H100 (bench/RESULTS.md, 2026-12-06).
`prepare` makes the recurrent kernels opaque to torch.compile (a graph break: they run as they do eager), so the
rest of the layer compiles as any other (norms, gates, projections' epilogues, the MLP), and, where the
convolution is transformers' F.conv1d fallback, gives the compiled graph the same convolution as K shifted
multiply-adds in float32 that inductor fuses with its activation and the transposes around it into one pass
(eager callers keep F.conv1d). Whether a target's compiled layers are used at all is the self-check's
(kernels.choose: within the dtype's rounding of the eager float32 forward).
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["RECURRENT", "CONV", "PACKED", "is_linear_attention", "prepare", "shifted_conv"]

# The names a Gated DeltaNet layer calls its recurrent kernels by in its modeling file (transformers 5.17-5.25 have
# the first two; the others are fla's own names, wrapped too should a release import them under them).
RECURRENT = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "chunk_gated_delta_rule",
             "fused_recurrent_gated_delta_rule")
CONV = "causal_conv1d_fn"
# The convolution's keywords for packed rows (several samples a row), which shifted_conv does not keep apart.
PACKED = ("seq_idx", "cu_seqlens", "cu_seq_lens_q")
_MARK = "_dflash_compiles_around"


def is_linear_attention(module: Any) -> bool:
    """Return True for a transformers Gated DeltaNet module (its class name ends so in every family that has it)."""
    return type(module).__name__.endswith("GatedDeltaNet")


def shifted_conv(hidden_states: Any, weight: Any, bias: Any = None, activation: str | None = None, **_: Any) -> Any:
    """transformers' causal_conv1d_fn (hidden_states [B, C, T], weight [C, K]: the depthwise causal convolution, then
    the activation) as K shifted multiply-adds in float32, rounded once to the input's dtype."""
    import torch

    T, K = hidden_states.shape[-1], weight.shape[-1]
    x = torch.nn.functional.pad(hidden_states, (K - 1, 0)).float()
    w = weight.float()
    out = x[..., K - 1:K - 1 + T] * w[:, K - 1:K]
    for k in range(K - 1):
        out = out + x[..., k:k + T] * w[:, k:k + 1]
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation in ("silu", "swish"):
        out = torch.nn.functional.silu(out)
    elif activation is not None:
        raise ValueError(f"causal convolution activation {activation!r}: expected silu, swish or None")
    return out.to(hidden_states.dtype)


def _conv_kernel_installed() -> bool:
    """Return True where the causal-conv1d package imports (what transformers takes for the convolution)."""
    try:
        import causal_conv1d  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or built for another torch: transformers falls back as well
        return False
    return True


def prepare(layer: Any) -> None:
    """Make the Gated DeltaNet modules' recurrent kernels in the layer opaque to torch.compile and, under
    transformers' F.conv1d fallback, their compiled convolution shifted_conv (causal-conv1d's kernel, where it is
    installed, opaque as well); once per modeling file (their module-level functions), leaving eager calls as they
    were."""
    import torch

    for sub in layer.modules():
        mod = sys.modules.get(type(sub).__module__) if is_linear_attention(sub) else None
        if mod is None or getattr(mod, _MARK, False):
            continue
        for name in RECURRENT:
            fn = getattr(mod, name, None)
            if callable(fn):
                setattr(mod, name, torch.compiler.disable(fn))
        conv = getattr(mod, CONV, None)
        if callable(conv):
            setattr(mod, CONV, torch.compiler.disable(conv) if _conv_kernel_installed()
                    else _conv_under_compile(conv, shifted_conv))
        setattr(mod, _MARK, True)


def _conv_under_compile(eager: Any, compiled: Any) -> Any:
    """Return a function that calls `compiled` while torch.compile traces it and `eager` otherwise, and eager
    always where the call asks for what shifted_conv does not do (packed rows: seq_idx, cu_seqlens; an activation
    other than SiLU), so that transformers' own checks and kernels see those calls."""
    import functools

    import torch

    @functools.wraps(eager)
    def conv(*args: Any, **kwargs: Any) -> Any:
        activation = args[3] if len(args) > 3 else kwargs.get("activation")
        plain = activation in (None, "silu", "swish") and all(kwargs.get(k) is None for k in PACKED)
        if plain and torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    return conv
