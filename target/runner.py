"""The truncated target runner: embedding, rotary and the first k decoder layers, returning DFlash features."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..errors import InputError
from .adapter import decoder_base

__all__ = ["TargetRunner", "attention_backends", "pad_batch"]

log = logging.getLogger(__name__)


def attention_backends(device: torch.device, cudnn: bool = False) -> Any:
    """Return a context in which SDPA may pick any kernel but cuDNN's on CUDA (unless cudnn), else no context.

    On Hopper torch prefers cuDNN's attention, which builds and caches an execution plan for each new (batch, length)
    shape. Extraction's batches are packed to their samples' lengths, so nearly every batch is a new shape: on one
    H200 a first pass over a short real run's 163 batches took 23.0 s against 15.1 s for a second pass over the same
    batches, and leaving cuDNN out took the command from 21,775 to 29,693 tok/s (bench/RESULTS.md, issue 22). Flash
    and memory-efficient attention keep no per-shape state, and attention is a few percent of these forwards.
    The flags it sets are torch's process-wide ones, restored on exit: in extract only the forward's thread runs SDPA.
    """
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class TargetRunner:
    """Runs the target only up to its last captured layer (no later layers, no final norm, no lm_head).

    Rows are right-padded, so with plain causal attention a real token never sees padding: no attention mask is
    needed, which keeps sdpa on its fused causal kernels. The feature of layer id i is decoder layer i's output,
    i.e. the full model's output_hidden_states[i + 1].
    """

    def __init__(self, model: Any, layer_ids: list[int], *, check: bool = True, cudnn_attention: bool = False) -> None:
        base = decoder_base(model, getattr(getattr(model, "config", None), "_name_or_path", "") or "the target")
        cfg = base.config
        self.layer_ids = list(layer_ids)
        self.depth = max(self.layer_ids) + 1
        self.cudnn_attention = cudnn_attention  # see attention_backends(); the benchmark compares both
        types = list(getattr(cfg, "layer_types", None) or [])[: self.depth]
        if any(t != "full_attention" for t in types):
            raise InputError(
                f"target {cfg.model_type}: layers {types} include sliding-window attention, which the truncated "
                "runner does not mask; use a full-attention target (Qwen3, Llama) or open an issue"
            )
        self.base = base
        if check:
            self._self_check(model, base)
        # Drop what extract never runs, so its memory is free for bigger batches.
        base.layers = base.layers[: self.depth]
        if hasattr(model, "lm_head"):
            model.lm_head = None
        base.norm = None
        self.hidden_size = int(cfg.hidden_size)
        self.device = base.embed_tokens.weight.device
        self.dtype = base.embed_tokens.weight.dtype

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Return the outputs [B, S, H] of the captured decoder layers for right-padded input_ids [B, S]."""
        base = self.base
        h = base.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        rope = base.rotary_emb(h, pos)
        wanted = set(self.layer_ids)
        out: list[torch.Tensor] = []
        with attention_backends(input_ids.device, self.cudnn_attention):
            for j in range(self.depth):
                h = base.layers[j](h, attention_mask=None, position_ids=pos, position_embeddings=rope)
                if isinstance(h, tuple):  # older transformers return (hidden, attn_weights)
                    h = h[0]
                if j in wanted:
                    out.append(h)
        return out

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Return the real tokens' features [sum(lengths), L, H] in bf16, padding removed, rows in order."""
        B, S = input_ids.shape
        caps = self.hidden(input_ids)
        idx = torch.cat([torch.arange(n, device=input_ids.device) + b * S for b, n in enumerate(lengths)])
        feats = torch.stack([c.reshape(B * S, -1).index_select(0, idx) for c in caps], dim=1)
        return feats.to(torch.bfloat16)

    def _self_check(self, model: Any, base: Any) -> None:
        """Compare this runner with the full model's output_hidden_states on a few tokens; refuse on mismatch."""
        gen = torch.Generator().manual_seed(0)
        vocab = int(base.config.vocab_size)
        ids = torch.randint(0, vocab, (1, 12), generator=gen).to(base.embed_tokens.weight.device)
        # The reference takes the attention kernels the runner takes: this checks layers and positions, not kernels.
        with torch.inference_mode(), attention_backends(ids.device, self.cudnn_attention):
            ref = base(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
            ours = self.hidden(ids)
        for i, got in zip(self.layer_ids, ours):
            want = ref[i + 1]
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item() + 1e-6
            if not err <= 2e-2 * scale:
                raise InputError(
                    f"target {base.config.model_type}: the truncated runner's layer {i} differs from "
                    f"output_hidden_states[{i + 1}] by {err:.3g} (scale {scale:.3g}); this architecture is not "
                    "supported by dflash extract"
                )


def pad_batch(samples: list[Any], pad_id: int) -> tuple[torch.Tensor, list[int]]:
    """Return right-padded int64 ids [B, max_len] of the samples' input_ids, and their lengths."""
    lengths = [len(s) for s in samples]
    out = torch.full((len(samples), max(lengths)), pad_id, dtype=torch.long)
    for b, s in enumerate(samples):
        out[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out, lengths
