"""Loading the target model: one Hugging Face causal LM loader for extract, generate and decoding."""
from __future__ import annotations

import os
from typing import Any

from .errors import InputError

__all__ = ["load_target"]


def load_target(path: str | os.PathLike, *, device: Any = "cpu", dtype: Any = "float32",
                attn_implementation: str | None = None, option: str = "--model") -> Any:
    """Return the target causal LM of a Hugging Face folder in eval mode on `device` in `dtype` ("auto": the
    folder's own); a folder that is not one is an InputError naming `option`.

    On CUDA the weights load straight onto the GPU (not through host memory) where accelerate allows it.
    """
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    kwargs: dict[str, Any] = {"dtype": dtype if dtype == "auto" or not isinstance(dtype, str) else getattr(torch, dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device.type == "cuda":
        kwargs["device_map"] = {"": device.index or 0}
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(os.fspath(path), **kwargs)
        except ImportError:  # device_map needs accelerate on some transformers versions: load via host memory
            kwargs.pop("device_map", None)
            model = AutoModelForCausalLM.from_pretrained(os.fspath(path), **kwargs)
    except (OSError, ValueError, SafetensorError) as e:  # a folder without weights, broken weights
        raise InputError(
            f"{option} {path}: expected a Hugging Face causal LM folder (config.json + weights), "
            f"loading failed with {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None
    return model.to(device).eval()
