"""The DFlash drafter: Qwen3 decoder layers whose queries come from a block and keys/values from [context ; block].

Parameter names are exactly the exported ones (`layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`; DFlash 2
adds `layers.N.attention_conv.*`, `layers.N.mlp_conv.*` and `candidate_selector.*`), so a checkpoint's state dict is
the export. The target's embedding and lm_head are not parameters here: the caller passes them (frozen) to the
objective or to `draft_logits` / `draft_tokens`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding

from ..errors import ConfigError, InputError
from ..facts import NUM_FEATURE_LAYERS
from .conv import GroupedDynamicCausalConv
from .selector import CandidateSelector

__all__ = ["DrafterConfig", "DFlashDrafter", "Attend", "layer_types_for", "drafter_rope", "apply_rope", "expand_kv",
           "draft_logits", "draft_tokens", "block_embeddings", "unary_logits", "DRAFTERS"]

DRAFTERS = ("dflash", "dflash2")
# Fields a DFlash 1 drafter does not have: left out of its to_dict, so its files and run records stay as they were.
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Target config keys that change the drafter's logits or inputs (read as the reference inference code reads them),
# and their identity values, also left out of to_dict.
_TARGET_SCALES = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
# Rope keys a drafter never takes from its target. SGLang's DFlash drafter rotates the whole head whatever its
# config says (get_rope with rotary_dim = head_dim), vLLM's honours rope_parameters' partial_rotary_factor: only a
# drafter without one runs alike in both, and so it trains with full rotary. Multimodal sections (mrope) would make
# both engines build a multimodal rotary for 1-D positions.
_TARGET_ONLY_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
# Rope types transformers, SGLang and vLLM all build for the drafter; another (Gemma 4's "proportional") becomes the
# default rotary at the target's theta.
_DRAFTER_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# A drafter's MLP width as a multiple of the hidden size when its MoE target names no dense intermediate_size
# (Qwen3.5-MoE): Qwen3-Coder-30B-A3B's own dense width is 3 x 2048.
_MOE_INTERMEDIATE_RATIO = 3

log = logging.getLogger(__name__)

# attend(layer_index, q [1, heads, Q, d], k [1, kv_heads, K, d], v [1, kv_heads, K, d]) -> [1, heads, Q, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer_types_for(num_layers: int, sliding_window: int | None, full_every: int | None) -> list[str]:
    """Return the attention type of each drafter layer: all full, or sliding with every K-th layer full."""
    if sliding_window is None or full_every is None:
        return ["full_attention"] * num_layers
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(num_layers)]


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Shape of a drafter: the target's attention geometry plus the DFlash settings (block, layer ids, mask token)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1, 9, 17, 25, 33)
    num_target_layers: int = 36
    mask_token_id: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    drafter: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(["full_attention"] * self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"drafter layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; rebuild the config with DrafterConfig.from_target"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ConfigError(f"drafter layer_types {bad} are not full_attention or sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("drafter has sliding_attention layers but no sliding_window; pass --sliding-window W")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask token id {self.mask_token_id} is outside the target vocabulary 0..{self.vocab_size - 1}; "
                "rerun `dflash extract` with --mask-token-id"
            )
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}; pass --drafter")
        if self.drafter == "dflash2":
            checks = [
                (self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
                 f"--conv-group-size {self.conv_group_size} must divide the hidden size {self.hidden_size}"),
                (1 <= self.conv_kernel_size <= self.block_size,
                 f"--conv-kernel-size {self.conv_kernel_size} must be in 1..block size {self.block_size}"),
                (self.selector_rank >= 1, f"--selector-rank must be >= 1, got {self.selector_rank}"),
                (1 <= self.selector_top_k <= self.vocab_size,
                 f"--selector-top-k {self.selector_top_k} must be in 1..vocab size {self.vocab_size}"),
            ]
            for ok, message in checks:
                if not ok:
                    raise ConfigError(message)
        # Top-K of the transformed logits must be the top-K of the raw ones (the loss finds them on the raw side).
        if not self.output_multiplier > 0:
            raise ConfigError(f"target output_multiplier must be > 0, got {self.output_multiplier}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ConfigError(f"target final_logit_softcapping must be > 0, got {self.final_logit_softcapping}")

    @classmethod
    def from_target(
        cls,
        target: str | os.PathLike | dict[str, Any],
        *,
        target_layer_ids: list[int] | tuple[int, ...],
        mask_token_id: int,
        draft_layers: int = 5,
        block_size: int = 16,
        sliding_window: int | None = None,
        full_every: int | None = None,
        drafter: str = "dflash",
        **dflash2: int,
    ) -> "DrafterConfig":
        """Return the drafter config derived from a target folder (or its config.json mapping) and DFlash options.

        dflash2: conv_kernel_size, conv_group_size, selector_rank, selector_top_k (for drafter "dflash2").
        """
        cfg = _read_target_config(target) if not isinstance(target, dict) else target
        cfg = cfg.get("text_config", cfg)  # multimodal targets keep the language model's fields nested
        scales = {k: cfg[k] for k in _TARGET_SCALES if cfg.get(k) is not None}
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            intermediate = cfg.get("intermediate_size") or _MOE_INTERMEDIATE_RATIO * hidden
            return cls(
                hidden_size=hidden,
                intermediate_size=int(intermediate),
                num_hidden_layers=draft_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_parameters=drafter_rope(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
                hidden_act=str(cfg.get("hidden_act", "silu")),
                block_size=block_size,
                target_layer_ids=tuple(target_layer_ids),
                num_target_layers=int(cfg["num_hidden_layers"]),
                mask_token_id=mask_token_id,
                layer_types=tuple(layer_types_for(draft_layers, sliding_window, full_every)),
                sliding_window=sliding_window if full_every else None,
                drafter=drafter,
                **(dflash2 if drafter == "dflash2" else {}),
                **scales,
            )
        except KeyError as e:
            raise InputError(f"target config {target if not isinstance(target, dict) else '<dict>'} has no {e}; "
                             "expected a Hugging Face decoder config.json") from None

    def to_dict(self) -> dict[str, Any]:
        """Return the config as JSON-able values (a DFlash 1 drafter's without the fields it does not use)."""
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        drop = [k for k, v in _TARGET_SCALES.items() if out[k] == v]
        if self.drafter == "dflash":
            drop += ["drafter", *_DFLASH2_FIELDS]
        return {k: v for k, v in out.items() if k not in drop}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DrafterConfig":
        """Return the config stored by `to_dict`; unknown keys are refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"drafter config has unknown field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)

    def qwen3_config(self) -> Qwen3Config:
        """Return the transformers Qwen3Config of the drafter's layers (what the exported config.json extends)."""
        sliding = "sliding_attention" in self.layer_types
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            use_sliding_window=sliding,
            sliding_window=self.sliding_window,
            max_window_layers=self.num_hidden_layers,
            layer_types=list(self.layer_types),
            tie_word_embeddings=False,
        )


def drafter_rope(target: dict[str, Any]) -> dict[str, Any]:
    """Return the rope parameters of a drafter for a target's (text) config.json mapping: the target's rope, flat
    (the full-attention layers' where it has one per layer type, as Gemma does), with full rotary."""
    rope = target.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": float(target.get("rope_theta", 10000.0)),
        **(target.get("rope_scaling") or {}),
    }
    if "rope_theta" not in rope and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    rope = {k: v for k, v in rope.items() if k not in _TARGET_ONLY_ROPE}
    if rope.get("rope_type", rope.get("type", "default")) not in _DRAFTER_ROPE_TYPES:
        rope = {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))}
    return rope


def _read_target_config(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{file}: cannot read the target's config ({e}); pass --target a Hugging Face folder") from None


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
