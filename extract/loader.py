"""The target loaded on a thread beside the command's start-up: architecture check, device init, then weights.

A one-device `dflash extract` starts it as soon as the device and dtype are known, so the load runs while the main
thread reads the data and builds the header and the plan; the main thread then waits for it (`model_wait`) and checks
the truncated runner against the full model (`runner`) before it creates the store, so a target dflash cannot run
exactly leaves no store behind.

Why this is safe beside the other threads: transformers builds the model under `local_torch_dtype`, which sets
torch's default dtype, a process-wide setting, for as long as the modules are made (and `from_config`, the
architecture check, does the same). A float tensor made without an explicit dtype on another thread meanwhile would
come out in the target's dtype. That is why the check runs here, on the load's own thread, before the load (two
such save/set/restore pairs interleaved can even leave the wrong default behind for good), and why everything the
main and tokenise threads do until they wait for the target is torch-free: rows and chat templates are Python,
token ids and masks are numpy with explicit dtypes, the store is zarr. The first torch work on those threads
(the runner's self-check, padding a batch) comes after `result()`, when the load has restored the default.
"""
from __future__ import annotations

import copy
import threading
from typing import Any

__all__ = ["BackgroundLoad"]


class BackgroundLoad:
    """Checks and loads the target on a daemon thread; checked() and result() hand its outcome to the caller.

    Daemon, so Ctrl-C or SIGTERM stops the command while a load is under way (from_pretrained cannot be
    interrupted; the process exits around it). Its errors are raised where the caller waits, as the same
    exceptions the load raises when it runs in line (InputError for a folder it cannot load).
    """

    def __init__(self, model_dir: str, model_config: Any, device: str, dtype: str, timeline: Any,
                 depth: int | None = None) -> None:
        self.model_dir = model_dir
        self.depth = depth  # the decoder layers extraction runs: the check covers their kinds
        # The check may adjust the config it builds from (attention implementation): never the caller's copy,
        # which the header is built from meanwhile.
        self._config = copy.deepcopy(model_config)
        self.device = device
        self.dtype = dtype
        self._tl = timeline
        self._checked = threading.Event()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._model: Any = None
        self._error: BaseException | None = None
        self._check_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-load-target", daemon=True)

    def start(self) -> "BackgroundLoad":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with self._tl.stage("model_imports", main=False):
                import torch
                import transformers.modeling_utils  # noqa: F401  (the bulk of what the check and load import)

                from ..targets.adapter import check_architecture
                from ..targets.load import load_for_features
            with self._tl.stage("model_check", main=False):
                check_architecture(self._config, self.model_dir, self.depth)
        except BaseException as e:  # handed to checked() and result(), in the caller's thread
            self._error = self._check_error = e
            self._checked.set()
            self._done.set()
            return
        self._checked.set()
        try:
            if self._cancel.is_set():
                return
            dev = torch.device(self.device)
            with self._tl.stage("device_init", main=False):
                if dev.type == "cuda":  # CUDA's current device is per thread: the worker sets it again on its own
                    torch.cuda.set_device(dev)
                    torch.cuda.init()
            with self._tl.stage("model_load", main=False):
                self._model = load_for_features(self.model_dir, dev, getattr(torch, self.dtype))
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def checked(self) -> None:
        """Return once the architecture check has passed; raise its InputError (or the imports' error)."""
        self._checked.wait()
        if self._check_error is not None:
            raise self._check_error

    def result(self) -> Any:
        """Return the loaded target (handed over: this object keeps no reference); raise what the load raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        model, self._model = self._model, None
        if model is None:
            raise RuntimeError("the target load was cancelled before it ran")  # our own misuse, not the user's
        return model

    def close(self, wait: bool = True) -> None:
        """Drop the target if nobody took it; with wait, let a load under way end first (after a refusal, so no
        thread still builds a model, and sets torch's default dtype, once the command's run has returned)."""
        self._cancel.set()
        if wait and self._thread.is_alive():
            self._done.wait()
        self._model = None
