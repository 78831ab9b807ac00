"""The target's embedding and lm_head, read from its safetensors files alone (never loading the whole target)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from ..errors import InputError
from .load import check_finite

__all__ = ["TargetHead", "load_target_head"]

log = logging.getLogger(__name__)

_EMBED_SUFFIX = "embed_tokens.weight"
_HEAD_SUFFIX = "lm_head.weight"


@dataclass(frozen=True)
class TargetHead:
    """The frozen target tensors the drafter borrows: embed [V, H], lm_head [V, H] (the same tensor when tied)."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    tied: bool


def _weight_map(folder: str) -> dict[str, str]:
    """Return {tensor name: file} of a Hugging Face folder, through its index when it has one."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                return dict(json.load(f)["weight_map"])
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"{index}: not a safetensors index ({e}); re-download the target folder") from None
    from safetensors import safe_open

    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not files:
        raise InputError(
            f"{folder}: expected model.safetensors or model.safetensors.index.json, found neither; "
            "pass --target a Hugging Face model folder saved with safetensors"
        )
    out: dict[str, str] = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            out.update({k: name for k in f.keys()})
    return out


def _pick(names: list[str], suffix: str) -> str | None:
    """Return the language model's tensor ending in suffix (the shortest name: multimodal towers nest deeper)."""
    hits = sorted((n for n in names if n.endswith(suffix) and "vision" not in n and "visual" not in n), key=len)
    return hits[0] if hits else None


def load_target_head(
    target: str | os.PathLike, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> TargetHead:
    """Return the target's embedding and lm_head, read tensor by tensor from its safetensors files.

    A target without an lm_head tensor must declare tie_word_embeddings (then lm_head is the embedding).
    """
    from safetensors import safe_open

    folder = os.fspath(target)
    wmap = _weight_map(folder)
    embed_name = _pick(list(wmap), _EMBED_SUFFIX)
    if embed_name is None:
        raise InputError(
            f"{folder}: expected a tensor named like model.embed_tokens.weight in the safetensors files, found none "
            f"among {len(wmap)} tensors; pass --target the target model folder the store was extracted from"
        )
    head_name = _pick(list(wmap), _HEAD_SUFFIX)
    tie = _declares_tied(folder)
    if head_name is None and not tie:
        raise InputError(
            f"{folder}: no lm_head.weight tensor and config.json does not set tie_word_embeddings; "
            "the folder is incomplete, re-download the target"
        )

    want = _head_shape(folder)

    def read(name: str) -> torch.Tensor:
        with safe_open(os.path.join(folder, wmap[name]), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        if want is not None and tuple(t.shape) != want:
            raise InputError(f"--target {folder}: expected tensor {name} of shape {list(want)} (vocab_size, "
                             f"hidden_size of its config.json), found {list(t.shape)} in {wmap[name]}; re-download "
                             "or re-save the model's weights")
        check_finite([(name, t)], folder, "--target")
        return t.to(device=device, dtype=dtype or t.dtype)

    embed = read(embed_name)
    if head_name is None:
        log.info("%s has tied embeddings: the lm_head is the embedding matrix", folder)
        return TargetHead(embed=embed, lm_head=embed, tied=True)
    head = read(head_name)
    if head.shape != embed.shape:
        raise InputError(
            f"{folder}: lm_head {tuple(head.shape)} and embedding {tuple(embed.shape)} differ in shape; "
            "expected both [vocab, hidden]"
        )
    return TargetHead(embed=embed, lm_head=head, tied=False)


def _head_shape(folder: str) -> tuple[int, int] | None:
    """Return (vocab_size, hidden_size) of the target's (text) config, None where it does not say."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab, hidden = text.get("vocab_size", cfg.get("vocab_size")), text.get("hidden_size", cfg.get("hidden_size"))
    return (int(vocab), int(hidden)) if isinstance(vocab, int) and isinstance(hidden, int) else None


def _declares_tied(folder: str) -> bool:
    """Return the target config's tie_word_embeddings (transformers' default True when absent)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", True)))
