"""Loss masks are exactly the assistant turns' tokens (content + end-of-turn marker) on ChatML and Llama-3 templates."""
from __future__ import annotations

import numpy as np
import pytest

from dflash.conversations import normalise
from dflash.extract.template import ChatEncoder, TemplateError, load_template
from dflash.tests.tiny_targets import build_tokenizer

CONVERSATIONS = {
    "messages": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6, and the newline\nstays."},
        ]
    },
    "sharegpt": {"conversations": [{"from": "human", "value": "name a colour"}, {"from": "gpt", "value": "teal"}]},
    "alpaca": {"instruction": "Reverse", "input": "abc", "output": "cba"},
}


def _segments(style: str, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """Return the rendered text as (piece, is_loss) pieces, written independently of the template engine."""
    out: list[tuple[str, bool]] = []
    if style == "chatml":
        for m in messages:
            out.append((f"<|im_start|>{m['role']}\n", False))
            is_a = m["role"] == "assistant"
            out += [(m["content"] + "<|im_end|>", is_a), ("\n", False)]
    else:
        out.append(("<|begin_of_text|>", False))
        for m in messages:
            out.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
            out.append((m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"))
    return out


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("shape", sorted(CONVERSATIONS))
def test_loss_mask_is_exactly_the_assistant_turns(style, shape):
    tok = build_tokenizer(style)
    messages = normalise(CONVERSATIONS[shape])[0]
    enc = ChatEncoder(tok, tok.chat_template, max_length=10_000).encode(messages)
    want_ids: list[int] = []
    want_mask: list[bool] = []
    for piece, loss in _segments(style, messages):
        ids = tok(piece, add_special_tokens=False)["input_ids"]
        want_ids += ids
        want_mask += [loss] * len(ids)
    assert enc.input_ids.tolist() == want_ids
    assert enc.loss_mask.tolist() == want_mask
    assert enc.input_ids.dtype == np.int32 and enc.loss_mask.dtype == np.bool_


def test_truncation_keeps_the_prefix():
    tok = build_tokenizer("chatml")
    messages = normalise(CONVERSATIONS["messages"])[0]
    full = ChatEncoder(tok, tok.chat_template, max_length=10_000).encode(messages)
    cut = ChatEncoder(tok, tok.chat_template, max_length=40).encode(messages)
    assert len(cut.input_ids) == 40
    assert cut.input_ids.tolist() == full.input_ids[:40].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:40].tolist()


def test_template_that_rewrites_content_falls_back_to_locating_it():
    # A template that upper-cases history would break prefix rendering; content search still finds the turn.
    tok = build_tokenizer("chatml")
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
    )
    messages = normalise(CONVERSATIONS["sharegpt"])[0]
    enc = ChatEncoder(tok, template, max_length=10_000).encode(messages)
    assert tok.decode(enc.input_ids[enc.loss_mask].tolist()) == "teal<|im_end|>"


def test_template_errors_and_missing_template():
    tok = build_tokenizer("chatml")
    bad = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatEncoder(tok, bad, 100).encode(normalise(CONVERSATIONS["alpaca"])[0])
    tok.chat_template = None
    from dflash.errors import InputError

    with pytest.raises(InputError, match="--chat-template"):
        load_template(tok, None)
