"""The modeling file an export carries for `trust_remote_code` loading (written by `dflash export --remote-code`).

The file is self-contained (torch + transformers only) and follows the interface DFlash inference calls:
`model(target_hidden=, noise_embedding=, position_ids=, past_key_values=, use_cache=)` returns the final-normed
hidden states of the block; `compute_logits(hidden, lm_head)`; `block_size`, `mask_token_id`, `target_layer_ids`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

__all__ = ["MODELING_FILE", "write_modeling_file"]

log = logging.getLogger(__name__)

MODELING_FILE = "modeling_dflash.py"

_SOURCE = '''"""DFlash drafter for transformers (trust_remote_code), written by `dflash export`."""
import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        kind = (config.layer_types or ["full_attention"] * config.num_hidden_layers)[layer_idx]
        self.window = config.sliding_window if kind == "sliding_attention" else None

    def forward(self, x, ctx, cos, sin, cache):
        b, n, _ = x.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, d)).transpose(1, 2)
        k = self.k_norm(torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, -1, self.kv_heads, d)).transpose(1, 2)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, -1, self.kv_heads, d).transpose(1, 2)
        q, k = _rope(q, cos[:, None, -n:], sin[:, None, -n:]), _rope(k, cos[:, None], sin[:, None])
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = None
        if self.window is not None:  # keys are every position from 0 once the cache holds the context
            kpos = torch.arange(k.shape[2], device=x.device)
            qpos = kpos[-n:]
            mask = ((qpos[:, None] - kpos[None]).abs() < self.window)[None, None]
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", {}) or {}
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash["mask_token_id"]
        self.block_size = int(getattr(config, "block_size", 16))
        self.layers = nn.ModuleList([DFlashLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids, noise_embedding, target_hidden, past_key_values=None, use_cache=False,
                attention_mask=None, **kwargs):
        """Return the normed hidden states [b, block, H] of the block tokens.

        position_ids cover [new context ; block]; target_hidden [b, new context, n*H] are the target features
        not yet in past_key_values.
        """
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden.to(x.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, cache)
        return self.norm(x)

    def compute_logits(self, hidden, output_head):
        return output_head(hidden)
'''


def write_modeling_file(out: Path, write: Callable[[Path, bytes], None]) -> Path:
    """Write modeling_dflash.py into an export folder with `write` (an atomic writer); return its path."""
    path = Path(out) / MODELING_FILE
    write(path, _SOURCE.encode())
    return path
