"""The architecture adapter: the text decoder stack inside a causal LM or a multimodal wrapper, its config, its layer
kinds and windows, and the attention implementation that runs it exactly."""
from __future__ import annotations

from typing import Any

from ..errors import InputError

__all__ = ["SUPPORTED", "KINDS", "text_config", "text_model", "layer_kinds", "longest_window", "unequal_head_dims",
           "attention_for",
           "linear_attention_path", "check_architecture"]

SUPPORTED = ("decoder-only transformers whose layers are full, sliding-window or linear (Gated DeltaNet) attention: "
             "Llama, Qwen3, Qwen3-MoE, Qwen3.5/3.6, Qwen3-Next, gpt-oss, Gemma 3/4, Mistral, DeepSeek-V3 and their kin")
# The layer kinds (transformers' layer_types) extraction runs through the model's own forward and verifies.
KINDS = ("full_attention", "sliding_attention", "linear_attention")
# Where a multimodal wrapper keeps its language model (Gemma 4, Qwen3.5 loaded as the wrapper), then plain LMs.
_TEXT_MODEL_PATHS = ("model.language_model", "language_model", "model")


def text_config(config: Any) -> Any:
    """Return the config of the text decoder: the `text_config` of a multimodal wrapper, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def text_model(model: Any, where: str = "the target") -> Any:
    """Return the text decoder stack (embed_tokens, layers) of a causal LM or of the language model inside a
    multimodal wrapper; InputError naming what is supported when there is none (an encoder, an encoder-decoder)."""
    for path in _TEXT_MODEL_PATHS:
        found = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if found is not None and hasattr(found, "layers") and hasattr(found, "embed_tokens"):
            return found
    if hasattr(model, "layers") and hasattr(model, "embed_tokens"):
        return model
    cfg = getattr(model, "config", None)
    raise InputError(
        f"--model {where}: expected a decoder-only causal LM, found a {getattr(cfg, 'model_type', '?')} model "
        f"({type(model).__name__}) without a decoder stack (embed_tokens, layers); dflash extract supports {SUPPORTED}"
    )


def layer_kinds(config: Any) -> list[str]:
    """Return the kind of every decoder layer of a text config: its layer_types, else sliding_attention throughout
    when it sets a global sliding_window (Mistral), else full_attention."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [])
    if types:
        return types[:n]
    uses = getattr(config, "use_sliding_window", True)  # Qwen2-style configs carry a window they do not use
    return ["sliding_attention" if getattr(config, "sliding_window", None) and uses else "full_attention"] * n


def longest_window(config: Any, kinds: list[str]) -> int:
    """Return the longest attention window among `kinds` (0 when none of them slides)."""
    if "sliding_attention" not in kinds:
        return 0
    return int(getattr(config, "sliding_window", None) or 0)


def unequal_head_dims(config: Any) -> bool:
    """Return True where the attention's query-key head dim differs from its value head dim (MLA: DeepSeek-V3, Kimi
    K2), which SDPA's flash kernel does not take (SDPA runs its memory-efficient kernel there)."""
    cfg = text_config(config)
    qk = getattr(cfg, "qk_head_dim", None) or (
        (getattr(cfg, "qk_nope_head_dim", None) or 0) + (getattr(cfg, "qk_rope_head_dim", None) or 0))
    v = getattr(cfg, "v_head_dim", None)
    return bool(qk and v and int(qk) != int(v))


def attention_for(model_config: Any, device: Any) -> str:
    """Return the attention implementation extraction loads the target with: the first kernels.attention_order
    gives for its class, layer kinds and device (the runner's self-check then keeps it only if it is exact)."""
    from .kernels import attention_order

    cls = _causal_lm_class(model_config)
    owner = cls if cls is not None else object()
    return attention_order(owner, layer_kinds(text_config(model_config)), device, model_config)[0]


def linear_attention_path() -> str | None:
    """Return the flash-linear-attention version whose kernels transformers' Gated DeltaNet layers run, or None
    when they run transformers' torch fallback (the package is not importable)."""
    from importlib import metadata, util

    if util.find_spec("fla") is None:
        return None
    try:
        return metadata.version("flash-linear-attention")
    except metadata.PackageNotFoundError:
        return "unknown version"


def _causal_lm_class(model_config: Any) -> Any:
    """Return the class AutoModelForCausalLM builds for a config (None when it builds none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:
        return None


def check_architecture(model_config: Any, where: str, depth: int | None = None) -> None:
    """Raise InputError unless the config builds a model dflash can run, with layer kinds it runs exactly in the
    first `depth` layers (all when None), and the folder's weights are that model's (both checked on the meta
    device: no tensor data is read)."""
    import torch
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
    text = text_model(model, where)
    kinds = layer_kinds(text.config)[:depth]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise InputError(
            f"--model {where}: {model_config.model_type} has {', '.join(unknown)} layers within the captured ones, "
            f"which dflash extract cannot verify against the full model (it runs {', '.join(KINDS)}); "
            "open an issue with the model's config.json"
        )
    from .weights import check_weights

    check_weights(where)
