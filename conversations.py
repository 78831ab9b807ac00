"""Chat conversations as every stage sees them: a list of {"role", "content"} messages with these roles."""
from __future__ import annotations

__all__ = ["ROLES", "SHAREGPT_ROLES", "message"]

ROLES = ("system", "user", "assistant")
# ShareGPT speakers seen in the wild, mapped to chat roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}


def message(role: str, content: str) -> dict[str, str]:
    """Return one chat message; `role` must be one of ROLES (our own invariant, callers validate user input)."""
    assert role in ROLES, role
    return {"role": role, "content": content}
