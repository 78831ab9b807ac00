"""dflash.conversations: the one reader of conversation and prompt files (every stage reads its inputs here, so one
file means the same rows everywhere) and the chat messages they hold."""
from __future__ import annotations

from .formats import (EMPTY_TURNS, INVALID_UTF8, BadRowLog, Row, Rows, fingerprint, input_files, jsonl_lines,
                      normalise, prompt_turns, read_rows, report_bad_rows)
from .messages import ROLES, SHAREGPT_ROLES, SIDECAR_SUFFIX, generated_by, is_sidecar, message, sidecar_path

__all__ = ["Row", "Rows", "BadRowLog", "input_files", "read_rows", "fingerprint", "normalise", "jsonl_lines",
           "report_bad_rows", "prompt_turns", "INVALID_UTF8", "EMPTY_TURNS", "ROLES", "SHAREGPT_ROLES", "message",
           "SIDECAR_SUFFIX", "sidecar_path", "is_sidecar", "generated_by"]
