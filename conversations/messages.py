"""Chat conversations as every stage sees them: a list of {"role", "content"} messages with these roles; and the
record `dflash generate` keeps beside a conversations file it wrote (how its answers were made)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ROLES", "SHAREGPT_ROLES", "message", "SIDECAR_SUFFIX", "sidecar_path", "is_sidecar", "generated_by"]

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speakers seen in the wild, mapped to chat roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    # A tool's result (ShareGPT exports name it tool, function or observation).
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def message(role: str, content: str) -> dict[str, str]:
    """Return one chat message; `role` must be one of ROLES (our own invariant, callers validate user input)."""
    assert role in ROLES, role
    return {"role": role, "content": content}


# `dflash generate --out FILE` saves its resolved config as FILE + this suffix.
SIDECAR_SUFFIX = ".config.json"
# What of that config says how the answers were made (the numerics decoding must match, and the sampling; or the
# servers and the model they served, with `generate --server`).
GENERATION_FIELDS = ("model", "dtype", "engine", "device", "temperature", "max_new_tokens", "seed", "server",
                     "served_model", "top_p", "top_k", "sampling_mix")


def sidecar_path(data: str | Path) -> Path:
    """Return the path of the generation record beside a conversations file."""
    data = Path(data)
    return data.with_name(data.name + SIDECAR_SUFFIX)


def is_sidecar(path: Path) -> bool:
    """Return True if `path` is the generation record of a conversations file beside it (not data itself)."""
    return path.name.endswith(SIDECAR_SUFFIX) and path.with_name(path.name[: -len(SIDECAR_SUFFIX)]).is_file()


def generated_by(data: str | Path) -> dict[str, Any] | None:
    """Return how `dflash generate` made a conversations file (dtype, engine, device, sampling), or None if its
    record is absent or unreadable (the file came from elsewhere)."""
    try:
        record = json.loads(sidecar_path(data).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return {k: record[k] for k in GENERATION_FIELDS if k in record}
