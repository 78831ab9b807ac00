"""dflash's own check of a target's weight files: every tensor the model needs is in its safetensors, of the shape
it needs, with as many bytes as its header says.

transformers starts a tensor it cannot find at random and goes on (features from a model that is not the target, in
silence), and how it reports that has changed between releases (5.25's meta load raises where 5.24's returned its
missing keys). So the verdict here rests on nothing transformers reports: the model is built on the meta device (no
memory), the names and shapes of its parameters are its expectation, and transformers' conversions (fused experts,
concatenated projections, the renames of old checkpoints) are used only to spell each parameter as a checkpoint may
hold it; the headers are read by us, and the comparison is ours.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["check_weights", "read_headers", "expected_tensors", "Tensor", "WEIGHT_SUFFIXES", "weight_files"]

log = logging.getLogger(__name__)

# Files a Hugging Face folder keeps its weights in (safetensors, or the older pickles).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """Return the weight files of a local model folder (sorted; none if it is not a folder)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())

_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
          "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_FIX = "re-download or re-save the model's weights"


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors header: its file, dtype, shape and byte length."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _header(file: Path) -> dict[str, Any] | None:
    """Return a safetensors file's header without its metadata (None if the file has no whole header)."""
    try:
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if not 0 < n <= os.fstat(f.fileno()).st_size - 8:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    return {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None


def read_headers(files: list[Path], *, path: Any, option: str) -> dict[str, Tensor] | None:
    """Return {name: Tensor} over the safetensors files' headers (None if one has no readable header: the load then
    names the broken file); InputError where a header's dtype and shape disagree with the bytes it gives the tensor."""
    out: dict[str, Tensor] = {}
    for f in files:
        header = _header(f)
        if header is None:
            return None
        for name, t in header.items():
            try:
                begin, end = t["data_offsets"]
                shape = tuple(int(d) for d in t["shape"])
                size = _BYTES[t["dtype"]]
            except (KeyError, TypeError, ValueError):
                continue  # a dtype of its own: the load decides
            want = math.prod(shape) * size
            if end - begin != want:
                raise InputError(f"{option} {path}: tensor {name} in {f.name}: its header says {t['dtype']} "
                                 f"{list(shape)} ({want:,} bytes), the file holds {end - begin:,} bytes for it; {_FIX}")
            out[name] = Tensor(f.name, t["dtype"], shape, end - begin)
    return out


def _meta_model(folder: Path) -> Any:
    """Return the folder's causal LM (as AutoModelForCausalLM loads it) built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.fspath(folder))
    from transformers.models.auto.auto_factory import _get_model_class

    cls = _get_model_class(config, AutoModelForCausalLM._model_mapping)  # the class from_pretrained picks
    if getattr(cls, "config_class", type(config)) is not type(config) and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a multimodal wrapper loaded as its text LM
    with torch.device("meta"):
        return cls._from_config(config)  # noqa: SLF001 - from_config without the auto class's dispatch


def _chunk(name: str) -> str:
    """Return the part of a parameter's name up to its first index (model.layers.7): the parameters of one decoder
    layer are converted together."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def expected_tensors(model: Any) -> dict[str, tuple[dict[str, tuple[int, ...]], ...]]:
    """Return {module: spellings}: each spelling is a {checkpoint name: shape} set that holds the module's
    parameters, the model's own names first, then the checkpoint format transformers converts from (its save
    writes that: per-expert tensors of a fused experts module, say)."""
    from transformers.core_model_loading import revert_weight_conversion

    chunks: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():  # tied parameters once, under their first name
        chunks.setdefault(_chunk(name), {})[name] = p
    out: dict[str, tuple[dict[str, tuple[int, ...]], ...]] = {}
    for params in chunks.values():
        modules: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, p in params.items():
            modules.setdefault(name.rpartition(".")[0], {})[name] = tuple(p.shape)
        try:
            reverted = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(params)).items()}
        except Exception as e:  # noqa: BLE001 - a conversion that cannot run on this part alone: own names only
            log.debug("no checkpoint spelling of %s: %s", next(iter(params)), e)
            reverted = {}
        # Each converted name belongs to the module it lies under (the longest module path that prefixes it).
        theirs: dict[str, dict[str, tuple[int, ...]]] = {m: {} for m in modules}
        for key, shape in reverted.items():
            owner = max((m for m in modules if key.startswith(m + ".")), key=len, default=None)
            if owner is None:  # renamed out of every module (a prefix change): the chunk as one unit
                theirs = {}
                break
            theirs[owner][key] = shape
        if not theirs and reverted:
            whole = {k: v for m in modules.values() for k, v in m.items()}
            out[next(iter(modules))] = (whole,) if reverted == whole else (whole, reverted)
            continue
        for module, own in modules.items():
            other = theirs.get(module) or own
            out[module] = (own,) if other == own else (own, other)
    return out


def _prefix(names: list[str], headers: dict[str, Tensor]) -> tuple[str, str]:
    """Return (old, new): the checkpoint spells names beginning `old` with `new` instead (a multimodal wrapper's
    text model, model.language_model.*), or ("", "") where it spells them as the model does."""
    by_tail: dict[str, list[str]] = {}
    for key in headers:
        by_tail.setdefault(".".join(key.split(".")[-3:]), []).append(key)
    votes: Counter[tuple[str, str]] = Counter()
    for name in names:
        if name in headers:
            votes["", ""] += 1
            continue
        head, _, rest = name.partition(".")
        for key in by_tail.get(".".join(name.split(".")[-3:]), ()):
            if rest and key.endswith("." + rest):
                votes[head + ".", key[: -len(rest)]] += 1
    return votes.most_common(1)[0][0] if votes else ("", "")


def _ignored(model: Any) -> list[re.Pattern[str]]:
    """Return the patterns of parameters the model's class declares it may be loaded without."""
    return [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]


def check_weights(path: str | os.PathLike, *, option: str = "--model") -> None:
    """Raise InputError unless the folder's safetensors hold every tensor its causal LM needs, each of the shape it
    needs, with the bytes its header's dtype and shape call for. Reads the headers alone (no tensor data). Tensors
    the model does not use (a vision tower, multi-token-prediction heads) are left alone; folders of other weight
    formats, or a model transformers cannot build, are left to the load."""
    folder = Path(path)
    files = [f for f in weight_files(folder) if f.suffix == ".safetensors"]
    headers = read_headers(files, path=path, option=option) if files else None
    if not headers:
        return
    try:
        model = _meta_model(folder)
    except Exception as e:  # noqa: BLE001 - not a causal LM transformers builds: the load says so in its words
        log.debug("no weight check for %s: %s", folder, e)
        return
    expected = expected_tensors(model)
    ignored = _ignored(model)
    old, new = _prefix([k for spellings in expected.values() for s in spellings for k in s], headers)

    def spell(key: str) -> str:
        return new + key[len(old):] if old and key.startswith(old) else key

    missing: list[str] = []
    for module, spellings in expected.items():
        wrong: list[tuple[str, tuple[int, ...]]] = []
        for spelling in spellings:
            present = {spell(k): shape for k, shape in spelling.items() if spell(k) in headers}
            bad = [(k, shape) for k, shape in present.items() if headers[k].shape != shape]
            if len(present) == len(spelling) and not bad:
                break  # held whole in this spelling
            wrong = wrong or bad
        else:
            if wrong:
                k, shape = wrong[0]
                more = f" (and {len(wrong) - 1} more mismatched)" if len(wrong) > 1 else ""
                raise InputError(f"{option} {path}: expected tensor {k} of shape {list(shape)}, found "
                                 f"{list(headers[k].shape)} in {headers[k].file}{more}; {_FIX}")
            if not any(p.search(k) for p in ignored for k in spellings[0]):
                # Named as the checkpoint spells it: the first absent key of its most nearly present spelling.
                best = max(spellings, key=lambda s: sum(spell(k) in headers for k in s))
                missing.append(next(spell(k) for k in best if spell(k) not in headers))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{option} {path}: expected tensor {missing[0]}{more}, found it in none of "
                         f"{', '.join(f.name for f in files)} (the model would start it at random); {_FIX}")
