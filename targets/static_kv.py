"""A Hugging Face Llama/Qwen causal LM run layer by layer over a static KV cache: what CUDA graphs can replay.

transformers' own forward grows a DynamicCache by concatenation and builds its masks on the host, so no step of it
can be captured as a CUDA graph. Here the cache is allocated once ([rows, kv_heads, max_len, head_dim] per layer),
a step writes its keys and values at its positions with index_copy_ and attends to a fixed number of cache columns
(`width`) under a mask made on the device from those positions, so a step of a given width is one fixed sequence of
kernels. The model's own modules (embeddings, norms, projections, rotary embedding, MLP) do the arithmetic; only
attention and the cache are ours. Used by `dflash generate`'s fast engine (many rows) and by speculative decoding's
static decoder (one row, blocks of tokens).
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

__all__ = ["SUPPORTED", "fast_unsupported", "model_rope", "rows_linear", "StaticTarget"]

# Architectures whose decoder layer is (norm, attention with optional q/k norm, residual, norm, MLP, residual).
SUPPORTED = ("llama", "qwen2", "qwen3")


def fast_unsupported(config: Any) -> str | None:
    """Return why a static-cache forward cannot run a model of this transformers config (None when it can)."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"architecture {kind!r} is not one of {', '.join(SUPPORTED)}"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "the model has sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"
    if "dynamic" in kind:  # its update compares lengths on the host and swaps inv_freq: no graph can hold that
        return f"rope_type {kind!r} rescales its frequencies as the sequence grows"
    return None


def model_rope(model: Any) -> Any:
    """Return the apply_rotary_pos_emb of the model's own modeling module (the same arithmetic as its forward)."""
    return sys.modules[type(model.model.layers[0]).__module__].apply_rotary_pos_emb


def rows_linear(lin: Any, h: Any) -> Any:
    """Return lin(h) for h [1, t, K] computed as t one-row products in one batched matmul (a stride-0 weight)."""
    w = lin.weight.t()
    t = h.shape[1]
    y = (h[0][:, None] @ w.expand(t, *w.shape))[:, 0][None]
    return y if lin.bias is None else y + lin.bias


class StaticTarget:
    """One sequence of a Llama/Qwen target over a static KV cache: `forward(ids, pos0, width)` runs ids [t] at
    positions pos0..pos0+t-1 (pos0 a one-element device tensor), writes their keys and values into the cache and
    returns the final-normed hidden states [t, H] and, with features=True, the outputs of `feature_layers` [t, n*H]
    (layer-major, as `output_hidden_states` gives hidden_states[i + 1]; the last layer's output is the normed one,
    as transformers reports it). Columns past a query's own position are masked, so what a rejected block wrote is
    never read: the next step at those positions overwrites it first."""

    def __init__(self, model: Any, *, max_len: int, feature_layers: Sequence[int] = ()) -> None:
        import torch

        why = fast_unsupported(model.config)
        assert why is None, why
        cfg = model.config
        self.torch, self.model, self.inner = torch, model, model.model
        self.rope = model_rope(model)
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_len = max_len
        self.feature_layers = [int(i) for i in feature_layers]
        # fp32 on CUDA (how decoding verifies): cuBLAS's kernel for a few rows through a narrowing projection (k/v,
        # the MLP's down) took 52 us where the batched one-row form takes 6-9, and the memory-efficient attention
        # kernel 46 us where matmul + softmax take 20, for 3 or 24 query rows (bench/decode.py --alternatives, H200).
        self.fp32_cuda = self.device.type == "cuda" and self.dtype == torch.float32
        # Every layer's keys and values in one tensor (layer, k/v, row, head, column, dim), so that `move` is one
        # gather and one scatter; cache[i] = (keys, values) of layer i, views of it.
        shape = (len(self.inner.layers), 2, 1, self.kv_heads, max_len, self.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cache = [(self.kv[i, 0], self.kv[i, 1]) for i in range(shape[0])]
        self.cols = torch.arange(max_len, device=self.device)

    def _linear(self, lin: Any, h: Any) -> Any:
        """Return lin(h) for h [1, t, K]; a narrowing projection of several rows in fp32 on CUDA as t one-row
        products in one batched matmul (the same sums, another kernel: see __init__)."""
        t = h.shape[1]
        if not (self.fp32_cuda and t > 1 and lin.out_features < lin.in_features):
            return lin(h)
        return rows_linear(lin, h)

    def _mlp(self, mlp: Any, h: Any) -> Any:
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return mlp(h)
        return self._linear(mlp.down_proj, mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))

    def _attend(self, attn: Any, h: Any, cos: Any, sin: Any, cache: tuple[Any, Any], positions: Any,
                mask: Any, width: int) -> Any:
        F = self.torch.nn.functional
        t, d, rep = h.shape[1], self.head_dim, self.heads // self.kv_heads
        q = attn.q_proj(h).view(1, t, -1, d)
        k = self._linear(attn.k_proj, h).view(1, t, -1, d)
        v = self._linear(attn.v_proj, h).view(1, t, -1, d).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ck, cv = cache
        ck.index_copy_(2, positions, k)
        cv.index_copy_(2, positions, v)
        # The query heads of one kv head act as that head's queries: grouped-query attention without copying keys.
        qg = q.reshape(1, self.kv_heads, rep * t, d)
        if self.fp32_cuda:  # here mask marks what each query must not see (forward inverts it once)
            scores = (qg * attn.scaling) @ ck[:, :, :width].transpose(-1, -2)
            out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ cv[:, :, :width]
        else:
            out = F.scaled_dot_product_attention(qg, ck[:, :, :width], cv[:, :, :width], attn_mask=mask,
                                                 scale=attn.scaling)
        return attn.o_proj(out.reshape(1, self.heads, t, d).transpose(1, 2).reshape(1, t, -1))

    def move(self, src: Any, dst: Any) -> None:
        """Copy the keys and values of cache columns src [k] to columns dst [k] in every layer, in one gather and one
        scatter (a verified tree's accepted path going to the committed columns)."""
        self.kv.index_copy_(4, dst, self.kv.index_select(4, src))

    def forward(self, ids: Any, pos0: Any, width: int, *, features: bool = False, rope_pos: Any = None,
                visible: Any = None) -> tuple[Any, Any]:
        """Return (final-normed hidden states [t, H], feature-layer outputs [t, n*H] or None) of ids [t], without
        gradients (the cache's layers are views of one tensor, which autograd would not let every layer write).

        A tree of tokens (decode/tree.py): rope_pos [t] their positions in the sequence (committed length + depth)
        while their keys and values still go to columns pos0..pos0+t-1, and visible [t, width] which columns each
        one sees (the committed ones, its ancestors and itself)."""
        with self.torch.no_grad():
            return self._forward(ids, pos0, width, features, rope_pos, visible)

    def _forward(self, ids: Any, pos0: Any, width: int, features: bool, rope_pos: Any,
                 visible: Any) -> tuple[Any, Any]:
        torch = self.torch
        t = ids.shape[0]
        positions = pos0 + torch.arange(t, device=self.device)
        x = self.inner.embed_tokens(ids[None])
        cos, sin = self.inner.rotary_emb(x, (positions if rope_pos is None else rope_pos)[None])
        rep = self.heads // self.kv_heads
        if visible is None:
            visible = self.cols[:width][None, :] <= positions[:, None]
        mask = visible.repeat(rep, 1)[None, None]  # [1, 1, rep*t, width]
        if self.fp32_cuda:
            mask = ~mask  # the columns to hide, as _attend's masked_fill takes them: once, not once per layer
        last = len(self.inner.layers) - 1
        taken: dict[int, Any] = {}
        for i, (layer, cache) in enumerate(zip(self.inner.layers, self.cache)):
            x = x + self._attend(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, positions, mask, width)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
            if features and i in self.feature_layers and i != last:
                taken[i] = x[0]
        h = self.inner.norm(x)[0]
        if not features:
            return h, None
        return h, torch.cat([h if i == last else taken[i] for i in self.feature_layers], dim=-1)
