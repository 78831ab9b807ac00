"""What `dflash generate` answers: the conversations of a prompts file (read by chatfiles, as every stage reads
them) without their assistant turns, and the points where the target answers.

The recipe regenerates every assistant turn in order, each given the regenerated history (as SpecForge's
`scripts/regenerate_train_data.py` does): the drafter then learns only text the target wrote, in the context the
target itself made. System prompts are kept; turns with no text are skipped and counted; the target answers after
every user turn (and after every tool turn: what the assistant says next is also its own).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..conversations import BadRowLog, jsonl_lines, prompt_turns, read_rows, report_bad_rows
from ..conversations import message
from ..errors import InputError

__all__ = ["Prompt", "Conversation", "read_prompts", "written_lines", "ANSWERED_AFTER"]

log = logging.getLogger(__name__)

ANSWERED_AFTER = ("user", "tool")


@dataclass(frozen=True)
class Prompt:
    """One conversation to answer: its source row, where it is in the file, and its turns without the assistant's."""

    row: int
    where: str
    messages: list[dict[str, str]]

    @property
    def turns(self) -> int:
        """Return how many assistant turns the target writes for it."""
        return sum(m["role"] in ANSWERED_AFTER for m in self.messages)


def read_prompts(path: str | Path, flag: str = "--prompts") -> list[Prompt]:
    """Return the usable conversations of a prompts file; the unusable rows are counted by reason and the first
    few named in the log; InputError if none is usable."""
    rows = read_rows((str(path),), flag=flag, need="user")
    prompts: list[Prompt] = []
    bad, notes = BadRowLog(), BadRowLog()
    for r in rows:
        if r.error:
            bad.add(r.error, r.index, r.where, r.detail)
            continue
        for note in r.notes:
            notes.add(note, r.index, r.where, "kept")
        prompts.append(Prompt(r.index, r.where, prompt_turns(r.messages)))
    report_bad_rows(bad, "prompt rows")
    for reason, n in sorted(notes.counts.items()):
        log.info("%s: %d prompt rows read with %s", path, n, reason)
    if not prompts:
        raise InputError(f"{flag} {path}: expected at least one row with a user turn, found none usable of "
                         f"{len(rows):,} ({bad.summary()}); fix the file (the warnings above name the first rows)")
    return prompts


@dataclass
class Conversation:
    """A conversation being regenerated: the history so far (prompt turns and the target's answers)."""

    prompt: Prompt
    history: list[dict[str, str]] = field(default_factory=list)
    cursor: int = 0  # prompt turns moved into the history
    answered: int = 0
    tokens: int = 0
    finished: bool = True  # the last answer ended on a stop token

    @property
    def done(self) -> bool:
        return self.answered == self.prompt.turns

    def next_context(self) -> list[dict[str, str]]:
        """Return the history up to and including the next turn the target answers."""
        turns = self.prompt.messages
        k = next(i for i in range(self.cursor, len(turns)) if turns[i]["role"] in ANSWERED_AFTER)
        self.history += turns[self.cursor : k + 1]
        self.cursor = k + 1
        return self.history

    def add(self, text: str, tokens: int, finished: bool) -> None:
        """Take the target's answer to the turn next_context() ended on."""
        self.history.append(message("assistant", text))
        self.answered += 1
        self.tokens += tokens
        self.finished = finished

    def messages(self) -> list[dict[str, str]]:
        """Return the regenerated conversation (a trailing non-answered turn, e.g. a system note, is kept)."""
        return self.history + self.prompt.messages[self.cursor :]

    def record(self) -> dict[str, Any]:
        """Return the output line of the finished conversation, as `dflash extract --data` reads it."""
        rec = {
            "messages": self.messages(),
            "source_row": self.prompt.row,
            "completion_tokens": self.tokens,
            "finish_reason": "stop" if self.finished else "length",
        }
        if self.answered > 1:
            rec["turns"] = self.answered
        return rec


def written_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, bytes) of the non-blank lines of a JSONL file generate wrote (split on "\\n" alone)."""
    for lineno, _, raw in jsonl_lines(path):
        if raw.strip():
            yield lineno, raw
