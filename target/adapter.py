"""The architecture adapter: which decoder stack of a causal LM dflash runs, and whether it can run it."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError

__all__ = ["SUPPORTED", "decoder_base", "check_architecture"]

SUPPORTED = "decoder-only transformers with rotary embeddings (Llama, Qwen2, Qwen3, Mistral and their kin)"


def decoder_base(model: Any, where: str) -> Any:
    """Return the decoder stack (embed_tokens, layers, rotary_emb) of a causal LM; InputError naming what is
    supported when the model has none (an encoder such as BERT, an encoder-decoder, another layout)."""
    base = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
    missing = [n for n in ("embed_tokens", "layers", "rotary_emb") if not hasattr(base, n)]
    if missing:
        cfg = getattr(model, "config", None)
        kind = f"{getattr(cfg, 'model_type', '?')} model ({type(model).__name__})"
        raise InputError(
            f"--model {where}: expected a decoder-only causal LM, found a {kind} without {', '.join(missing)}; "
            f"dflash extract supports {SUPPORTED}"
        )
    return base


def check_architecture(model_config: Any, where: str) -> None:
    """Raise InputError unless the config builds a model dflash can run and the folder's weights are that model's
    (both checked on the meta device: no tensor data is read)."""
    from transformers import AutoModelForCausalLM

    if getattr(model_config, "is_encoder_decoder", False):
        raise InputError(f"--model {where}: expected a decoder-only causal LM, found an encoder-decoder "
                         f"{model_config.model_type} model; dflash extract supports {SUPPORTED}")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its advice for the model it builds here is not the user's business
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except (ValueError, KeyError) as e:
        raise InputError(f"--model {where}: transformers builds no causal LM from its {model_config.model_type} "
                         f"config ({str(e).splitlines()[0][:160]}); dflash extract supports {SUPPORTED}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    decoder_base(model, where)
    from .load import check_weights

    check_weights(where)
