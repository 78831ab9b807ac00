"""The DFlash drafter: Qwen3 decoder layers whose queries come from a block and keys/values from [context ; block].

Parameter names are exactly the exported ones (`layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`; DFlash 2
adds `layers.N.attention_conv.*`, `layers.N.mlp_conv.*` and `candidate_selector.*`), so a checkpoint's state dict is
the export. The target's embedding and lm_head are not parameters here: the caller passes them (frozen) to the
objective or to `draft_logits` / `draft_tokens`.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding

from ..errors import InputError
from ..facts import NUM_FEATURE_LAYERS
from .config import DrafterConfig
from .conv import GroupedDynamicCausalConv
from .selector import CandidateSelector

__all__ = ["DFlashDrafter", "Attend", "apply_rope", "expand_kv", "draft_logits", "draft_tokens", "block_embeddings",
           "unary_logits"]

log = logging.getLogger(__name__)

# attend(layer_index, q [1, heads, Q, d], k [1, kv_heads, K, d], v [1, kv_heads, K, d]) -> [1, heads, Q, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (statistics in at least fp32, scale applied in the input dtype); exact in float64 too."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return weight * x / rms(x)."""
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return x [.., N, d] rotated by the RoPE angles cos/sin [N, d] (the half-split convention of Qwen3)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    """Attention whose queries are the block's and whose keys/values are the context's and the block's."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.heads, self.kv_heads = d, h, kv
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, ctx: torch.Tensor, cos_x: torch.Tensor, sin_x: torch.Tensor,
                cos_c: torch.Tensor, sin_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q [1, heads, Q, d] of block tokens x [Q, H], and k, v [1, kv_heads, N + Q, d] of [ctx ; x]."""
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(-1, self.heads, d))
        # The context and block keys share k_proj/k_norm; RoPE uses each token's own position.
        k_ctx = self.k_norm(self.k_proj(ctx).view(-1, self.kv_heads, d))
        k_x = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, d))
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 0).view(-1, self.kv_heads, d)
        q = apply_rope(q.transpose(0, 1), cos_x, sin_x)
        k = torch.cat([apply_rope(k_ctx.transpose(0, 1), cos_c, sin_c), apply_rope(k_x.transpose(0, 1), cos_x, sin_x)], 1)
        return q[None], k[None], v.transpose(0, 1)[None]


class DrafterLayer(nn.Module):
    """One Qwen3 decoder layer (pre-norm attention and SwiGLU MLP) with DFlash attention."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = Qwen3MLP(cfg.qwen3_config())
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def pre(self, x: torch.Tensor, ctx: torch.Tensor, cos_x: torch.Tensor, sin_x: torch.Tensor,
            cos_c: torch.Tensor, sin_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q, k, v of the layer's attention; the context is used as given (not re-normed)."""
        return self.self_attn.project(self.input_layernorm(x), ctx, cos_x, sin_x, cos_c, sin_c)

    def post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Return the layer's output from its input x [Q, H] and the attention result [1, heads, Q, d]."""
        x = x + self.self_attn.o_proj(attn[0].transpose(0, 1).reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_x: tuple, rope_ctx: tuple, attend: Attend,
                index: int) -> torch.Tensor:
        """Return the layer's output for block tokens x [Q, H] attending to [ctx ; x] through `attend`."""
        q, k, v = self.pre(x, ctx, *rope_x, *rope_ctx)
        return self.post(x, attend(index, q, k, v))

    def compile_parts(self, dynamic: bool | None = None) -> None:
        """Compile the parts around attention (norms, projections, RoPE, MLP; DFlash 2's convolutions) to fuse their
        elementwise work; dynamic as torch.compile takes it.

        Attention stays outside: its mask changes every step, and flex_attention is compiled on its own.
        """
        self.pre = torch.compile(self.pre, dynamic=dynamic)
        self.post = torch.compile(self.post, dynamic=dynamic)


class DFlash2Layer(DrafterLayer):
    """A DFlash 2 layer: the same sublayers, each wrapped in a grouped dynamic causal convolution (conv.py)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
        self.attention_conv = GroupedDynamicCausalConv(*args)
        self.mlp_conv = GroupedDynamicCausalConv(*args)

    def pre(self, x: torch.Tensor, ctx: torch.Tensor, cos_x: torch.Tensor, sin_x: torch.Tensor,
            cos_c: torch.Tensor, sin_c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return q, k, v of the layer's attention over the filtered normed block, and the output-side taps."""
        h, taps = self.attention_conv.prepare(self.input_layernorm(x))
        return (*self.self_attn.project(h, ctx, cos_x, sin_x, cos_c, sin_c), taps)

    def post(self, x: torch.Tensor, attn: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Return the layer's output from its input x [Q, H], the attention result and the attention side's taps."""
        a = self.self_attn.o_proj(attn[0].transpose(0, 1).reshape(x.shape[0], -1))
        x = x + self.attention_conv.finish(a, taps)
        h, taps = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), taps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_x: tuple, rope_ctx: tuple, attend: Attend,
                index: int) -> torch.Tensor:
        """Return the layer's output for block tokens x [Q, H] (whole blocks) attending to [ctx ; x]."""
        q, k, v, taps = self.pre(x, ctx, *rope_x, *rope_ctx)
        return self.post(x, attend(index, q, k, v), taps)


class DFlashDrafter(nn.Module):
    """The drafter: `fc` + `hidden_norm` over target features, decoder layers over the block, final `norm`; a DFlash 2
    drafter (config.drafter "dflash2") has DFlash2Layer layers and a `candidate_selector`."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        n_feat = len(cfg.target_layer_ids) or NUM_FEATURE_LAYERS
        layer = DFlash2Layer if cfg.drafter == "dflash2" else DrafterLayer
        self.layers = nn.ModuleList([layer(cfg) for _ in range(cfg.num_hidden_layers)])
        if cfg.drafter == "dflash2":
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        self.fc = nn.Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # RoPE frequencies stay an fp32 plain attribute, not a buffer: model.to(bfloat16) must not round them
        # (inference engines keep them in fp32). transformers computes them, so every rope_type is handled.
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            rope = Qwen3RotaryEmbedding(cfg.qwen3_config())
        self._inv_freq, self._rope_scale = rope.inv_freq.float().clone(), float(rope.attention_scaling)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Initialise linear weights N(0, std) and norms to one, as Qwen3 models are initialised."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        for m in self.modules():  # DFlash 2's parts start as the identity and as argmax (see their own init)
            if isinstance(m, GroupedDynamicCausalConv):
                m.reset_parameters()
            elif isinstance(m, CandidateSelector):
                m.reset_parameters(std)

    def _rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq.to(positions.device)[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(like.dtype), (emb.sin() * self._rope_scale).to(like.dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Return hidden_norm(fc(features)) [N, H]: the context every layer attends to, one row per token.

        Row i depends on token i's features alone, so a decoder may project new context rows as they come.
        """
        if features.dim() == 3:  # [N, n, H] as stored -> [N, n*H], layer-major as the reference concatenates
            features = features.flatten(1)
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(self, features: torch.Tensor, ctx_pos: torch.Tensor, block_embeds: torch.Tensor,
                block_pos: torch.Tensor, attend: Attend, *, projected: bool = False) -> torch.Tensor:
        """Return the final-normed hidden states [Q, H] of the block tokens.

        features [N, n*H] are the target features of every context token (any packing), or with projected=True
        their `project_context` [N, H]; ctx_pos [N] their positions, block_embeds [Q, H] the target embeddings of
        the block tokens and block_pos [Q] their positions.
        `attend` sees keys laid out as [N context ; Q block] and applies the mask that packing implies.
        """
        ctx = features.to(self.fc.weight.dtype) if projected else self.project_context(features)
        x = block_embeds.to(self.fc.weight.dtype)
        rope_x, rope_ctx = self._rope(x, block_pos), self._rope(x, ctx_pos)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_x, rope_ctx, attend, i)
        return self.norm(x)

    def compile_layers(self) -> "DFlashDrafter":
        """Compile every layer's non-attention parts (see DrafterLayer.compile_parts); return self."""
        for layer in self.layers:
            layer.compile_parts()
        return self


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Return k or v [1, kv_heads, K, d] repeated to [1, heads, K, d] (grouped-query attention).

    Explicit, because SDPA's enable_gqa with a boolean mask falls back to the math kernel on some builds.
    """
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sdpa_attend(masks: list[torch.Tensor | None]) -> Attend:
    """Return an Attend that runs SDPA with the boolean mask of each layer (None: every key visible)."""

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[index])

    return attend


def block_embeddings(cfg: DrafterConfig, ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
    """Return the drafter's input embeddings of block token ids: the target's rows, times the target's
    input_embedding_scale when it has one (as the reference inference code scales them)."""
    e = F.embedding(ids, embed_weight)
    return e if cfg.input_embedding_scale == 1.0 else e * cfg.input_embedding_scale


def unary_logits(cfg: DrafterConfig, logits: torch.Tensor) -> torch.Tensor:
    """Return the drafter's logits from raw lm_head logits: times the target's output_multiplier, then its
    final_logit_softcapping (c * tanh(x / c)), each only when the target has it (the reference's compute_logits)."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        c = float(cfg.final_logit_softcapping)
        logits = torch.tanh(logits / c) * c
    return logits


def _draft_hidden(model: DFlashDrafter, context_features: torch.Tensor, anchor_id: int, embed_weight: torch.Tensor,
                  anchor_pos: int | None, projected: bool) -> torch.Tensor:
    """Return the final-normed hidden states [B, H] of one block (anchor, then B-1 mask tokens), alone."""
    cfg = model.config
    S = context_features.shape[0]
    anchor_pos = S if anchor_pos is None else int(anchor_pos)
    if anchor_pos < 0:
        raise InputError(f"anchor position must be >= 0, got {anchor_pos}")
    ctx = context_features[: min(S, anchor_pos)]
    device = ctx.device
    ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[0] = anchor_id
    ctx_pos = torch.arange(ctx.shape[0], device=device)
    block_pos = anchor_pos + torch.arange(cfg.block_size, device=device)
    masks: list[torch.Tensor | None] = []
    for kind in cfg.layer_types:
        if kind == "sliding_attention":
            key_pos = torch.cat([ctx_pos, block_pos])
            dist = block_pos[:, None] - key_pos[None, :]
            masks.append((dist.abs() < cfg.sliding_window)[None, None])
        else:
            masks.append(None)
    embeds = block_embeddings(cfg, ids, embed_weight)
    return model(ctx, ctx_pos, embeds, block_pos, _sdpa_attend(masks), projected=projected)


def _logits(model: DFlashDrafter, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    raw = (hidden @ lm_head_weight.to(hidden.dtype).T).to(torch.promote_types(hidden.dtype, torch.float32))
    return unary_logits(model.config, raw)


@torch.no_grad()
def draft_logits(
    model: DFlashDrafter,
    context_features: torch.Tensor,
    anchor_id: int,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    anchor_pos: int | None = None,
    *,
    projected: bool = False,
) -> torch.Tensor:
    """Return the draft logits [B-1, V] of one block, computed the way inference does.

    context_features [S, n*H] (or [S, n, H]) are the target features of the accepted tokens at positions 0..S-1,
    or with projected=True their `model.project_context` [S, H]; the block is the anchor token (the last accepted
    one, at position `anchor_pos`, default S) then B-1 mask tokens. Only context positions < anchor_pos are used.
    No packing, no block mask: one block alone.
    """
    hidden = _draft_hidden(model, context_features, anchor_id, embed_weight, anchor_pos, projected)
    return _logits(model, hidden[1:], lm_head_weight)


@torch.no_grad()
def draft_tokens(
    model: DFlashDrafter,
    context_features: torch.Tensor,
    anchor_id: int,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    anchor_pos: int | None = None,
    *,
    projected: bool = False,
) -> torch.Tensor:
    """Return the greedy draft tokens [B-1] of one block (arguments as `draft_logits`): the argmax of each slot's
    logits, or for a DFlash 2 drafter the candidate selector's path through the slots' top-K."""
    hidden = _draft_hidden(model, context_features, anchor_id, embed_weight, anchor_pos, projected)[1:]
    logits = _logits(model, hidden, lm_head_weight)
    if model.config.drafter == "dflash2":
        return model.candidate_selector.path(hidden, logits, anchor_id)
    return logits.argmax(-1)
