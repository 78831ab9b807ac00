"""Prompt files for `dflash generate`: JSONL ({"prompt"} / {"messages"} ending on the user) or plain text lines."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conversations import ROLES, message
from ..errors import InputError

__all__ = ["Prompt", "read_prompts"]

_JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its row among the file's non-blank lines, its 1-based line number, and the conversation."""

    row: int
    line: int
    messages: list[dict[str, str]]


def _bad(path: Path, line: int, expected: str, found: str) -> InputError:
    return InputError(
        f"--prompts {path} line {line}: expected {expected}, found {found}; fix or remove that line and rerun"
    )


def _conversation(path: Path, line: int, rec: Any) -> list[dict[str, str]]:
    """Return the messages of one JSON prompt record, or raise InputError naming the line."""
    if isinstance(rec, str):
        rec = {"prompt": rec}
    if not isinstance(rec, dict):
        raise _bad(path, line, 'an object {"prompt": ...} or {"messages": [...]}', f"a JSON {type(rec).__name__}")
    if "messages" in rec:
        turns = rec["messages"]
        if not isinstance(turns, list) or not turns:
            raise _bad(path, line, "messages to be a non-empty list", repr(turns)[:60])
        out = []
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict) or turn.get("role") not in ROLES:
                role = turn.get("role") if isinstance(turn, dict) else type(turn).__name__
                raise _bad(path, line, f"turn {k} to have a role among {', '.join(ROLES)}", repr(role))
            content = turn.get("content")
            if not isinstance(content, str) or not content.strip():
                raise _bad(path, line, f"turn {k} to have non-empty string content", repr(content)[:60])
            out.append(message(turn["role"], content))
        if out[-1]["role"] != "user":
            raise _bad(path, line, "the last turn to be the user's (the target answers it)", f"a {out[-1]['role']} turn")
        return out
    if "prompt" in rec:
        text = rec["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise _bad(path, line, "prompt to be a non-empty string", repr(text)[:60])
        return [message("user", text)]
    keys = ", ".join(sorted(map(str, rec))[:6])
    raise _bad(path, line, 'a "prompt" or "messages" key', f"keys [{keys}]")


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Return the prompts of a file: JSONL ({"prompt"} / {"messages"} / a JSON string) or plain text, one per line.

    Blank lines are not rows (as in `dflash extract`), so row i is the i-th non-blank line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"--prompts {path}: no such file; pass a .jsonl or .txt file of prompts") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path}: expected a readable UTF-8 text file, found {e}") from None
    as_json = path.suffix.lower() in _JSON_SUFFIXES
    prompts: list[Prompt] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if as_json:
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _bad(path, lineno, "one JSON object", f"invalid JSON ({e.msg} at column {e.colno})") from None
            messages = _conversation(path, lineno, rec)
        else:
            messages = [message("user", raw.strip())]
        prompts.append(Prompt(row=len(prompts), line=lineno, messages=messages))
    if not prompts:
        raise InputError(f"--prompts {path}: expected at least one prompt, found an empty file")
    return prompts
