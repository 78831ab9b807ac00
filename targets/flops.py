"""What the target's truncated forward costs in model FLOPs, counted from its layers' shapes and config, and the
fraction of a device's bf16 peak a measured rate is (MFU).

Model FLOPs are the multiply-adds the model itself asks for, 2 a multiply-add, on the real tokens only (padding is
waste, not model work): every projection and MLP (MLA's low-rank projections included), the router and the
experts a token is routed to (top-k of them, not all), the shared experts, the depthwise convolutions, the (query,
key) pairs each attention layer lets through (causal; a sliding window's W keys at most) times the heads' query-key
and value dims, and a linear-attention (Gated DeltaNet) layer's recurrent state (read with the key and the query,
updated with the key: 3 products of key dim x value dim a value head). Elementwise work (norms, activations,
rotary, softmax) is not counted, as in the usual 6N-style accounting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["ForwardFlops", "visible_pairs", "forward_flops", "mfu_line"]


def visible_pairs(n: int, window: int = 0) -> int:
    """Return the (query, key) pairs causal attention lets through on a row of n tokens, each query seeing itself
    and the keys before it, at most `window` of them (0: no window)."""
    if window <= 0 or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


@dataclass(frozen=True)
class ForwardFlops:
    """The FLOPs of a truncated forward: a cost per token (`per_token`, by part) and, per attention layer, a cost
    per visible (query, key) pair with its window (0: full)."""

    per_token: dict[str, float]
    attention: tuple[tuple[float, int], ...]

    def of_lengths(self, lengths: Iterable[int]) -> dict[str, float]:
        """Return the FLOPs of a forward over rows of these real lengths, by part (per-token parts and attention)."""
        lengths = list(lengths)
        tokens = sum(lengths)
        out = {k: v * tokens for k, v in self.per_token.items()}
        pairs: dict[int, int] = {}
        att = 0.0
        for per_pair, window in self.attention:
            if window not in pairs:
                pairs[window] = sum(visible_pairs(n, window) for n in lengths)
            att += per_pair * pairs[window]
        out["attention"] = att
        return out

    def total(self, lengths: Iterable[int]) -> float:
        """Return the FLOPs of a forward over rows of these lengths."""
        return float(sum(self.of_lengths(lengths).values()))


def _experts_per_token(module: Any, top_k: int) -> float:
    """Return the FLOPs a token costs in a transformers experts module (3-d weights [E, ., .]): top_k experts."""
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    experts = weights[0].shape[0] if weights else 1
    return 2.0 * top_k * sum(p.numel() for p in weights) / experts


def _attention(layer: Any, cfg: Any, kind: str) -> tuple[float, int]:
    """Return (FLOPs a visible pair, window or 0) of a decoder layer's attention: query heads x (query-key dim +
    value dim) x 2, read off its attention module (MLA's qk_head_dim and v_head_dim; Gemma 4's per-layer head
    dims; heads from o_proj's input), else from the config."""
    attn = getattr(layer, "self_attn", None)
    head = getattr(attn, "head_dim", None)
    qk = int(getattr(attn, "qk_head_dim", None) or head or 0)
    v = int(getattr(attn, "v_head_dim", None) or head or 0)
    o_proj = getattr(attn, "o_proj", None)
    if qk and v and o_proj is not None and hasattr(o_proj, "in_features"):
        heads = o_proj.in_features // v
    else:
        heads = int(cfg.num_attention_heads)
        qk = v = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    window = 0
    if kind == "sliding_attention":
        window = int(getattr(attn, "sliding_window", None) or getattr(cfg, "sliding_window", None) or 0)
    return 2.0 * heads * (qk + v), window


def forward_flops(text: Any, kinds: list[str], config: Any | None = None) -> ForwardFlops:
    """Return the FLOPs of the decoder stack `text` (its layers as they are: cut or whole; a model on the meta
    device does: only shapes are read), whose layers are of `kinds`; config: its text config (text.config)."""
    import torch

    cfg = config if config is not None else text.config
    top_k = int(getattr(cfg, "num_experts_per_tok", None) or 1)
    layers = list(text.layers)
    parts = {"projections": 0.0, "experts": 0.0, "linear_attention": 0.0}

    def walk(module: Any, skip: set[int]) -> None:
        for name, m in module.named_modules():
            if id(m) in skip:
                continue
            if hasattr(m, "is_concatenated") and hasattr(m, "has_gate"):  # transformers' experts module
                parts["experts"] += _experts_per_token(m, top_k)
                skip.update(id(c) for c in m.modules())
            elif isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts" and len(m):
                # experts kept one module each (older MoE code): top_k of them a token
                per = sum(2.0 * c.in_features * c.out_features for c in m.modules() if isinstance(c, torch.nn.Linear))
                parts["experts"] += per / len(m) * top_k
                skip.update(id(c) for c in m.modules())
            elif isinstance(m, torch.nn.Linear):
                parts["projections"] += 2.0 * m.in_features * m.out_features
            elif isinstance(m, torch.nn.Conv1d):
                parts["projections"] += 2.0 * m.in_channels // m.groups * m.kernel_size[0] * m.out_channels
            elif not isinstance(m, torch.nn.Embedding) and getattr(m, "weight", None) is not None and \
                    m.weight.dim() == 2:  # a router of its own ([experts, hidden], applied with F.linear)
                parts["projections"] += 2.0 * m.weight.numel()

    inside = {id(m) for layer in layers for m in layer.modules()}
    embeds = {id(m) for m in text.modules() if isinstance(m, torch.nn.Embedding)}
    walk(text, inside | embeds | {id(text.layers)})  # what runs outside the layers (Gemma 4's per-layer inputs)
    for layer in layers:
        walk(layer, set())
    attention = []
    for layer, kind in zip(layers, kinds):
        if kind == "linear_attention":
            dk, dv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
            parts["linear_attention"] += 3 * 2.0 * dk * dv * int(cfg.linear_num_value_heads)
        else:
            attention.append(_attention(layer, cfg, kind))
    return ForwardFlops({k: v for k, v in parts.items() if v}, tuple(attention))


def mfu_line(flops: float, seconds: float, device_name: str | None, peak: float | None) -> str:
    """Return how a rate compares with the device's peak: "312.4 TFLOP/s, 31.6% of the H200's 989.5 dense bf16"
    or, where the peak is not known, the rate and that it is not."""
    rate = flops / max(seconds, 1e-9)
    if peak is None:
        return f"{rate / 1e12:.3g} TFLOP/s (peak of {device_name or 'this device'} unknown: no MFU)"
    return f"{rate / 1e12:.1f} TFLOP/s, MFU {100 * rate / peak:.1f}% of {device_name}'s {peak / 1e12:.1f} dense bf16"
