"""The target's cache for decoding (transformers' own, one layer of the kind each decoder layer needs: full
attention, sliding window, linear attention) and its rollback after a verification whose tail was rejected.

Speculative decoding runs the target over [anchor, drafts] and keeps only the accepted prefix. Attention layers drop
the rejected positions by cropping; a sliding-window layer can crop only if it kept the positions that fell out of
its window during the verification, so it records its past until it is cut.

A recurrent layer (Gated DeltaNet's linear attention) folds every token into one state. Where the installed
transformers records a linear layer's past (5.25: `activate_past_recording(recurrent_states_to_keep=N)`, the state
after each of a forward's last N tokens, and a `crop` that restores one), the rollback is transformers' own crop.
Elsewhere (older releases, or a model whose layer does not record) the states are saved before the verification and
restored after it by hand, and the accepted tokens are run again: one more target forward, only for a block with a
rejected tail. Either way the check is dflash's: decoding is compared token for token with greedy in the tests.
"""
from __future__ import annotations

import inspect
from typing import Any

__all__ = ["decoding_cache", "Rollback", "records_linear_past"]


def _recurrent(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states")


def _copy(state: Any) -> Any:
    return None if state is None else state.clone()


def records_linear_past() -> bool:
    """Return True if the installed transformers' linear-attention cache layers can record the recurrent state of
    each token of a forward and crop back to any of them (transformers >= 5.25)."""
    try:
        from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin
    except ImportError:
        return False
    record = getattr(LinearAttentionCacheLayerMixin, "activate_past_recording", None)
    return (record is not None and "recurrent_states_to_keep" in inspect.signature(record).parameters
            and hasattr(Cache, "get_recurrent_states_to_keep"))


def _attention_crop(layer: Any, drop: int) -> None:
    """Drop the last `drop` positions of a layer's keys and values (of the attention part of a mixed layer)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for cls in type(layer).__mro__:  # the attention class it mixes in (the mixed class's own crop is the recurrent's)
        if cls in (DynamicSlidingWindowLayer, DynamicLayer):
            cls.crop(layer, -drop)
            return


def decoding_cache(target: Any, block_size: int = 0) -> Any:
    """Return an empty cache for decoding with `target` in blocks of up to `block_size` tokens: sliding-window layers
    keep their past until `Rollback.cut` trims them (so a rejected draft can be dropped after the window moved past
    older positions), and, where transformers records it, linear-attention layers keep the state after each of a
    block's tokens."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    native = block_size > 0 and records_linear_past()
    for layer in cache.layers:
        if _recurrent(layer):
            if native:
                layer.activate_past_recording(recurrent_states_to_keep=block_size)
        elif getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


class Rollback:
    """Cuts a decoding cache back to what a verification accepted."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.saved: list[tuple[Any, dict[int, Any], dict[int, Any], dict[int, bool], Any]] = []
        self.native = False  # set once a forward showed that every recurrent layer records its per-token states

    @property
    def recurrent(self) -> bool:
        """Return True if the cache holds a recurrent layer."""
        return any(_recurrent(layer) for layer in self.cache.layers)

    def save(self) -> None:
        """Save the recurrent layers' states (before a verification forward), for a rollback by hand where
        transformers cannot crop them."""
        if self.native:
            return
        self.saved = [(layer, {k: _copy(v) for k, v in layer.conv_states.items()},
                       {k: _copy(v) for k, v in layer.recurrent_states.items()}, dict(layer.has_previous_state),
                       _copy(getattr(layer, "cumulative_length_linear", None)))
                      for layer in self.cache.layers if _recurrent(layer)]

    def _native(self, ran: int) -> bool:
        """Return True if every recurrent layer recorded the state after each of the last forward's tokens (as many
        as it keeps), so that transformers' crop can take back any of them."""
        layers = [layer for layer in self.cache.layers if _recurrent(layer)]
        if not layers or not all(getattr(layer, "record_past", False) for layer in layers):
            return False
        for layer in layers:
            want = min(ran, getattr(layer, "recurrent_states_to_keep", None) or 0)
            for i, done in layer.is_recurrent_states_initialized.items():
                if done and len(layer.recurrent_states_history.get(i) or ()) < want:
                    return False  # this model's layer does not hand transformers its per-token states
        return True

    def cut(self, ran: int, kept: int) -> bool:
        """Keep the first `kept` of the `ran` positions the last forward added; return True if the kept tokens must
        be run again (recurrent layers were restored to before the forward by hand, and attention layers cut to
        match)."""
        native = self.native or self._native(ran)
        self.native = native
        again = kept < ran and not native and bool(self.saved)
        drop = ran if again else ran - kept
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", True) and not _recurrent(layer):
                continue
            if _recurrent(layer):
                if native:
                    layer.crop(-drop)  # transformers' own: the state after the last kept token, conv states cut
                    continue
                if drop and hasattr(layer, "keys"):  # a mixed layer: its attention part
                    _attention_crop(layer, drop)
                if getattr(layer, "record_past", False):
                    layer.crop(0)  # back to its working size; the restore below sets the states
            elif drop:
                layer.crop(-drop)
            if getattr(layer, "record_past", False) and getattr(layer, "is_sliding", False) and not _recurrent(layer):
                layer.crop(0)  # back to its window: the past it recorded is no longer needed
        if again:
            for layer, conv, rec, previous, length in self.saved:
                for states, saved in ((layer.conv_states, conv), (layer.recurrent_states, rec)):
                    for k, v in saved.items():
                        if v is not None and states.get(k) is not None and states[k].shape == v.shape:
                            states[k].copy_(v)  # in place: the state keeps its address
                        else:
                            states[k] = v
                layer.has_previous_state.update(previous)
                if length is not None:  # transformers >= 5.25 counts a linear layer's tokens itself
                    layer.cumulative_length_linear.copy_(length)
        self.saved = []
        return again
