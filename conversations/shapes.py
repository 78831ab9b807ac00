"""Each row's shape read as chat messages: OpenAI `messages`, ShareGPT `conversations` (`from`/`value`), Alpaca
`instruction`/`output`, `{"prompt"}`, or a bare string (a prompt); a row that has none is a BadRow with its reason."""
from __future__ import annotations

import json
from typing import Any

from .messages import ROLES, SHAREGPT_ROLES, message

__all__ = ["NEEDS", "EMPTY_TURNS", "BadRow", "normalise", "prompt_turns"]

# What a row needs to be usable: a conversation to train on has an assistant turn; a prompt has a user turn.
NEEDS = ("assistant", "user")
EMPTY_TURNS = "empty_turns_skipped"


class BadRow(Exception):
    """Why a row cannot be used: a reason (counted by BadRowLog) and a detail (shown)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _text(value: Any, what: str) -> str | None:
    """Return a turn's text ('' when it has none), or raise BadRow for content that is not text."""
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts: text parts are joined, anything else is not text
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(value) or not all(isinstance(t, str) for t in texts):
            raise BadRow("non_text_content", f"{what} holds non-text parts")
        return "".join(texts)
    if not isinstance(value, str):
        raise BadRow("non_string_content", f"{what} is {type(value).__name__}, expected a string")
    return value


def _turns(rec: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """Return the (role, text) turns of a messages/conversations record and the roles of the empty turns skipped."""
    sharegpt = "messages" not in rec
    turns = rec["conversations"] if sharegpt else rec["messages"]
    if isinstance(turns, str):
        # Parquet and CSV exports often hold the turns as one JSON string column: read it as the list it is.
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as e:
            raise BadRow("unknown_shape", f"messages/conversations is a string but not JSON ({e.msg})") from None
    if not isinstance(turns, list) or not turns:
        raise BadRow("unknown_shape", "messages/conversations is not a non-empty list")
    out: list[tuple[str, str]] = []
    empty: list[str] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow("unknown_shape", f"turn {k} is a {type(turn).__name__}, expected an object")
        if "role" not in turn and "from" in turn:
            raw_role, content = turn.get("from"), turn.get("value")
            role = SHAREGPT_ROLES.get(str(raw_role).lower())
        else:
            raw_role, content = turn.get("role"), turn.get("content")
            role = raw_role if raw_role in ROLES else None
        if role is None:
            raise BadRow("unknown_role", f"turn {k} has role {raw_role!r}, expected one of {', '.join(ROLES)} "
                                          "(ShareGPT: human, gpt, system, tool)")
        text = _text(content, f"turn {k} content")
        if text.strip():
            out.append((role, text))
        else:
            empty.append(role)  # a turn with no text (an assistant's bare tool call, an empty reply): nothing to learn
    return out, empty


def normalise(rec: Any, need: str = "assistant") -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """Return the chat messages of one record and what was changed to read it; raise BadRow if it is unusable.

    need: "assistant" (a conversation to train on needs an assistant turn) or "user" (a prompt needs a user turn).
    """
    if isinstance(rec, BadRow):
        raise rec
    if isinstance(rec, str):
        rec = {"prompt": rec}
    if not isinstance(rec, dict):
        raise BadRow("unknown_shape", f"a {type(rec).__name__}, expected an object")
    # Parquet/Arrow give every row every column of the file, None where a row lacks one.
    rec = {k: v for k, v in rec.items() if v is not None}
    notes: tuple[str, ...] = ()
    empty: list[str] = []
    if "messages" in rec or "conversations" in rec:
        turns, empty = _turns(rec)
        if empty:
            notes = (EMPTY_TURNS,)
    elif "instruction" in rec and ("output" in rec or need == "user"):
        prompt = _text(rec["instruction"], "instruction")
        extra = rec.get("input")
        if isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        system = rec.get("system")
        turns = [("system", system)] if isinstance(system, str) and system.strip() else []
        turns += [("user", prompt)]
        if "output" in rec:
            turns.append(("assistant", _text(rec["output"], "output")))
        turns = [(r, t) for r, t in turns if t.strip()]
    elif "prompt" in rec:
        text = _text(rec["prompt"], "prompt")
        turns = [("user", text)] if text.strip() else []
    else:
        keys = ", ".join(sorted(map(str, rec))[:6])
        raise BadRow("unknown_shape", f"keys [{keys}]; expected messages, conversations, instruction+output or "
                                       "prompt")
    if not turns:
        raise BadRow("empty_content", "no turn has any text")
    if not any(r == need for r, _ in turns):
        if need in empty:
            raise BadRow("empty_content", f"every {need} turn is empty")
        raise BadRow(f"no_{need}_turn", f"no {need} turn" + (" to train on" if need == "assistant" else
                                                                " to answer"))
    return [message(r, t) for r, t in turns], notes


def prompt_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Return the turns of a conversation that a regeneration keeps: everything but the assistant's."""
    return [m for m in messages if m["role"] != "assistant"]
