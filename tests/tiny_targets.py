"""Tiny random targets of every model type dflash supports, with a real tokenizer and chat template, built offline in
seconds.

Used by the tests and by the benchmarks (which build random-init targets of real sizes from a config).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "CHATML_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "build_tokenizer",
    "build_tiny_target",
    "TINY_ARCHS",
    "TINY_WINDOW",
    "QWEN3_8B_CONFIG",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# The shape of Qwen3-8B (random weights are all the benchmarks can have: nothing is downloaded).
QWEN3_8B_CONFIG = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)


def build_tokenizer(style: str = "chatml"):
    """Return a byte-level BPE PreTrainedTokenizerFast with the special tokens and chat template of a style.

    style "chatml" (Qwen3 / SmolLM2: <|im_start|>, <|im_end|>) or "llama3" (<|begin_of_text|>, <|eot_id|>, headers).
    Every byte is one token, so any text round-trips; no merges are trained, so building takes milliseconds.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if style == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        kwargs = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
        template = CHATML_TEMPLATE
    elif style == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        kwargs = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
        template = LLAMA3_TEMPLATE
    else:
        raise ValueError(f"unknown tokenizer style {style!r}; use chatml or llama3")
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.chat_template = template
    return fast


# The model types `build_tiny_target` builds, each saved in the class its real checkpoints carry (a multimodal
# wrapper where they ship as one). The mixed kinds sit within the first 5 layers, which extraction covers.
TINY_ARCHS = ("qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma3_text",
              "gemma4", "gemma4_large", "mistral", "deepseek_v3")
TINY_WINDOW = 8  # the sliding window of the tiny sliding targets: shorter than their test samples
_HYBRID = ["linear_attention", "linear_attention", "full_attention"]
_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def _layer_types(pattern: list[str], n: int) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(n)]


def _tiny_config(arch: str, common: dict, heads: int, n: int) -> Any:
    """Return the transformers config of a tiny target of one model type (common: the fields every type shares)."""
    import transformers as tf

    hidden, head_dim = common["hidden_size"], common["hidden_size"] // heads
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                  linear_num_key_heads=2, linear_num_value_heads=4, head_dim=head_dim,
                  layer_types=_layer_types(_HYBRID, n))
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=head_dim, rope_theta=1000000.0, **common)
    if arch == "llama":
        return tf.LlamaConfig(rope_theta=500000.0, **common)
    if arch == "mistral":
        return tf.MistralConfig(head_dim=head_dim, sliding_window=TINY_WINDOW, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(head_dim=head_dim, decoder_sparse_step=1, **moe, **common)
    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(partial_rotary_factor=0.25, shared_expert_intermediate_size=hidden, **moe,
                                  **linear, **common)
    if arch == "gpt_oss":
        common = {**common, "intermediate_size": hidden}
        return tf.GptOssConfig(head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=TINY_WINDOW, layer_types=_layer_types(_SLIDING, n), **common)
    if arch == "gemma3_text":
        return tf.Gemma3TextConfig(head_dim=head_dim, sliding_window=TINY_WINDOW,
                                   layer_types=_layer_types(_SLIDING, n), **common)
    if arch == "deepseek_v3":
        # As many key/value heads as query heads, as DeepSeek-V3's own config has: MLA expands its latent into
        # every head, and transformers 5.24 repeats them again by the group count when there are fewer (a cached
        # forward of several tokens then fails on shapes).
        # Query-key heads wider than the value heads (24 against 16, as 192 against 128 in DeepSeek-V3): SDPA's flash
        # kernel does not take them, so a GPU run takes cuDNN's (targets/attention.py).
        mla = {**common, "num_key_value_heads": common["num_attention_heads"]}
        return tf.DeepseekV3Config(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=head_dim, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                   topk_group=1, first_k_dense_replace=1, moe_intermediate_size=hidden, **mla)
    text = {k: v for k, v in common.items() if k not in ("tie_word_embeddings",)}
    tie = common["tie_word_embeddings"]
    if arch in ("qwen3_5", "qwen3_5_moe"):
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                      patch_size=4, num_position_embeddings=16)
        if arch == "qwen3_5":
            text_cfg = dict(partial_rotary_factor=0.25, **linear, **text)
            return tf.Qwen3_5Config(text_config=text_cfg, vision_config=vision, tie_word_embeddings=tie)
        text = {k: v for k, v in text.items() if k != "intermediate_size"}  # its text config has none
        text_cfg = dict(partial_rotary_factor=0.25, shared_expert_intermediate_size=hidden, **moe, **linear, **text)
        return tf.Qwen3_5MoeConfig(text_config=text_cfg, vision_config=vision, tie_word_embeddings=tie)
    if arch == "gemma4":
        text_cfg = dict(head_dim=head_dim, sliding_window=TINY_WINDOW, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=common["vocab_size"], num_kv_shared_layers=2,
                        layer_types=_layer_types(_SLIDING, n), **text)
        return tf.Gemma4Config(text_config=text_cfg, vision_config=None, audio_config=None, tie_word_embeddings=tie)
    if arch == "gemma4_large":  # as Gemma 4's larger sizes: no per-layer inputs, no KV sharing, wider global heads
        text_cfg = dict(head_dim=head_dim, global_head_dim=2 * head_dim, sliding_window=TINY_WINDOW,
                        hidden_size_per_layer_input=0, num_kv_shared_layers=0, layer_types=_layer_types(_SLIDING, n),
                        **text)
        return tf.Gemma4Config(text_config=text_cfg, vision_config=None, audio_config=None, tie_word_embeddings=tie)
    raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(TINY_ARCHS)}")


def build_tiny_target(
    path: str | os.PathLike,
    arch: str = "qwen3",
    *,
    num_layers: int = 8,
    hidden_size: int = 64,
    spare_vocab: int = 16,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Save a tiny random target (model + tokenizer + chat template) as a Hugging Face folder and return its path.

    arch: one of TINY_ARCHS, saved in the class its real checkpoints carry (Qwen3.5 and Gemma 4 as their multimodal
    wrappers). "llama" uses a Llama-3-style template, the others ChatML, with a vocabulary `spare_vocab` rows larger
    than the tokenizer (so the DFlash mask token is the first unused row, as on Qwen3).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer("llama3" if arch == "llama" else "chatml")
    n_tok = len(tokenizer)
    heads = max(2, hidden_size // 16)
    common = dict(
        vocab_size=n_tok + spare_vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = _tiny_config(arch, common, heads, num_layers)
    torch.manual_seed(seed)
    if getattr(config, "text_config", None) is not None:  # a multimodal wrapper: saved as its own class
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # Random init at std 0.02 makes every layer nearly the identity; larger weights make layers distinguishable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "visual" not in name:
                p.normal_(0.0, 0.2 if "embed" not in name else 1.0)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
