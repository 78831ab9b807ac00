"""Frozen, keyword-only configuration of each stage, validated on construction and saved as JSON beside its output."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = [
    "StageConfig",
    "ExtractConfig",
    "TrainConfig",
    "GenerateConfig",
    "DemoConfig",
    "parse_gpus",
    "resolve_devices",
    "CODECS",
]

CODECS = ("blosc", "none", "fp8")
DTYPES = ("bfloat16", "float32")


def parse_gpus(spec: str) -> list[int] | None:
    """Return the GPU indices of a `--gpus` value ("0,1,2" or "0-4"), or None for "cpu"."""
    text = str(spec).strip().lower()
    if text == "cpu":
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ConfigError(f"--gpus {spec!r} is not a GPU list; use e.g. 0,1,2,3,4 or 0-4 or cpu") from None
    if not out or any(g < 0 for g in out) or len(set(out)) != len(out):
        raise ConfigError(f"--gpus {spec!r} must name distinct non-negative GPU indices, e.g. 0,1,2 or cpu")
    return out


def resolve_devices(gpus: str, local_rank: int | None = None) -> list[str]:
    """Return the torch devices of a `--gpus` value: ["cpu"], or the listed CUDA devices that exist (clipped).

    Under a torchrun-style launch (local_rank given) it is the one GPU of this rank.
    """
    import logging

    ids = parse_gpus(gpus)
    if ids is None:
        return ["cpu"]
    import torch

    n = torch.cuda.device_count()
    have = [i for i in ids if i < n]
    if not have:
        hint = f"pass --gpus with ids in 0..{n - 1}" if n else "this torch sees no CUDA device; pass --gpus cpu"
        raise ConfigError(f"--gpus {gpus}: expected CUDA devices {ids}, found {n} on this machine; {hint}")
    if len(have) < len(ids):
        logging.getLogger(__name__).info("--gpus %s clipped to the %d existing device(s): %s", gpus, len(have), have)
    if local_rank is not None:
        return [f"cuda:{have[local_rank % len(have)]}"]
    return [f"cuda:{i}" for i in have]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """Base of the stage configs: JSON round trip and a stable identity."""

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain JSON-able values (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_json(self) -> str:
        """Return the config as indented, key-sorted JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build the config from `to_dict` output; unknown keys are refused by name."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; allowed: {sorted(names)}")
        kwargs = {}
        for key, value in data.items():
            if isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as JSON, atomically (temp file, fsync, rename)."""
        from .atomic import write_atomic

        write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a config written by `save`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {cls.__name__} from {os.fspath(path)}: {e}") from None
        return cls.from_dict(data)


@dataclass(frozen=True, kw_only=True)
class ExtractConfig(StageConfig):
    """Options of `dflash extract`: target, data, store, devices, capture and sharding."""

    model: str
    data: tuple[str, ...]
    out: str
    gpus: str = "0,1,2,3,4"
    layers: tuple[int, ...] | None = None  # None = auto: build_target_layer_ids(num_layers, 5)
    max_length: int = 4096
    min_loss_tokens: int = 32
    shard_size: int | None = None  # source rows per shard; None = sized to ~2 GB of features
    batch_tokens: int = 32768
    codec: str = "blosc"
    chat_template: str | None = None
    mask_token_id: int | None = None
    strict: bool = False
    dtype: str = "bfloat16"
    writer_threads: int = 4

    def __post_init__(self) -> None:
        _check(bool(self.data), "--data needs at least one file or folder")
        parse_gpus(self.gpus)
        _check(self.max_length >= 2, f"--max-length must be >= 2, got {self.max_length}")
        _check(self.min_loss_tokens >= 0, f"--min-loss-tokens must be >= 0, got {self.min_loss_tokens}")
        _check(self.shard_size is None or self.shard_size >= 1, f"--shard-size must be >= 1, got {self.shard_size}")
        _check(
            self.batch_tokens >= self.max_length,
            f"--batch-tokens ({self.batch_tokens}) must be >= --max-length ({self.max_length}) so every sample fits",
        )
        _check(self.codec in CODECS, f"--codec {self.codec!r} is not one of {', '.join(CODECS)}")
        _check(self.dtype in DTYPES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        _check(self.mask_token_id is None or self.mask_token_id >= 0, "--mask-token-id must be >= 0")
        _check(self.writer_threads >= 1, f"--writer-threads must be >= 1, got {self.writer_threads}")
        if self.layers is not None:
            _check(len(self.layers) >= 1, "--layers is empty; pass auto or e.g. 1,9,17,25,33")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(StageConfig):
    """Options of `dflash train`: store, target, run folder, devices, model shape, optimisation, checkpoints."""

    store: str
    target: str
    out: str
    gpus: str = "5,6,7"
    epochs: int = 6
    max_steps: int | None = None
    batch_tokens: int = 16384
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    draft_layers: int = 5
    block_size: int = 16
    anchors: int = 512
    grad_accum: int = 1
    seed: int = 0
    val_fraction: float = 0.0
    follow: bool = False
    resume: bool = False
    save_every: int = 1000
    keep: int = 3
    log_every: int = 10
    tensorboard: bool = False
    skip_corrupt: bool = False
    prefetch_shards: int = 2
    sliding_window: int | None = None
    full_every: int | None = None
    attention: str = "auto"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        parse_gpus(self.gpus)
        _check(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        _check(self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}")
        _check(self.batch_tokens >= 1, f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        _check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _check(0 <= self.warmup_ratio < 1, f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        _check(self.clip > 0, f"--clip must be > 0, got {self.clip}")
        _check(self.draft_layers >= 1, f"--draft-layers must be >= 1, got {self.draft_layers}")
        _check(self.block_size >= 2, f"--block-size must be >= 2, got {self.block_size}")
        _check(self.anchors >= 1, f"--anchors must be >= 1, got {self.anchors}")
        _check(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        _check(0 <= self.val_fraction < 1, f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        _check(self.save_every >= 1, f"--save-every must be >= 1, got {self.save_every}")
        _check(self.keep >= 1, f"--keep must be >= 1, got {self.keep}")
        _check(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")
        _check(self.prefetch_shards >= 1, f"--prefetch-shards must be >= 1, got {self.prefetch_shards}")
        _check(
            (self.sliding_window is None) == (self.full_every is None),
            "--sliding-window and --full-every go together (e.g. --sliding-window 2048 --full-every 5)",
        )
        _check(self.sliding_window is None or self.sliding_window >= 1, "--sliding-window must be >= 1")
        _check(self.full_every is None or self.full_every >= 1, "--full-every must be >= 1")
        _check(self.attention in ("auto", "flex", "sdpa"), f"--attention {self.attention!r}: use auto, flex or sdpa")
        _check(self.dtype in DTYPES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(StageConfig):
    """Options of `dflash generate`: regenerate answers with the target."""

    model: str
    prompts: str
    out: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 16
    device: str = "cpu"
    backend: str = "transformers"
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")
        _check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        _check(self.device in ("cpu", "cuda"), f"--device {self.device!r}: use cpu or cuda")
        _check(self.backend in ("transformers", "vllm"), f"--backend {self.backend!r}: use transformers or vllm")


DEMO_BUDGETS = ("auto", "full", "gpu", "tiny")


@dataclass(frozen=True, kw_only=True)
class DemoConfig(StageConfig):
    """Options of `dflash demo`: the whole recipe on the embedded target."""

    out: str = "dflash-demo"
    device: str = "cpu"
    budget: str = "auto"  # auto: "full" on cpu, "gpu" on cuda; "tiny" is the reduced budget the slow test uses

    def __post_init__(self) -> None:
        _check(self.device in ("cpu", "cuda"), f"--device {self.device!r}: use cpu or cuda")
        _check(self.budget in DEMO_BUDGETS, f"--budget {self.budget!r}: use one of {', '.join(DEMO_BUDGETS)}")
        if self.budget == "auto":
            object.__setattr__(self, "budget", "gpu" if self.device == "cuda" else "full")
