"""Tiny random Qwen3 and Llama targets with a real tokenizer and chat template, built offline in seconds.

Used by the tests and by the benchmarks (which build random-init targets of real sizes from a config).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CHATML_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "build_tokenizer",
    "build_tiny_target",
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

    arch "qwen3" uses the ChatML template and a vocabulary `spare_vocab` rows larger than the tokenizer (so the
    DFlash mask token is the first unused row, as on Qwen3); arch "llama" uses a Llama-3-style template.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    path = Path(path)
    tokenizer = build_tokenizer("chatml" if arch == "qwen3" else "llama3")
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
    if arch == "qwen3":
        config = Qwen3Config(head_dim=hidden_size // heads, rope_theta=1000000.0, **common)
    elif arch == "llama":
        config = LlamaConfig(rope_theta=500000.0, **common)
    else:
        raise ValueError(f"unknown arch {arch!r}; use qwen3 or llama")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # Random init at std 0.02 makes every layer nearly the identity; larger weights make layers distinguishable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" not in name else 1.0)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
