"""What a decoding gives back (the dynamic loop's and the static decoder's alike), and where an answer ends."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Decoded", "cut_at_stop"]


@dataclass
class Decoded:
    """One decoded answer: generated token ids, tokens gained per verified block, and target forward passes.

    Invariants: len(tokens) == 1 + sum(accepted) for speculative decoding (the prefill gives the first token);
    forwards == 1 + len(accepted); greedy decoding has no blocks and one forward per token.
    """

    tokens: list[int]
    forwards: int
    accepted: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Return the mean acceptance length: tokens gained per verified block (accepted drafts + 1); 0 if none."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


def cut_at_stop(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """Return (tokens cut after the first stop token or at max_new_tokens, whether decoding is finished)."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens
