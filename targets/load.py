"""Loading the target model: one Hugging Face causal LM loader for extract, generate and decoding, and the read of
its weight files ahead of the load."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, InputError
from ..runtime.memory import host_available_bytes
from .weights import check_weights, weight_files

__all__ = ["load_target", "causal_lm", "check_weights", "check_finite", "load_for_features", "Loaded", "load_for_chat",
           "WeightPrefetch", "weight_files", "hub_kernels_requested", "runtime_record"]

log = logging.getLogger(__name__)

def hub_kernels_requested() -> bool:
    """Return True if the user asked for kernels from the Hugging Face Hub (USE_HUB_KERNELS=YES, transformers'
    own switch, set explicitly): transformers >= 5.25 otherwise swaps them into `from_pretrained`'s model by
    default, downloading code that can change a target's numerics under a store; dflash leaves them out."""
    return os.environ.get("USE_HUB_KERNELS", "").strip().upper() in ("1", "YES", "TRUE", "ON")


def runtime_record() -> dict[str, Any]:
    """Return what ran a target: the versions of torch and transformers, and whether Hub kernels were allowed."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for name in ("torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["hub_kernels"] = hub_kernels_requested()
    return out


def load_target(path: str | os.PathLike, *, device: Any = "cpu", dtype: Any = "float32",
                attn_implementation: str | None = None, option: str = "--model", checked: bool = False) -> Any:
    """Return the target causal LM of a Hugging Face folder in eval mode on `device` in `dtype` ("auto": the
    folder's own); a folder that is not one, or weights that are not the model's (check_weights; skipped when the
    caller has `checked` them) or not finite, is an InputError naming `option`.

    On CUDA the weights load straight onto the GPU (not through host memory) where accelerate allows it.
    """
    if not checked:
        check_weights(path, option=option)
    import torch

    device = torch.device(device)
    kwargs: dict[str, Any] = {"dtype": dtype if dtype == "auto" or not isinstance(dtype, str) else getattr(torch, dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # No kernels fetched from the Hub unless asked for (hub_kernels_requested); transformers before 5.25 fetched
    # none by default either.
    kwargs["use_kernels"] = hub_kernels_requested()
    if device.type == "cuda":
        kwargs["device_map"] = {"": device.index or 0}
    try:
        model = causal_lm(path, option, **kwargs)
    except ImportError:  # device_map needs accelerate on some transformers versions: load via host memory
        kwargs.pop("device_map", None)
        model = causal_lm(path, option, **kwargs)
    model = model.to(device).eval()
    check_finite(model.named_parameters(), path, option)
    return model


def causal_lm(path: str | os.PathLike, option: str = "--model", **kwargs: Any) -> Any:
    """Return transformers' AutoModelForCausalLM.from_pretrained(path, **kwargs); a folder without weights or
    with broken ones is an InputError naming `option`."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(os.fspath(path), **kwargs)
    except (OSError, ValueError, SafetensorError) as e:  # a folder without weights, broken weights
        raise InputError(
            f"{option} {path}: expected a Hugging Face causal LM folder (config.json + weights), "
            f"loading failed with {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None


def check_finite(named: Any, path: str | os.PathLike, option: str = "--model") -> None:
    """Raise InputError naming the first tensor of (name, tensor) pairs that holds NaN or infinite values."""
    import torch

    for name, t in named:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise InputError(f"{option} {path}: tensor {name} holds {bad:,} non-finite values (NaN or inf) of "
                             f"{t.numel():,}; the weights are damaged: re-download or re-save them")


def load_for_features(model_dir: str | os.PathLike, device: Any, dtype: Any) -> Any:
    """Return the target as extract runs it: an eval-mode causal LM on `device` in `dtype`, with the fastest
    attention implementation that runs it exactly there (adapter.attention_for; its weights were checked against
    the model before the store was made: check_architecture)."""
    from transformers import AutoConfig

    from .adapter import attention_for

    try:
        config = AutoConfig.from_pretrained(os.fspath(model_dir))
    except (OSError, ValueError) as e:
        raise InputError(f"--model {model_dir}: expected a Hugging Face model folder with a config.json; "
                         f"{str(e).splitlines()[0][:200]}") from None
    return load_target(model_dir, device=device, dtype=dtype, attn_implementation=attention_for(config, device),
                       checked=True)


@dataclass
class Loaded:
    """The tokenizer and model of a run, with the stop tokens and the pad token its batches use."""

    tokenizer: Any
    model: Any
    stop_ids: list[int]
    pad_id: int


def load_for_chat(model: str, device: str, dtype: str) -> Loaded:
    """Return the tokenizer and model of a chat target (generate's), on `device` in `dtype`, with its stop tokens."""
    import torch
    from transformers import AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: expected a CUDA device, found none; rerun with --device cpu")
    tokenizer = AutoTokenizer.from_pretrained(model)
    if not tokenizer.chat_template:
        raise InputError(f"--model {model}: expected a tokenizer with a chat template, found none")
    lm = load_target(model, device=device, dtype=dtype)
    # Left padding (plain engine) keeps every prompt's last token at the same column, where generation continues.
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:  # some conversions (transformers 5.17 from GGUF) name no pad token
        tokenizer.pad_token_id = pad_id
    stops = {tokenizer.eos_token_id}
    gen_eos = lm.generation_config.eos_token_id
    stops |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
    stops.discard(None)
    if not stops:
        raise InputError(f"--model {model}: expected an eos token in the tokenizer or generation config, found none")
    log.info("target %s on %s in %s", model, device, dtype)
    return Loaded(tokenizer, lm, sorted(stops), pad_id)


class WeightPrefetch:
    """Reads a model folder's weight files once on a daemon thread, so that the load after the imports finds them
    in the page cache.

    On a cold disk most of a target's load is this read (16 GB for an 8B target at the disk's ~1.5 GB/s), and it
    needs neither torch nor transformers: started first, it runs beside the 10-15 s of imports instead of after
    them. The read itself releases the GIL. It is skipped when the files would take more than `share` of the
    memory available (they would push each other out of the cache and be read twice) and stops at the first
    error (the load then reports the folder's problem in its own words).
    """

    def __init__(self, folder: str | os.PathLike, *, available: int | None = None, share: float = 0.5,
                 block: int = 64 << 20, on_done: Callable[[float], None] | None = None) -> None:
        self._on_done = on_done  # called with the read's seconds when it ends (not when skipped)
        self.files = weight_files(folder)
        self.bytes = sum(p.stat().st_size for p in self.files)
        self.read_bytes = 0
        self.seconds: float | None = None
        self._block = block
        self._cancel = threading.Event()
        self._done = threading.Event()
        avail = host_available_bytes() if available is None else available
        self.skipped: str | None = None
        if not self.files:
            self.skipped = "no local weight files"
        elif avail is None:
            self.skipped = "the memory available is unknown here"
        elif self.bytes > share * avail:
            self.skipped = f"{self.bytes / 1e9:.1f} GB of weights, {avail / 1e9:.1f} GB of memory available"
        self._thread = threading.Thread(target=self._run, name="dflash-prefetch", daemon=True)

    def start(self) -> "WeightPrefetch":
        if self.skipped is None:
            self._thread.start()
        else:
            log.debug("no weight prefetch: %s", self.skipped)
            self._done.set()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        buf = bytearray(self._block)
        try:
            for path in self.files:
                with open(path, "rb", buffering=0) as f:
                    while not self._cancel.is_set() and (n := f.readinto(buf)):
                        self.read_bytes += n
                if self._cancel.is_set():
                    break
        except OSError as e:
            log.debug("weight prefetch stopped at %s: %s", path, e)
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()
            if self._on_done is not None:
                self._on_done(self.seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Return True once the read has ended (or was skipped)."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop reading (at the next block)."""
        self._cancel.set()
