"""The target's cache for decoding (transformers' own, one layer of the kind each decoder layer needs: full
attention, sliding window, linear attention) and its rollback after a verification whose tail was rejected.

Speculative decoding runs the target over [anchor, drafts] and keeps only the accepted prefix. Attention layers drop
the rejected positions by cropping; a sliding-window layer can crop only if it kept the positions that fell out of
its window during the verification, so it records its past until it is cut. A recurrent layer (Gated DeltaNet's
linear attention) folds every token into one state, which no crop can take back: its state is saved before the
verification and restored after it, and the accepted tokens are run again (one more target forward, only for a
block with a rejected tail).
"""
from __future__ import annotations

from typing import Any

__all__ = ["decoding_cache", "Rollback"]


def _recurrent(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states")


def _copy(state: Any) -> Any:
    return None if state is None else state.clone()


def _attention_crop(layer: Any, drop: int) -> None:
    """Drop the last `drop` positions of a layer's keys and values (of the attention part of a mixed layer)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for cls in type(layer).__mro__:  # the attention class it mixes in (the mixed class's own crop is the recurrent's)
        if cls in (DynamicSlidingWindowLayer, DynamicLayer):
            cls.crop(layer, -drop)
            return


def decoding_cache(target: Any) -> Any:
    """Return an empty cache for decoding with `target`, whose sliding-window layers keep their past until
    `Rollback.cut` trims them (so a rejected draft can be dropped after the window moved past older positions)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and not _recurrent(layer) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


class Rollback:
    """Cuts a decoding cache back to what a verification accepted."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.saved: list[tuple[Any, dict[int, Any], dict[int, Any], dict[int, bool]]] = []

    @property
    def recurrent(self) -> bool:
        """Return True if the cache holds a recurrent layer (a rejected tail then costs a second forward)."""
        return any(_recurrent(layer) for layer in self.cache.layers)

    def save(self) -> None:
        """Save the recurrent layers' states (before a verification forward)."""
        self.saved = [(layer, {k: _copy(v) for k, v in layer.conv_states.items()},
                       {k: _copy(v) for k, v in layer.recurrent_states.items()}, dict(layer.has_previous_state))
                      for layer in self.cache.layers if _recurrent(layer)]

    def cut(self, ran: int, kept: int) -> bool:
        """Keep the first `kept` of the `ran` positions the last forward added; return True if the kept tokens must
        be run again (recurrent layers were restored to before the forward, and attention layers cut to match)."""
        again = kept < ran and bool(self.saved)
        drop = ran if again else ran - kept
        for layer in self.cache.layers:
            if drop and getattr(layer, "is_initialized", True):
                if not _recurrent(layer):
                    layer.crop(-drop)
                elif hasattr(layer, "keys"):  # a mixed layer: its attention part
                    _attention_crop(layer, drop)
            if getattr(layer, "record_past", False) and getattr(layer, "is_sliding", False):
                layer.crop(0)  # back to its window: the past it recorded is no longer needed
        if again:
            for layer, conv, rec, previous in self.saved:
                for states, saved in ((layer.conv_states, conv), (layer.recurrent_states, rec)):
                    for k, v in saved.items():
                        if v is not None and states.get(k) is not None and states[k].shape == v.shape:
                            states[k].copy_(v)  # in place: the state keeps its address
                        else:
                            states[k] = v
                layer.has_previous_state.update(previous)
        self.saved = []
        return again
