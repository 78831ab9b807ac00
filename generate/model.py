"""The target as `dflash generate` runs it: the numerics (dtype, engine, device) resolved and recorded beside the
output, and the tokenizer and model loaded (targets/load.py)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..conversations import sidecar_path
from ..errors import ConfigError, InputError

if TYPE_CHECKING:
    from ..config import GenerateConfig

__all__ = ["resolve", "check_identity"]

log = logging.getLogger(__name__)

# The fields that say in which numerics the output was made; "auto" in an old sidecar means "not recorded".
NUMERICS = ("dtype", "engine", "device")


def _folder_dtype(model: str) -> str:
    """Return the dtype a Hugging Face folder's config.json names (float32 when it names none, as transformers)."""
    try:
        data = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "float32"
    return str(data.get("dtype") or data.get("torch_dtype") or "float32").replace("torch.", "")


def resolve(cfg: "GenerateConfig") -> "GenerateConfig":
    """Return cfg with dtype and engine made concrete, as they will run (and be recorded beside --out)."""
    if not Path(cfg.model).is_dir():
        raise InputError(
            f"--model {cfg.model}: expected a Hugging Face model folder, found none; pass a save_pretrained folder "
            "(the embedded target: python -c 'from dflash.demo.assets import smollm2_folder; print(smollm2_folder())')"
        )
    # On CPU, bf16 answers depend on the batch: with left padding SmolLM2's first-token logits moved by 0.9 and
    # "The capital of France is Paris." became "L'Etoile, ..."; even eager attention changed 9 of 16 answers
    # between batch 16 and batch 1. fp32 kept 8 of 8 answers identical between batch 8 and batch 1, so auto
    # uses it there, at a cost (bf16 decoded up to ~3x faster on this AVX512-bf16 CPU). GPUs keep the folder's.
    from ..targets.numerics import resolve_dtype

    if cfg.device == "cpu":
        auto = "float32"
        why = "generate's auto on a CPU, where bf16 answers depend on the batch and decoding verifies in float32"
    else:
        auto = _folder_dtype(cfg.model)
        why = f"generate's auto on CUDA: the dtype {cfg.model}/config.json names"
    dtype = resolve_dtype(cfg.dtype, cfg.device, auto=auto, auto_reason=why)
    engine = cfg.engine
    if engine != "plain":
        from transformers import AutoConfig

        from .engine import fast_unsupported

        why = fast_unsupported(AutoConfig.from_pretrained(cfg.model))
        if why and engine == "fast":
            raise ConfigError(f"--engine fast cannot run --model {cfg.model}: {why}; rerun with --engine plain")
        engine = "plain" if why else "fast"
    return dataclasses.replace(cfg, dtype=dtype, engine=engine)


def check_identity(cfg: "GenerateConfig", out: Path, fields: tuple[str, ...]) -> None:
    """Save the resolved config beside `out`, or refuse to resume into it with other values of `fields`."""
    from ..config import GenerateConfig

    saved_path = sidecar_path(out)
    if not saved_path.exists():
        cfg.save(saved_path)
        return
    saved = GenerateConfig.from_dict(_without_legacy(saved_path))
    for name in fields:
        old, new = getattr(saved, name), getattr(cfg, name)
        if name in NUMERICS and old == "auto":
            continue  # written before the numerics were recorded
        if name == "model" and old is not None and new is not None:
            old, new = os.path.abspath(old), os.path.abspath(new)
        if old != new:
            flag = "--" + name.replace("_", "-")
            shown = lambda v: "(none)" if v is None else " ".join(map(str, v)) if isinstance(v, tuple) else v  # noqa
            raise ConfigError(
                f"--out {out} was generated with {flag} {shown(old)} but this run has {shown(new)} "
                f"({saved_path}); rerun with {flag} {shown(old)} or pass a new --out"
            )


def _without_legacy(path: Path) -> dict[str, Any]:
    """Return a saved GenerateConfig's fields less the ones that no longer exist: `backend` (transformers, or an
    in-process vllm that never ran), replaced by --server on 2026-12-03."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: expected the config `dflash generate` saved beside its output, found it "
                          f"unreadable ({e}); move it away with its output, or pass a new --out") from None
    if isinstance(data, dict):
        data.pop("backend", None)
    return data
