"""The store header of an extract run: target identity, capture settings, tokenizer, dataset and shard plan."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..conversations import generated_by
from ..errors import ConfigError, InputError
from ..facts import NUM_FEATURE_LAYERS, build_target_layer_ids, validate_layer_ids
from ..conversations import fingerprint, input_files
from ..storage.codec import resolve_codec
from ..targets.adapter import text_config
from ..targets.load import runtime_record
from ..targets.weights import WEIGHT_SUFFIXES, weight_files
from .plan import RowScan, default_shard_size, shard_record
from .template import text_hash

if TYPE_CHECKING:
    from ..config import ExtractConfig

__all__ = ["resolve_mask_token", "resolve_layers", "captured_depth", "build_header",
           "tokenizer_hash", "target_fingerprint", "in_form_of", "resume_plan"]

log = logging.getLogger(__name__)

HEADER_KIND = "dflash-extract"
# Bytes hashed at the start and at the end of every tensor, and windows of other weight files.
_SAMPLE = 4096
_WINDOWS = 64


def resolve_mask_token(vocab_size: int, num_tokenizer_tokens: int, explicit: int | None, model: str) -> int:
    """Return the DFlash mask token: --mask-token-id if given, else the first embedding row the tokenizer never uses."""
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise ConfigError(
                f"--mask-token-id {explicit} is outside the target's embedding rows 0..{vocab_size - 1} ({model})"
            )
        return explicit
    if vocab_size > num_tokenizer_tokens:
        return num_tokenizer_tokens
    raise InputError(
        f"--model {model}: every embedding row ({vocab_size}) is a tokenizer token, so there is no unused row for "
        "the DFlash mask token; pass --mask-token-id N with an unused special token"
    )


def resolve_layers(explicit: tuple[int, ...] | None, num_layers: int) -> list[int]:
    """Return the captured layer ids: build_target_layer_ids(num_layers, 5) for auto, else the validated list."""
    if explicit is None:
        return build_target_layer_ids(num_layers, NUM_FEATURE_LAYERS)
    return validate_layer_ids(list(explicit), num_layers)


def captured_depth(explicit: tuple[int, ...] | None, model_config: Any) -> int | None:
    """Return how many decoder layers extraction runs (the deepest captured id + 1); None when the config names
    no layer count or the ids do not fit it (the architecture check, then the header, say what is wrong)."""
    num_layers = getattr(text_config(model_config), "num_hidden_layers", None)
    try:
        return None if num_layers is None else max(resolve_layers(explicit, int(num_layers))) + 1
    except ConfigError:
        return None


def tokenizer_hash(tokenizer: Any) -> str:
    """Return a hash of the tokenizer's vocabulary and rules (its backend JSON when it has one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return text_hash(backend.to_str())
    return text_hash(repr(sorted(tokenizer.get_vocab().items())))


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def _safetensors_part(f: Any, size: int, h: Any) -> str | None:
    """Hash a safetensors file's JSON header and the first and last bytes of every tensor; return what is wrong
    with the file instead when it is not a whole safetensors file (None when it is)."""
    import json
    import struct

    head = f.read(8)
    if len(head) < 8:
        return f"{size} bytes, less than the 8-byte header length"
    n = struct.unpack("<Q", head)[0]
    if not 0 < n <= size - 8:
        return f"a header length of {n:,} bytes in a file of {size:,}"
    meta = f.read(n)
    try:
        tensors = json.loads(meta)
    except ValueError:
        return "a header that is not JSON"
    h.update(head + meta)
    base = 8 + n
    try:
        spans = sorted(tuple(v["data_offsets"]) for k, v in tensors.items() if k != "__metadata__")
    except (AttributeError, KeyError, TypeError):
        return "a JSON header without tensor offsets"
    last = max((end for _, end in spans), default=0)
    if base + last > size:
        return f"tensors up to byte {base + last:,} in a file of {size:,} (cut short)"
    for start, end in spans:
        for lo in sorted({start, max(start, end - _SAMPLE)}):
            f.seek(base + lo)
            h.update(f.read(min(_SAMPLE, end - lo)))
    return None


def target_fingerprint(model_dir: str | os.PathLike) -> str:
    """Return a cheap content fingerprint of a model folder's config and weights; InputError if it has no weights
    or a safetensors file that is not whole.

    Hashes config.json, every weight file's name and size, each safetensors file's JSON header (every tensor's
    name, dtype, shape and byte range), and the first and last 4 KiB of every tensor; other weight formats give
    64 windows of 4 KiB spread over the file. About 8 KiB a tensor, so a 60 GB target costs milliseconds, not a
    minute of hashing. Why that is enough: a copy or a moved folder has the same bytes, so the same fingerprint;
    another checkpoint (other training, other seed, a merged adapter, another dtype or shape) changes its header
    or essentially every value of the tensors it touches, so some hashed bytes differ. What it cannot see is an
    edit confined to the middle of a tensor, which no real checkpoint produces.
    """
    folder = Path(model_dir)
    weights = weight_files(folder)
    if not weights:
        raise InputError(
            f"--model {model_dir}: expected weights ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) beside "
            "config.json, found none; point --model at a complete Hugging Face model folder"
        )
    h = hashlib.blake2b(digest_size=16)
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for p in weights:
        size = p.stat().st_size
        h.update(f"\0{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            if p.suffix == ".safetensors":
                # Checked here, before the store exists, so weights that cannot load refuse the run in one line
                # and leave nothing behind (a load that failed later, beside the start-up, would not).
                wrong = _safetensors_part(f, size, h)
                if wrong is not None:
                    raise InputError(
                        f"--model {model_dir}: expected {p.name} to be a safetensors file (header length, JSON "
                        f"header, tensor bytes), found {wrong}; re-download or re-save the model's weights"
                    )
                continue
            for k in range(_WINDOWS):
                f.seek(k * max(0, size - _SAMPLE) // max(1, _WINDOWS - 1))
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def resume_plan(header: dict[str, Any], stored: dict[str, Any] | None, asked: int | None) -> dict[str, Any]:
    """Return the header with the stored store's shard plan when no --shard-size was asked for and it plans the
    same rows: the default depends on where the weights run (a sharded run's shards hold several of its batches), and a
    store resumed elsewhere keeps the shards it has."""
    plan = (stored or {}).get("shard_plan")
    if asked is None and isinstance(plan, dict) and plan.get("num_rows") == header["shard_plan"].get("num_rows"):
        return {**header, "shard_plan": plan}
    return header


def in_form_of(header: dict[str, Any], stored: dict[str, Any] | None) -> dict[str, Any]:
    """Return this run's header in the form of an existing store written by an older dflash, when it is one.

    A store written before the kernels (or the runtime) were recorded resumes without them: its header, and so
    the digest its commit records carry, never named them. A store written before the data's generation record resumes without one (its header, and so the digest its
    commit records carry, never had it). A store written before target fingerprints named its target by path
    alone (and its records name no header digest): it resumes under that rule. So upgrading dflash never strands
    a half-written store; a new store always gets both.
    """
    for newer in ("kernels", "runtime"):  # informational fields younger than some stores
        if stored is not None and newer not in (stored.get("informational") or [newer]):
            header = {k: v for k, v in header.items() if k != newer}
            header["informational"] = [k for k in header["informational"] if k != newer]
    if stored is not None and "generated_by" not in (stored.get("dataset") or {}):
        header = {**header, "dataset": {k: v for k, v in header["dataset"].items() if k != "generated_by"},
                  "informational": [k for k in header["informational"] if k != "dataset.generated_by"]}
    if stored is None or "fingerprint" in (stored.get("target") or {}):
        return header
    legacy = {k: v for k, v in header.items() if k not in ("informational", "runtime")}
    legacy["target"] = {k: v for k, v in header["target"].items() if k != "fingerprint"}
    return legacy


def build_header(cfg: "ExtractConfig", model_config: Any, tokenizer: Any, template: str,
                 scan: RowScan, min_shard_tokens: int = 0) -> dict[str, Any]:
    """Return the header this run's store must have (scan: plan.scan_rows of the data; min_shard_tokens: the
    fewest tokens a default shard holds); any difference from an existing store is a mismatch."""
    text = text_config(model_config)  # a multimodal wrapper's language model keeps these fields nested
    num_layers = int(text.num_hidden_layers)
    layer_ids = resolve_layers(cfg.layers, num_layers)
    hidden = int(text.hidden_size)
    mask = resolve_mask_token(int(text.vocab_size), len(tokenizer), cfg.mask_token_id, cfg.model)
    num_rows = len(scan.tokens)
    shard_size = cfg.shard_size or default_shard_size(scan.tokens_per_row(), len(layer_ids) * hidden * 2,
                                                      min_tokens=min_shard_tokens)
    files = input_files(cfg.data)
    config_file = Path(cfg.model) / "config.json"
    archs = getattr(model_config, "architectures", None) or [type(model_config).__name__]
    return {
        "kind": HEADER_KIND,
        # The target is what its config and weights are, not where they lie: a copied or moved folder is the
        # same target (train, too, ignores where the store lies). The path is kept to tell the user, not compared.
        # How `dflash generate` made the data (its numerics above all: decoding that verifies in other numerics
        # meets text the drafter never saw) is recorded to be shown, not compared.
        # The kernels the target ran (targets/kernels.py) differ by device and library, never by what is stored.
        "informational": ["target.path", "dataset.generated_by", "kernels", "runtime"],
        "target": {
            "path": os.path.abspath(cfg.model),
            "architecture": archs[0],
            "config_hash": _file_hash(config_file) if config_file.is_file() else None,
            "fingerprint": target_fingerprint(cfg.model),
            "num_layers": num_layers,
            "vocab_size": int(text.vocab_size),
        },
        "layer_ids": layer_ids,
        "hidden_size": hidden,
        "feature_dtype": "bfloat16",
        "compute_dtype": cfg.dtype,
        "codec": resolve_codec(cfg.codec),  # extract resolves auto against a resumed store first
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": text_hash(template),
        # Only when given, so stores made before the option existed keep their header.
        **({"chat_template_kwargs": cfg.chat_template_kwargs} if cfg.chat_template_kwargs else {}),
        "mask_token_id": mask,
        "max_length": cfg.max_length,
        "min_loss_tokens": cfg.min_loss_tokens,
        "dataset": {
            "fingerprint": fingerprint(files),
            "files": [f.name for f in files],
            "rows": num_rows,
            "bad_rows": dict(sorted(scan.bad.counts.items())),
            "generated_by": {f.name: g for f in files if (g := generated_by(f)) is not None},
        },
        "shard_plan": shard_record(num_rows, shard_size),
        # What ran the target (shown, not compared: a resumed run may run on other releases).
        "runtime": runtime_record(),
    }
