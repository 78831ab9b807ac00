"""The folder format of a drafter: its weights and config files, the Hugging Face export, and loading either.

    DRAFTER/model.safetensors      the drafter's tensors under their bare names (layers.*, fc, hidden_norm, norm;
                                   DFlash 2 also layers.N.{attention,mlp}_conv.*, candidate_selector.*)
    DRAFTER/drafter_config.json    DrafterConfig.to_dict(): a checkpoint's step folder holds these two
    EXPORT/config.json             the Qwen3 fields plus what DFlash inference reads (written last: a folder with
                                   it is a finished export), beside model.safetensors in bf16
An export is checked against the tensors the serving engines load (`serving_tensors`, the names and shapes of
z-lab's DFlashDraftModel / DFlash2DraftModel): SGLang skips a tensor it does not know without a word, so a folder
that would load only partly is never written.
Which folder of a run holds a drafter is the checkpointer's business (`dflash.train.checkpoint`); this module
knows only what is inside one.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..runtime.atomic import write_atomic
from ..errors import DflashError, InputError
from .config import DrafterConfig
from .folders import DRAFTER_CONFIG, EXPORT_CONFIG, WEIGHTS, resolve_drafter
from .model import DFlashDrafter

__all__ = [
    "drafter_state",
    "write_drafter_files",
    "save_drafter_files",
    "export_config",
    "config_from_export",
    "serving_tensors",
    "check_serving_tensors",
    "write_export",
    "load_drafter",
    "open_drafter",
]

log = logging.getLogger(__name__)

# Wrappers (DDP, torch.compile, FSDP) prefix parameter names; the export carries the bare names.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def export_config(cfg: DrafterConfig) -> dict[str, Any]:
    """Return config.json of an export: the Qwen3 fields plus what DFlash inference reads."""
    out = cfg.qwen3_config().to_dict()
    for key in ("transformers_version", "_name_or_path", "id2label", "label2id"):
        out.pop(key, None)
    dflash: dict[str, Any] = {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id}
    if cfg.drafter == "dflash2":  # the keys of z-lab's DFlash 2 config (block_size lives here too)
        dflash.update(block_size=cfg.block_size, conv_kernel_size=cfg.conv_kernel_size,
                      conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
                      selector_top_k=cfg.selector_top_k)
    # The target's logit and embedding scales, where the reference's compute_logits and generate loop read them.
    dflash.update({k: v for k, v in cfg.to_dict().items() if k in _SCALE_KEYS})
    out.update(
        architectures=["DFlash2DraftModel" if cfg.drafter == "dflash2" else "DFlashDraftModel"],
        block_size=cfg.block_size,
        num_target_layers=cfg.num_target_layers,
        dflash_config=dflash,
        layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window,
        # The block is bidirectional in every layer, sliding ones too; the reference makes sliding layers causal
        # unless the config says otherwise, so say it.
        is_causal=False,
        dtype="bfloat16",
        torch_dtype="bfloat16",
    )
    return out


_SCALE_KEYS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def config_from_export(data: dict[str, Any]) -> DrafterConfig:
    """Return the DrafterConfig of an exported config.json (DFlashDraftModel or DFlash2DraftModel)."""
    try:
        dflash = data["dflash_config"]
        rope = data.get("rope_parameters") or {"rope_type": "default", "rope_theta": data.get("rope_theta", 1e4)}
        two = "DFlash2DraftModel" in (data.get("architectures") or ())
        extra: dict[str, Any] = {k: dflash.get(k, data.get(k)) for k in _SCALE_KEYS
                                 if dflash.get(k, data.get(k)) is not None}
        if two:
            extra.update(drafter="dflash2", **{k: dflash[k] for k in _DFLASH2_KEYS})
        return DrafterConfig(
            hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"], num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data["num_key_value_heads"], head_dim=data["head_dim"], vocab_size=data["vocab_size"],
            rms_norm_eps=data["rms_norm_eps"], rope_parameters=dict(rope),
            max_position_embeddings=data["max_position_embeddings"], hidden_act=data.get("hidden_act", "silu"),
            block_size=dflash.get("block_size", data.get("block_size", 16)),
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            num_target_layers=data["num_target_layers"], mask_token_id=dflash["mask_token_id"],
            layer_types=tuple(data.get("layer_types") or ()), sliding_window=data.get("sliding_window"), **extra,
        )
    except KeyError as e:
        raise InputError(f"exported config.json has no {e}; re-export with `dflash export`") from None


def serving_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Return {name: shape} of the tensors the serving engines load for this drafter, written out from the engines'
    contract (z-lab's DFlashDraftModel / DFlash2DraftModel and their released checkpoints), not from our model."""
    H, I, V, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(cfg.target_layer_ids) * H), "hidden_norm.weight": (H,),
                                       "norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                 "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
                 "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
                 "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                 "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
        if cfg.drafter == "dflash2":
            k, groups = cfg.conv_kernel_size, H // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                layer[f"{conv}.base_kernel"] = (2, k, H)
                layer[f"{conv}.kernel_projection.weight"] = (2 * k * groups, H)
        out.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    if cfg.drafter == "dflash2":
        r = cfg.selector_rank  # the codebooks are bare tensors: no `.weight`
        out.update({"candidate_selector.hidden_projection.weight": (r, H),
                    "candidate_selector.predecessor_codebook": (V, r),
                    "candidate_selector.successor_codebook": (V, r)})
    return out


def check_serving_tensors(weights: dict[str, torch.Tensor], cfg: DrafterConfig, where: str) -> None:
    """Raise DflashError (one line) unless weights hold exactly the tensors and shapes `serving_tensors` names."""
    want = serving_tensors(cfg)
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    bad = sorted(n for n in set(want) & set(weights) if tuple(weights[n].shape) != want[n])
    if missing or extra or bad:
        shapes = [f"{n} {tuple(weights[n].shape)} (expected {want[n]})" for n in bad[:3]]
        raise DflashError(
            f"{where}: the drafter's tensors are not the {len(want)} an engine loads for "
            f"{export_config(cfg)['architectures'][0]} (missing {missing[:3]}, unknown {extra[:3]}, wrong shape "
            f"{shapes}); engines would serve it partly random, so nothing was exported; report this as a dflash bug"
        )


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read JSON ({e}); re-export or pick another checkpoint") from None


def _state_dict(folder: Path, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Return the weights of a checkpoint or export with bare names, checked against the drafter's own names."""
    from safetensors.torch import load_file

    raw = load_file(str(folder / WEIGHTS))
    sd = {}
    for name, t in raw.items():
        for prefix in _WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        sd[name] = t
    with torch.device("meta"):
        expected = DFlashDrafter(cfg).state_dict()
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        raise InputError(
            f"{folder / WEIGHTS}: expected the drafter's {len(expected)} tensors, found {len(sd)} "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); it does not match {DRAFTER_CONFIG}, pick another checkpoint"
        )
    bad = [n for n in expected if tuple(sd[n].shape) != tuple(expected[n].shape)]
    if bad:
        raise InputError(f"{folder / WEIGHTS}: tensor {bad[0]} has shape {tuple(sd[bad[0]].shape)}, "
                         f"expected {tuple(expected[bad[0]].shape)} from its config; pick another checkpoint")
    return sd


def drafter_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return (a host copy of the drafter's weights under their bare names, its config as a dict).

    A DDP or compiled wrapper is fine. The tensors are copies: training may go on changing the model meanwhile.
    """
    inner = model
    while hasattr(inner, "module") or hasattr(inner, "_orig_mod"):
        inner = getattr(inner, "module", None) or getattr(inner, "_orig_mod")
    sd = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in inner.state_dict().items()}
    return sd, inner.config.to_dict()


def write_drafter_files(weights: dict[str, torch.Tensor], config: dict[str, Any], folder: str | os.PathLike) -> Path:
    """Write weights (model.safetensors) and config (drafter_config.json) into folder, each atomically, the config
    last; return folder."""
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / WEIGHTS, save(weights, metadata={"format": "pt"}))
    write_atomic(folder / DRAFTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return folder


def save_drafter_files(model: torch.nn.Module, folder: str | os.PathLike) -> Path:
    """Write a drafter's weights (model.safetensors, bare names) and drafter_config.json into folder; return it."""
    return write_drafter_files(*drafter_state(model), folder)


def write_export(src: str | os.PathLike, out: str | os.PathLike, *, remote_code: bool = False) -> Path:
    """Write the drafter of folder `src` (drafter files) as an HF folder at out; return out.

    out gets model.safetensors (bf16; exactly the tensors of `serving_tensors`) and, written last, config.json. With remote_code, also modeling_dflash.py and an auto_map for trust_remote_code loading.
    """
    from safetensors.torch import save

    src = Path(src)
    cfg = DrafterConfig.from_dict(read_json(src / DRAFTER_CONFIG))
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(_state_dict(src, cfg).items())}
    out = Path(out)
    check_serving_tensors(sd, cfg, f"--out {out}")
    if remote_code and cfg.drafter != "dflash":
        raise InputError(f"--remote-code writes DFlash 1's modeling file, but {src} is a {cfg.drafter} drafter; "
                         "export without --remote-code (z-lab's dflash package, SGLang and vLLM load DFlash 2)")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder; pass a new folder path")
    out.mkdir(parents=True, exist_ok=True)
    # config.json goes last: a folder with it is a finished export.
    (out / EXPORT_CONFIG).unlink(missing_ok=True)
    write_atomic(out / WEIGHTS, save(sd, metadata={"format": "pt", "source": str(src)}))
    config = export_config(cfg)
    if remote_code:
        from .remote_code import write_modeling_file

        write_modeling_file(out, write_atomic)
        config["auto_map"] = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    write_atomic(out / EXPORT_CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    log.info("exported %s (%d tensors) to %s", src, len(sd), out)
    return out


def load_drafter(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> DFlashDrafter:
    """Return the drafter of an export folder (config.json) or a checkpoint folder (drafter_config.json)."""
    path = Path(path)
    if (path / DRAFTER_CONFIG).is_file():
        cfg = DrafterConfig.from_dict(read_json(path / DRAFTER_CONFIG))
    elif (path / EXPORT_CONFIG).is_file():
        cfg = config_from_export(read_json(path / EXPORT_CONFIG))
    else:
        raise InputError(f"{path}: expected config.json (an export) or {DRAFTER_CONFIG} (a checkpoint), found "
                         "neither; run `dflash export --run RUN --out DIR`")
    sd = _state_dict(path, cfg)
    with torch.device("meta"):  # no throwaway random init of a billion parameters
        model = DFlashDrafter(cfg)
    model.load_state_dict(sd, assign=True)
    return model.to(device=device, dtype=dtype or next(iter(sd.values())).dtype)


def open_drafter(path: str | os.PathLike, *, device: Any = "cpu", dtype: Any = None) -> Any:
    """Return the drafter (eval mode) of any folder `resolve_drafter` takes: an export, a checkpoint, a run."""
    folder, _ = resolve_drafter(path)
    return load_drafter(folder, device=device, dtype=dtype).eval()
