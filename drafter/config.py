"""A drafter's shape (DrafterConfig): derived from its target's config.json and the DFlash options, checked against
the store it trains or is evaluated on, and saved as JSON beside its weights."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers import Qwen3Config

from ..errors import ConfigError, InputError, ManifestMismatch

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["DrafterConfig", "DRAFTERS", "layer_types_for", "drafter_rope", "check_compatible", "for_store"]

DRAFTERS = ("dflash", "dflash2")
# Fields a DFlash 1 drafter does not have: left out of its to_dict, so its files and run records stay as they were.
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Target config keys that change the drafter's logits or inputs (read as the reference inference code reads them),
# and their identity values, also left out of to_dict.
_TARGET_SCALES = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
# Rope keys a drafter never takes from its target. SGLang's DFlash drafter rotates the whole head whatever its
# config says (get_rope with rotary_dim = head_dim), vLLM's honours rope_parameters' partial_rotary_factor: only a
# drafter without one runs alike in both, and so it trains with full rotary. Multimodal sections (mrope) would make
# both engines build a multimodal rotary for 1-D positions.
_TARGET_ONLY_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
# Rope types transformers, SGLang and vLLM all build for the drafter; another (Gemma 4's "proportional") becomes the
# default rotary at the target's theta.
_DRAFTER_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# A drafter's MLP width as a multiple of the hidden size when its MoE target names no dense intermediate_size
# (Qwen3.5-MoE): Qwen3-Coder-30B-A3B's own dense width is 3 x 2048.
_MOE_INTERMEDIATE_RATIO = 3

def layer_types_for(num_layers: int, sliding_window: int | None, full_every: int | None) -> list[str]:
    """Return the attention type of each drafter layer: all full, or sliding with every K-th layer full."""
    if sliding_window is None or full_every is None:
        return ["full_attention"] * num_layers
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(num_layers)]


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Shape of a drafter: the target's attention geometry plus the DFlash settings (block, layer ids, mask token)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1, 9, 17, 25, 33)
    num_target_layers: int = 36
    mask_token_id: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    drafter: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(["full_attention"] * self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"drafter layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; rebuild the config with DrafterConfig.from_target"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ConfigError(f"drafter layer_types {bad} are not full_attention or sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("drafter has sliding_attention layers but no sliding_window; pass --sliding-window W")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask token id {self.mask_token_id} is outside the target vocabulary 0..{self.vocab_size - 1}; "
                "rerun `dflash extract` with --mask-token-id"
            )
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}; pass --drafter")
        if self.drafter == "dflash2":
            checks = [
                (self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
                 f"--conv-group-size {self.conv_group_size} must divide the hidden size {self.hidden_size}"),
                (1 <= self.conv_kernel_size <= self.block_size,
                 f"--conv-kernel-size {self.conv_kernel_size} must be in 1..block size {self.block_size}"),
                (self.selector_rank >= 1, f"--selector-rank must be >= 1, got {self.selector_rank}"),
                (1 <= self.selector_top_k <= self.vocab_size,
                 f"--selector-top-k {self.selector_top_k} must be in 1..vocab size {self.vocab_size}"),
            ]
            for ok, message in checks:
                if not ok:
                    raise ConfigError(message)
        # Top-K of the transformed logits must be the top-K of the raw ones (the loss finds them on the raw side).
        if not self.output_multiplier > 0:
            raise ConfigError(f"target output_multiplier must be > 0, got {self.output_multiplier}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ConfigError(f"target final_logit_softcapping must be > 0, got {self.final_logit_softcapping}")

    @classmethod
    def from_target(
        cls,
        target: str | os.PathLike | dict[str, Any],
        *,
        target_layer_ids: list[int] | tuple[int, ...],
        mask_token_id: int,
        draft_layers: int = 5,
        block_size: int = 16,
        sliding_window: int | None = None,
        full_every: int | None = None,
        drafter: str = "dflash",
        **dflash2: int,
    ) -> "DrafterConfig":
        """Return the drafter config derived from a target folder (or its config.json mapping) and DFlash options.

        dflash2: conv_kernel_size, conv_group_size, selector_rank, selector_top_k (for drafter "dflash2").
        """
        cfg = _read_target_config(target) if not isinstance(target, dict) else target
        cfg = cfg.get("text_config", cfg)  # multimodal targets keep the language model's fields nested
        scales = {k: cfg[k] for k in _TARGET_SCALES if cfg.get(k) is not None}
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            intermediate = cfg.get("intermediate_size") or _MOE_INTERMEDIATE_RATIO * hidden
            return cls(
                hidden_size=hidden,
                intermediate_size=int(intermediate),
                num_hidden_layers=draft_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_parameters=drafter_rope(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
                hidden_act=str(cfg.get("hidden_act", "silu")),
                block_size=block_size,
                target_layer_ids=tuple(target_layer_ids),
                num_target_layers=int(cfg["num_hidden_layers"]),
                mask_token_id=mask_token_id,
                layer_types=tuple(layer_types_for(draft_layers, sliding_window, full_every)),
                sliding_window=sliding_window if full_every else None,
                drafter=drafter,
                **(dflash2 if drafter == "dflash2" else {}),
                **scales,
            )
        except KeyError as e:
            raise InputError(f"target config {target if not isinstance(target, dict) else '<dict>'} has no {e}; "
                             "expected a Hugging Face decoder config.json") from None

    def to_dict(self) -> dict[str, Any]:
        """Return the config as JSON-able values (a DFlash 1 drafter's without the fields it does not use)."""
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        drop = [k for k, v in _TARGET_SCALES.items() if out[k] == v]
        if self.drafter == "dflash":
            drop += ["drafter", *_DFLASH2_FIELDS]
        return {k: v for k, v in out.items() if k not in drop}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DrafterConfig":
        """Return the config stored by `to_dict`; unknown keys are refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"drafter config has unknown field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)

    def qwen3_config(self) -> Qwen3Config:
        """Return the transformers Qwen3Config of the drafter's layers (what the exported config.json extends)."""
        sliding = "sliding_attention" in self.layer_types
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            use_sliding_window=sliding,
            sliding_window=self.sliding_window,
            max_window_layers=self.num_hidden_layers,
            layer_types=list(self.layer_types),
            tie_word_embeddings=False,
        )


def drafter_rope(target: dict[str, Any]) -> dict[str, Any]:
    """Return the rope parameters of a drafter for a target's (text) config.json mapping: the target's rope, flat
    (the full-attention layers' where it has one per layer type, as Gemma does), with full rotary."""
    rope = target.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": float(target.get("rope_theta", 10000.0)),
        **(target.get("rope_scaling") or {}),
    }
    if "rope_theta" not in rope and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    rope = {k: v for k, v in rope.items() if k not in _TARGET_ONLY_ROPE}
    if rope.get("rope_type", rope.get("type", "default")) not in _DRAFTER_ROPE_TYPES:
        rope = {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))}
    return rope


def _read_target_config(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{file}: cannot read the target's config ({e}); pass --target a Hugging Face folder") from None


def check_compatible(cfg: DrafterConfig, header: dict[str, Any], drafter: str, store: str) -> None:
    """Raise ManifestMismatch naming each of hidden size, layer ids, mask token and vocab that differ."""
    pairs = [
        ("hidden_size", cfg.hidden_size, header.get("hidden_size")),
        ("layer_ids", list(cfg.target_layer_ids), header.get("layer_ids")),
        ("mask_token_id", cfg.mask_token_id, header.get("mask_token_id")),
        ("vocab_size", cfg.vocab_size, (header.get("target") or {}).get("vocab_size")),
    ]
    diffs = [f"{name}: drafter has {json.dumps(a)}, store has {json.dumps(b)}" for name, a, b in pairs if a != b]
    if diffs:
        raise ManifestMismatch(
            f"drafter {drafter} does not fit store {store} ({'; '.join(diffs)}); evaluate it on a store extracted "
            "from its own target with the same layers, or train a drafter on this store with `dflash train`"
        )


def for_store(cfg: "TrainConfig", header: dict[str, Any]) -> DrafterConfig:
    """Return the drafter shape `dflash train` builds for its target and the store whose header is given;
    ManifestMismatch if they do not belong together."""
    dcfg = DrafterConfig.from_target(
        cfg.target, target_layer_ids=header["layer_ids"], mask_token_id=int(header["mask_token_id"]),
        draft_layers=cfg.draft_layers, block_size=cfg.block_size, sliding_window=cfg.sliding_window,
        full_every=cfg.full_every, drafter=cfg.drafter, conv_kernel_size=cfg.conv_kernel_size,
        conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
    )
    check_compatible(dcfg, header, f"built from --target {cfg.target}", cfg.store)
    layers = (header.get("target") or {}).get("num_layers")
    if layers is not None and layers != dcfg.num_target_layers:
        raise ManifestMismatch(
            f"--target {cfg.target} has {dcfg.num_target_layers} decoder layers but store {cfg.store} was extracted "
            f"from a target with {layers}; pass --target the model the store was made from"
        )
    return dcfg
