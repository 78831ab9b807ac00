"""Chat rendering and exact loss masks: which tokens of a rendered conversation are the assistant's to predict."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = ["Encoded", "TemplateError", "ChatEncoder", "load_template", "text_hash"]

log = logging.getLogger(__name__)


class TemplateError(Exception):
    """The template could not render one conversation (a bad row, not a bad run)."""


@dataclass(frozen=True)
class Encoded:
    """Token ids (int32) and loss mask (bool) of one conversation, already truncated to the max length."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    cut_tokens: int = 0  # tokens past max_length that were cut off

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def text_hash(text: str) -> str:
    """Return a short sha256 hex digest of a text (template, tokenizer JSON) for the store header."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def load_template(tokenizer: Any, template_file: str | None) -> str:
    """Return the Jinja chat template to use: `--chat-template FILE` if given, else the tokenizer's own."""
    if template_file:
        try:
            return Path(template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"--chat-template {template_file}: cannot read it ({e.strerror}); check the path") from None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # some tokenizers carry several named templates
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise InputError(
            "the target's tokenizer has no chat template (expected chat_template in tokenizer_config.json or "
            "chat_template.jinja); pass --chat-template FILE"
        )
    return template


class ChatEncoder:
    """Renders messages with a chat template and marks the assistant tokens (content and end-of-turn marker)."""

    def __init__(self, tokenizer: Any, template: str, max_length: int,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.max_length = max_length
        # --chat-template-kwargs: the variables the serving engine renders with (Qwen3's enable_thinking, ...).
        self.template_kwargs = dict(template_kwargs or {})
        eos = getattr(tokenizer, "eos_token", None)
        self._eos = eos if isinstance(eos, str) and eos else None

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        """Return the template's text for the messages (optionally ending with the assistant header)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt,
                **self.template_kwargs,
            )
        except Exception as e:  # Jinja raises its own errors (raise_exception for role order, ...)
            raise TemplateError(f"{type(e).__name__}: {e}".replace("\n", " ")[:200]) from None

    def assistant_spans(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Return the character spans of the assistant turns in `text`: content through end-of-turn marker.

        The span of turn i is what rendering messages[:i+1] adds to messages[:i] with the generation prompt,
        i.e. the template's own idea of the assistant's part, minus trailing whitespace (the newline ChatML puts
        after <|im_end|> is layout, not something the drafter should learn to predict at a block boundary).
        Templates whose history renders differently from its prefixes (Qwen3 strips past reasoning) fall back to
        locating the content and the eos marker that follows it.
        """
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._head(messages[:i])
            upto = self.render(messages[: i + 1])
            if upto.startswith(head) and text.startswith(upto) and len(head) >= cursor:
                start, end = len(head), len(upto.rstrip())
            else:
                start, end = self._locate(text, m["content"], cursor)
            if end > start:
                spans.append((start, end))
            cursor = max(cursor, end)
        return spans

    def _head(self, before: list[dict[str, str]]) -> str:
        try:
            return self.render(before, generation_prompt=True)
        except TemplateError:
            if before:
                raise
            return ""  # some templates refuse an empty conversation; then the turn simply starts the text

    def _locate(self, text: str, content: str, cursor: int) -> tuple[int, int]:
        body = content.strip()
        start = text.find(body, cursor)
        if start < 0:
            raise TemplateError("the template changes the assistant content, so its tokens cannot be located")
        end = start + len(body)
        if self._eos:
            nxt = text.find(self._eos, end)
            if nxt >= 0 and not text[end:nxt].strip():
                end = nxt + len(self._eos)
        return start, end

    def encode(self, messages: list[dict[str, str]]) -> Encoded:
        """Return the token ids and loss mask of a conversation, truncated to max_length tokens."""
        text = self.render(messages)
        spans = self.assistant_spans(messages, text)
        # The template writes BOS itself where it wants one; letting the tokenizer add another would double it.
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        full = len(enc["input_ids"])
        ids = np.asarray(enc["input_ids"], dtype=np.int32)[: self.max_length]
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)[: self.max_length]
        mask = np.zeros(len(ids), dtype=bool)
        for s, e in spans:
            # A token belongs to the turn where it starts (byte-level BPE never merges across special tokens).
            mask |= (starts >= s) & (starts < e)
        return Encoded(ids, mask, max(0, full - self.max_length))
