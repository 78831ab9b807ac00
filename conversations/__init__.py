"""dflash.conversations: the one reader of conversation and prompt files. `dflash generate`, `extract`, `eval`, the
demo and `run` all read their inputs here, so one file means the same rows everywhere.

Formats (formats.py): JSONL, one JSON array (or {"data": [...]}), Parquet, Arrow (IPC stream or file), a `datasets`
save_to_disk folder, and plain text (one prompt a line), all streamed. Shapes (shapes.py): OpenAI `messages`,
ShareGPT `conversations` (`from`/`value`), Alpaca `instruction`/`output`, `{"prompt"}`, and a bare JSON string (a
prompt). Files and rows (files.py): which files, which rows, what was dropped. Messages (messages.py): the chat roles,
and the record `dflash generate` keeps beside a file it wrote.
"""
from __future__ import annotations

from .files import INVALID_UTF8, BadRowLog, Row, Rows, fingerprint, input_files, read_rows, report_bad_rows
from .formats import jsonl_lines
from .messages import ROLES, SHAREGPT_ROLES, SIDECAR_SUFFIX, generated_by, is_sidecar, message, sidecar_path
from .shapes import EMPTY_TURNS, normalise, prompt_turns

__all__ = ["Row", "Rows", "BadRowLog", "input_files", "read_rows", "fingerprint", "normalise", "jsonl_lines",
           "report_bad_rows", "prompt_turns", "INVALID_UTF8", "EMPTY_TURNS", "ROLES", "SHAREGPT_ROLES", "message",
           "SIDECAR_SUFFIX", "sidecar_path", "is_sidecar", "generated_by"]
