"""Frozen, keyword-only configuration of each stage, validated on construction and saved as JSON beside its output."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = [
    "option",
    "parse_layers",
    "parse_val_fraction",
    "parse_shard_ids",
    "parse_json_object",
    "parse_sampling_mix",
    "parse_budgets",
    "StageConfig",
    "ExtractConfig",
    "TrainConfig",
    "GenerateConfig",
    "EvalConfig",
    "DemoConfig",
    "RunConfig",
    "RUN_SHARED",
    "run_stage_options",
    "parse_gpus",
    "resolve_devices",
    "CODECS",
]

CODECS = ("blosc", "none", "fp8")
DRAFTERS = ("dflash", "dflash2")
DTYPES = ("bfloat16", "float32")
DTYPE_CHOICES = ("auto",) + DTYPES  # auto: target/numerics.py decides (bf16 on CUDA and on CPUs with native bf16)
GENERATE_ENGINES = ("auto", "fast", "plain")
POSITION_WEIGHTS = ("decay", "dpace")
DPACE_ALPHA = 0.5
# What a run made before an option existed trained with, where today's default differs: DFlash 2 with D-PACE won
# the A/B on one H200 (bench/RESULTS.md, "DFlash 2 and D-PACE"), so they became the defaults on 2026-12-01.
LEGACY_DEFAULTS = {"drafter": "dflash", "position_weights": "decay"}


def option(default: Any = dataclasses.MISSING, *, help: str, choices: tuple[str, ...] | None = None,
           cli_default: str | None = None, parse: str | None = None, metavar: str | None = None,
           unless: str | None = None) -> Any:
    """Return a config field whose metadata is its command-line option: the one place for default, choices, help.

    cli_default: the text the option shows and takes by default when the field's value is not text (layers: auto);
    parse: the name of this module's function that turns the option's text into the field's value;
    unless: a required field that may be None when this other option is given (its __post_init__ checks).
    """
    meta = {"help": help, "choices": choices, "cli_default": cli_default, "parse": parse, "metavar": metavar,
            "unless": unless}
    return dataclasses.field(default=default, metadata=meta)


def _parse_ids(value: Any, flag: str, example: str) -> tuple[int, ...]:
    """Return the ids of a comma-separated option value (or of a list of them)."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected comma-separated ids like {example}") from None


def parse_layers(value: Any) -> tuple[int, ...] | None:
    """Return the layer ids of a `--layers` value ("auto" -> None, "1,9,17" -> (1, 9, 17))."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    return _parse_ids(value, "--layers", "1,9,17,25,33 (or auto)")


def parse_shard_ids(value: Any) -> tuple[int, ...] | None:
    """Return the shard ids of a `--val-shards` value ("0,5,9" -> (0, 5, 9); None or "" -> None)."""
    if value is None or value == () or str(value).strip() == "":
        return None
    return _parse_ids(value, "--val-shards", "0,5,9")


def _json_text(value: Any, flag: str, expected: str) -> Any:
    """Return the value of a JSON option's text (a value given as data, e.g. from --config YAML, as it is)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {value!r}: expected {expected}, found invalid JSON ({e.msg})") from None


def parse_json_object(value: Any) -> dict[str, Any] | None:
    """Return the mapping of a JSON-object option value ('{"enable_thinking": false}' -> {...}; None or "" -> None)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    expected = "a JSON object like '{\"enable_thinking\": false}'"
    value = _json_text(value, "--chat-template-kwargs", expected)
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-template-kwargs {value!r}: expected {expected}, found a {type(value).__name__}")
    return json.loads(json.dumps(value, sort_keys=True)) or None


# What one entry of --sampling-mix may set for the prompts it draws (besides its "weight").
MIX_KEYS = ("temperature", "top_p", "top_k", "chat_template_kwargs")


def parse_sampling_mix(value: Any) -> tuple[dict[str, Any], ...] | None:
    """Return the entries of a `--sampling-mix` JSON list, each with its weight ('[{"weight": 0.3, "temperature":
    0.6}, ...]'; None or "" -> None)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    example = ('\'[{"weight": 0.7, "temperature": 0}, {"weight": 0.3, "temperature": 0.6, '
               '"chat_template_kwargs": {"enable_thinking": true}}]\'')
    value = _json_text(value, "--sampling-mix", f"a JSON list like {example}")
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(e, dict) for e in value):
        raise ConfigError(f"--sampling-mix {value!r}: expected a non-empty JSON list of objects like {example}")
    entries = []
    for e in value:
        unknown = sorted(set(e) - set(MIX_KEYS) - {"weight"})
        _check(not unknown, f"--sampling-mix entry {e}: unknown key(s) {unknown}; an entry sets weight and any of "
                            f"{', '.join(MIX_KEYS)}")
        weight = e.get("weight", 1)
        _check(isinstance(weight, (int, float)) and weight > 0,
               f"--sampling-mix entry {e}: weight must be a number > 0, got {weight!r}")
        _check(e.get("chat_template_kwargs") is None or isinstance(e["chat_template_kwargs"], dict),
               f"--sampling-mix entry {e}: chat_template_kwargs must be a JSON object")
        entries.append(json.loads(json.dumps({**e, "weight": weight}, sort_keys=True)))
    return tuple(entries)


def parse_budgets(value: Any) -> tuple[int, ...] | None:
    """Return the tree budgets of a `--tree-budgets` / `--tree-budget` value ("8,16,32,64" -> (8, 16, 32, 64);
    "" -> (); None -> None: not given)."""
    if value is None:
        return None
    return _parse_ids(value, "tree budgets", "8,16,32,64 (or '' for none)")


def parse_val_fraction(value: Any) -> float | None:
    """Return the fraction of a `--val-fraction` value ("auto" -> None: the split's own default)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--val-fraction {value!r}: expected auto or a fraction like 0.05") from None


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


def position_weights_option(default: str | None = "dpace", why: str = "") -> Any:
    """Return the --position-weights field (train's and the demo's: one help; the demo's default is its budget's)."""
    return option(default, choices=POSITION_WEIGHTS,
                  help="Loss weight of each block slot: decay is exp(-(k-1)/gamma), a weighted mean; dpace is "
                       "D-PACE (arXiv 2605.18810), each slot's share of the block's expected accepted length under "
                       "the drafter's own confidences, summed per block and averaged over blocks. Validation and "
                       "`dflash eval` losses stay decay-weighted." + why)


def drafter_option(default: str | None = "dflash2", why: str = "") -> Any:
    """Return the --drafter field (train's and the demo's: one help; the demo's default is its budget's)."""
    return option(default, choices=DRAFTERS,
                  help="Drafter architecture: dflash2 (DFlash2DraftModel: a grouped dynamic causal convolution around "
                       "each sublayer and a candidate selector) or dflash (DFlashDraftModel)." + why)


def tree_budgets_option(where: str) -> Any:
    """Return the --tree-budgets field (train's validation and eval's: one default, one help)."""
    return option((8, 16, 32, 64), parse="parse_budgets", metavar="N,N,..", cli_default="8,16,32,64",
                  help="Report tree tau for DDTree budgets of these many nodes" + where + ": 1 + the depth of the "
                       "longest gold prefix among the N best prefixes of the drafter's per-slot distributions "
                       "(teacher-forced; '' for none).")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_budgets(budgets: tuple[int, ...]) -> None:
    _check(all(n >= 1 for n in budgets), f"tree budgets must be node counts >= 1, got {list(budgets)}")


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

    def to_argv(self) -> list[str]:
        """Return the command-line flags that make this config (what `dflash run` passes the stage it starts)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value, flag = getattr(self, f.name), "--" + f.name.replace("_", "-")
            if f.type == "bool":
                out += [flag] if value else []
            elif value is None:
                continue
            elif isinstance(value, dict):
                out += [flag, json.dumps(value, sort_keys=True)]
            elif isinstance(value, tuple) and str(f.type).startswith("tuple[str"):
                for v in value:
                    out += [flag, str(v)]
            elif isinstance(value, tuple):
                out += [flag, ",".join(str(v) for v in value)]
            else:
                out += [flag, str(value)]
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as JSON, atomically (temp file, fsync, rename)."""
        from .runtime.atomic import write_atomic

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

    model: str = option(help="Target model: a Hugging Face folder (config.json, weights, tokenizer).")
    data: tuple[str, ...] = option(
        help="Conversations (repeatable): .jsonl or .json (one array) rows of {messages: [{role, content}]}, "
             "ShareGPT {conversations: [{from, value}]} or Alpaca {instruction, output}; .parquet/.arrow with such "
             "columns; or a `datasets` save_to_disk folder.", metavar="FILE")
    out: str = option(help="Store path (a folder or an fsspec URL); rerun the same command to resume.")
    gpus: str = option("0,1,2,3,4", help="GPU indices (0,1,2 or 0-4; one worker process each), or cpu.")
    layers: tuple[int, ...] | None = option(
        None, cli_default="auto", parse="parse_layers",
        help="Target decoder layers to capture: auto (5 evenly spaced from 1 to L-3, as DFlash does) or ids like "
             "1,9,17,25,33.")
    max_length: int = option(4096, help="Tokens per conversation; longer ones are cut (and counted).")
    min_loss_tokens: int = option(32, help="Drop conversations with fewer assistant (loss) tokens than this.")
    shard_size: int | None = option(None, help="Source rows per shard [default: sized to ~2 GB of features].")
    batch_tokens: int = option(32768, help="Tokens per target forward batch, padding included (>= --max-length).")
    codec: str = option("blosc", choices=CODECS,
                        help="Feature encoding: blosc (lossless, ~0.69x raw bf16), none (raw), fp8 (lossy, ~0.43x).")
    chat_template: str | None = option(None, help="Jinja chat template file to use instead of the tokenizer's.")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, parse="parse_json_object", metavar="JSON",
        help='Extra variables of the chat template as a JSON object, e.g. \'{"enable_thinking": false}\' for Qwen3: '
             'render what the serving engine renders. Recorded; a rerun into the same output must keep them.')
    mask_token_id: int | None = option(
        None, help="Mask token of the drafter's blocks. Default: the first embedding row the tokenizer does not use "
                   "(when vocab_size > len(tokenizer)); a target with a full vocabulary needs an unused special "
                   "token's id here. Recorded in the store.")
    strict: bool = option(False, help="Stop at the first bad row instead of counting it.")
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Dtype the target runs in: auto is bfloat16 on CUDA and on CPUs with native bf16, "
                             "float32 on other CPUs (a store being resumed keeps its own). Recorded in the store.")
    writer_threads: int | None = option(
        None, help="Threads per worker that compress and write chunks [default: this machine's CPUs shared among "
                   "its workers, 2-16].")
    dry_run: bool = option(False, help="Print the plan (samples, tokens, drops, projected store size, free space, "
                                       "times) and exit without writing.")
    force: bool = option(False, help="Start even when the projected store is larger than the free space.")
    profile: str | None = option(
        None, metavar="FILE",
        help="Write each worker's timeline as JSON to FILE: seconds of start-up (imports, device, model load, data, "
             "plan) and per shard (tokenise, pack, forward, copy, waits, compress, write+fsync, commit); on CUDA also "
             "the device's time in each forward and idle between them (events, no synchronize: it runs as fast).")

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
        _check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        _check(self.mask_token_id is None or self.mask_token_id >= 0, "--mask-token-id must be >= 0")
        _check(self.writer_threads is None or self.writer_threads >= 1,
               f"--writer-threads must be >= 1, got {self.writer_threads}")
        if self.layers is not None:
            _check(len(self.layers) >= 1, "--layers is empty; pass auto or e.g. 1,9,17,25,33")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(StageConfig):
    """Options of `dflash train`: store, target, run folder, devices, model shape, optimisation, checkpoints."""

    store: str = option(help="Feature store made by `dflash extract`.")
    target: str = option(help="Target model folder (its embedding and lm_head are read, frozen).")
    out: str = option(help="Run folder: checkpoints, metrics.jsonl, config.json, curves.png.")
    gpus: str = option("5,6,7", help="GPU indices (one DDP process each), or cpu.")
    epochs: int = option(6, help="Passes over the training shards.")
    max_steps: int | None = option(None, help="Stop after this many optimizer steps (the schedule follows).")
    batch_tokens: int = option(16384, help="Context tokens per micro-batch (one slot's batch).")
    lr: float = option(6e-4, help="Peak learning rate of AdamW (cosine schedule after warmup).")
    warmup_ratio: float = option(0.04, help="Fraction of the run spent in linear warmup.")
    weight_decay: float = option(0.0, help="AdamW weight decay.")
    clip: float = option(1.0, help="Gradient-norm clip.")
    draft_layers: int = option(5, help="Decoder layers of the drafter.")
    drafter: str = drafter_option()
    conv_kernel_size: int = option(2, help="dflash2: taps of each layer's causal convolution along the block.")
    conv_group_size: int = option(16, help="dflash2: channels sharing one dynamic tap (must divide the hidden size).")
    selector_rank: int = option(256, help="dflash2: rank of the candidate selector's predecessor-successor term.")
    selector_top_k: int = option(16, help="dflash2: candidates per slot the selector rescores (the top-K logits).")
    block_size: int = option(16, help="Block size B: the anchor plus B-1 drafted tokens.")
    anchors: int = option(512, help="Blocks drawn per sample; a batch holds at most --batch-tokens/4 blocks in all.")
    grad_accum: int = option(1, help="Micro-batches per rank per step; the global batch is GPUs x this (slots).")
    seed: int = option(0, help="Seed of data order, anchors and initialisation.")
    val_fraction: float | None = option(
        None, cli_default="auto", parse="parse_val_fraction",
        help="Fraction of shards held out for validation (by shard); auto holds out 2% (1 to 8 shards) of a store "
             "of 20 shards or more and none of a smaller one (`dflash eval` then scores every shard, and says so).")
    val_shards: tuple[int, ...] | None = option(
        None, parse="parse_shard_ids", metavar="IDS",
        help="Hold out exactly these shards (comma-separated ids) instead of --val-fraction's pick: for data laid "
             "out so that its held-out prompts fill known shards.")
    follow: bool = option(False, help="Train while `dflash extract` is still writing the store.")
    resume: bool = option(False, help="Continue from the newest complete checkpoint of --out.")
    save_every: int = option(1000, help="Checkpoint every N steps (and at the end).")
    save_every_minutes: float = option(30.0, help="Also checkpoint once this many minutes passed since the last "
                                                  "checkpoint (0: by --save-every alone).")
    keep: int = option(3, help="Checkpoints to keep.")
    log_every: int = option(10, help="Log a progress line every N steps (and the first step at once).")
    log_every_seconds: float = option(60.0, help="Also log once this many seconds passed since the last line.")
    tensorboard: bool = option(False, help="Also write TensorBoard events to RUN/tensorboard.")
    skip_corrupt: bool = option(False, help="Skip (and count) corrupt shards instead of stopping.")
    prefetch_shards: int = option(2, help="Whole shards each rank reads ahead.")
    sliding_window: int | None = option(None, help="Window of sliding layers (with --full-every).")
    full_every: int | None = option(None, help="Every K-th drafter layer attends fully (with --sliding-window).")
    attention: str = option("auto", choices=("auto", "flex", "sdpa"),
                            help="Attention kernel: auto is flex on CUDA, sdpa on CPU.")
    compile_layers: str = option(
        "auto", choices=("auto", "on", "off"),
        help="torch.compile each drafter layer's norms, projections, RoPE and MLP (attention is compiled apart), "
             "with dynamic shapes: one compile (~30 s) for the whole run. auto is on on CUDA (one H200, 8B-sized "
             "drafter, mixed lengths: MFU 37.0% -> 44.3%), off on CPU. The same math to float rounding.")
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Compute dtype (master weights stay fp32): auto is bfloat16 on CUDA and on CPUs with "
                             "native bf16, float32 on other CPUs (a run being resumed keeps its own). Recorded.")
    position_weights: str = position_weights_option()
    dpace_alpha: float = option(DPACE_ALPHA, help="D-PACE's confidence floor: q~ = (1 - alpha) q + alpha, in (0, 1] "
                                                  "(with --position-weights dpace; the paper's 0.5).")
    tree_budgets: tuple[int, ...] = tree_budgets_option(" in validation")
    tree_loss: int | None = option(
        None, metavar="N",
        help="Add the tree loss for DDTree serving with N nodes: sum_k w_k softplus(tau_N - S_k) per block, S_k the "
             "gold prefix's summed log-probs, tau_N the N-th best prefix score (no gradient), w_k the block loss's "
             "weights (README, train/tree_loss.py). Logged as loss_tree.")
    accept_loss: bool = option(
        False, help="Add minus the path's expected accepted length, sum_k prod_{i<=k} q_i(y_i) per block, over the "
                    "block loss's denominator. Logged as loss_accept.")

    def __post_init__(self) -> None:
        parse_gpus(self.gpus)
        _check(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        _check(self.max_steps is None or self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}")
        _check(self.batch_tokens >= 1, f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        _check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _check(0 <= self.warmup_ratio < 1, f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        _check(self.clip > 0, f"--clip must be > 0, got {self.clip}")
        _check(self.draft_layers >= 1, f"--draft-layers must be >= 1, got {self.draft_layers}")
        _check(self.drafter in DRAFTERS, f"--drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        _check(1 <= self.conv_kernel_size <= self.block_size,
               f"--conv-kernel-size must be in 1..--block-size ({self.block_size}), got {self.conv_kernel_size}")
        _check(self.conv_group_size >= 1, f"--conv-group-size must be >= 1, got {self.conv_group_size}")
        _check(self.selector_rank >= 1, f"--selector-rank must be >= 1, got {self.selector_rank}")
        _check(self.selector_top_k >= 1, f"--selector-top-k must be >= 1, got {self.selector_top_k}")
        _check(self.block_size >= 2, f"--block-size must be >= 2, got {self.block_size}")
        _check(self.anchors >= 1, f"--anchors must be >= 1, got {self.anchors}")
        _check(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        _check(self.val_fraction is None or 0 <= self.val_fraction < 1,
               f"--val-fraction must be auto or in [0, 1), got {self.val_fraction}")
        _check(self.val_shards is None or self.val_fraction is None,
               f"--val-shards {self.val_shards} and --val-fraction {self.val_fraction} both choose the held-out "
               "shards; pass one of them")
        _check(self.val_shards is None or min(self.val_shards) >= 0,
               f"--val-shards must be shard ids >= 0, got {self.val_shards}")
        _check(self.save_every_minutes >= 0, f"--save-every-minutes must be >= 0, got {self.save_every_minutes}")
        _check(self.log_every_seconds > 0, f"--log-every-seconds must be > 0, got {self.log_every_seconds}")
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
        _check(self.compile_layers in ("auto", "on", "off"),
               f"--compile-layers {self.compile_layers!r}: use auto, on or off")
        _check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        _check(self.position_weights in POSITION_WEIGHTS,
               f"--position-weights {self.position_weights!r}: use {' or '.join(POSITION_WEIGHTS)}")
        _check(0 < self.dpace_alpha <= 1, f"--dpace-alpha must be in (0, 1], got {self.dpace_alpha}")
        _check_budgets(self.tree_budgets)
        _check(self.tree_loss is None or self.tree_loss >= 1, f"--tree-loss must be a budget >= 1, got {self.tree_loss}")
        _check(self.dpace_alpha == DPACE_ALPHA or self.position_weights == "dpace",
               f"--dpace-alpha {self.dpace_alpha} applies to --position-weights dpace only (it is "
               f"{self.position_weights}); drop it or pass --position-weights dpace")


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(StageConfig):
    """Options of `dflash generate`: regenerate answers with the target."""

    model: str | None = option(unless="server", help="Target model: a Hugging Face folder; required unless --server.")
    prompts: str | None = option(
        unless="self_prompts",
        help="Prompts or whole conversations, in any format --data reads (JSONL, a JSON array such as ShareGPT's, "
             "Parquet, Arrow, a datasets folder; {prompt}, {messages}, {conversations}) or .txt (one prompt a line): "
             "every assistant turn is regenerated in order, system prompts kept; required unless --self-prompts.")
    out: str = option(help="Output JSONL of conversations, or of prompts with --self-prompts (appended; rerun to "
                           "resume).")
    self_prompts: int | None = option(
        None, help="Instead of answering prompts, write N distinct, finished prompts the target writes itself "
                   "(sampled from its chat template's user turn, Magpie-style) to --out, ready for --prompts.")
    exclude: tuple[str, ...] = option(
        (), metavar="FILE",
        help="Prompt files (repeatable; as --prompts reads them) whose prompts --self-prompts must not repeat.")
    max_new_tokens: int = option(256, help="Most tokens per answer.")
    temperature: float = option(0.0, help="Sampling temperature; 0 = greedy.")
    batch_size: int = option(16, help="Prompts answered together (slots of the fast engine, kept full).")
    device: str = option("cpu", choices=("cpu", "cuda"), help="Where the target runs.")
    engine: str = option(
        "auto", choices=GENERATE_ENGINES,
        help="transformers decoding: fast (static KV cache, continuous batching, CUDA graphs on cuda), plain "
             "(transformers' generate); auto is fast where the architecture allows. Recorded beside --out.")
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Dtype the target runs in: auto is float32 on cpu, the folder's own on cuda. Recorded "
                             "beside --out.")
    seed: int = option(0, help="Seed of sampling (temperature > 0, and --self-prompts).")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, parse="parse_json_object", metavar="JSON",
        help='Extra variables of the chat template as a JSON object, e.g. \'{"enable_thinking": false}\' for Qwen3: '
             'render what the serving engine renders. Recorded; a rerun into the same output must keep them.')
    server: tuple[str, ...] = option(
        (), metavar="URL",
        help="Instead of running --model here: an OpenAI-compatible server (vllm serve, SGLang, transformers serve) "
             "answers through /v1/chat/completions, e.g. http://host:8000 (repeatable: requests are spread over "
             "every server).")
    served_model: str | None = option(
        None, help="With --server: the model name the servers serve [default: the one model they list]. Recorded; "
                   "a rerun into the same output must keep it.")
    concurrency: int = option(64, help="With --server: requests in flight, spread over the servers.")
    top_p: float | None = option(None, help="With --server: nucleus sampling [default: the server's].")
    top_k: int | None = option(None, help="With --server: top-k sampling [default: the server's; transformers serve "
                                          "refuses it].")
    sampling_mix: tuple[dict[str, Any], ...] | None = option(
        None, parse="parse_sampling_mix", metavar="JSON",
        help='With --server: per-prompt sampling as a JSON list of weighted entries, each prompt drawing one by its '
             'row and --seed, e.g. \'[{"weight": 0.7, "temperature": 0}, {"weight": 0.3, "temperature": 0.6, '
             '"chat_template_kwargs": {"enable_thinking": true}}]\'; an entry overrides --temperature, --top-p, '
             '--top-k and adds to --chat-template-kwargs. Each row records what it got.')
    server_timeout: float = option(
        600.0, help="With --server: seconds to wait for a server to come up (or back), and for one answer; a request "
                    "is retried with backoff within it on timeouts, connection errors and 5xx answers.")

    def __post_init__(self) -> None:
        _check(self.self_prompts is not None or self.prompts is not None,
               "--prompts is required (a prompts file to answer), unless --self-prompts N writes prompts instead")
        _check(self.self_prompts is None or self.prompts is None,
               f"--prompts {self.prompts} and --self-prompts {self.self_prompts} exclude each other: the first "
               "answers prompts, the second writes them; run one, then the other")
        _check(self.self_prompts is None or self.self_prompts >= 1,
               f"--self-prompts must be >= 1, got {self.self_prompts}")
        _check(not self.exclude or self.self_prompts is not None, "--exclude applies to --self-prompts only")
        _check(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")
        _check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        _check(self.device in ("cpu", "cuda"), f"--device {self.device!r}: use cpu or cuda")
        _check(self.model is not None or bool(self.server),
               "--model is required (a target folder to run here), unless --server URL answers instead")
        _check(self.model is None or not self.server,
               f"--model {self.model} and --server exclude each other: the first runs the target here, the second "
               "asks a server that runs it (name it with --served-model); pass one")
        _check(not self.server or self.self_prompts is None,
               "--self-prompts runs the target here; pass --model instead of --server")
        in_process = {"--top-p": self.top_p, "--top-k": self.top_k, "--sampling-mix": self.sampling_mix,
                      "--served-model": self.served_model}
        given = [flag for flag, v in in_process.items() if v is not None]
        _check(bool(self.server) or not given,
               f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --server only (the engine here samples with --temperature alone); "
               "drop them or pass --server URL")
        bad = [u for u in self.server if not u.startswith(("http://", "https://"))]
        _check(not bad, f"--server {bad[0] if bad else ''}: expected a URL like http://host:8000")
        _check(self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}")
        _check(self.server_timeout > 0, f"--server-timeout must be > 0, got {self.server_timeout}")
        _check(self.top_p is None or 0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        _check(self.top_k is None or self.top_k >= 1, f"--top-k must be >= 1, got {self.top_k}")
        _check(self.engine in GENERATE_ENGINES, f"--engine {self.engine!r}: use {', '.join(GENERATE_ENGINES)}")
        _check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r}: use auto, {', '.join(DTYPES)}")


DEMO_BUDGETS = ("auto", "full", "gpu", "tiny")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(StageConfig):
    """Options of `dflash eval`: a drafter, a store, and which of its shards to score."""

    drafter: str = option(help="Run folder of `dflash train` (its newest checkpoint), one of its checkpoints, or an "
                               "export.")
    store: str | None = option(unless="prompts", help="Feature store made by `dflash extract` (teacher-forced "
                                                       "tau_hat); required unless --prompts.")
    prompts: str | None = option(
        None, help="Instead of a store: a prompt file in any format `dflash generate --prompts` reads (JSONL, JSON "
                   "array, Parquet, .jsonl.gz, text lines...): measured tau by speculative decoding against plain "
                   "greedy decoding, with tau_hat at the anchors decoding used.")
    decode: int = option(128, help="With --prompts: new tokens decoded per prompt.")
    max_prompts: int | None = option(None, help="With --prompts: decode the first N usable prompts only.")
    out: str | None = option(None, help="With --prompts: JSONL of one row per decoded prompt (a rerun resumes).")
    target: str | None = option(None, help="Target folder for embedding/lm_head [default: the run's or the store's].")
    shards: str = option("val", choices=("val", "all"), help="The held-out shards of the run, or every committed one.")
    val_fraction: float | None = option(None, help="Held-out fraction used in training (for an export).")
    batch_tokens: int = option(16384, help="Context tokens per batch (a run's own value is used for a run).")
    anchors: int = option(512, help="Blocks drawn per sample (a run's own value is used for a run).")
    skip_corrupt: bool = option(False, help="Skip (and count) corrupt shards instead of stopping.")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, parse="parse_json_object", metavar="JSON",
        help='With --prompts: extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'.')
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="Compute dtype (weights stay fp32), as training's validation: auto is bfloat16 on CUDA "
                             "and on CPUs with native bf16, float32 on other CPUs.")
    tree_budgets: tuple[int, ...] = tree_budgets_option(" on the store")
    tree_budget: tuple[int, ...] | None = option(
        None, parse="parse_budgets", metavar="N[,N..]",
        help="With --prompts: also decode with DDTree trees of N nodes (one drafter pass, one target forward over "
             "the tree, greedy) and report tau, target forwards and wall clock beside greedy and the path, per N. "
             "Attention-only targets (Llama, Qwen2, Qwen3).")

    def __post_init__(self) -> None:
        _check(self.store is not None or self.prompts is not None,
               "--store is required (teacher-forced tau_hat on its held-out shards), unless --prompts FILE measures "
               "tau by decoding")
        _check(self.store is None or self.prompts is None,
               f"--store {self.store} and --prompts {self.prompts}: pass one (a store is scored teacher-forced, "
               "prompts by decoding); run eval twice for both")
        _check(self.decode >= 1, f"--decode must be >= 1, got {self.decode}")
        _check(self.max_prompts is None or self.max_prompts >= 1, f"--max-prompts must be >= 1, got {self.max_prompts}")
        _check(self.shards in ("val", "all"), f"--shards {self.shards!r}: use val or all")
        _check(self.val_fraction is None or 0 < self.val_fraction < 1,
               f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        _check(self.batch_tokens >= 1, f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        _check(self.anchors >= 1, f"--anchors must be >= 1, got {self.anchors}")
        _check(self.dtype in DTYPE_CHOICES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        _check_budgets(self.tree_budgets)
        _check_budgets(self.tree_budget or ())
        _check(not self.tree_budget or self.prompts is not None,
               f"--tree-budget {','.join(map(str, self.tree_budget or ()))} decodes prompts: pass --prompts FILE (on a store, "
               "--tree-budgets reports tree tau teacher-forced)")


@dataclass(frozen=True, kw_only=True)
class DemoConfig(StageConfig):
    """Options of `dflash demo`: the whole recipe on the embedded target."""

    out: str = option("dflash-demo", help="Folder for every stage's output (rerun to resume).")
    device: str = option("cpu", choices=("cpu", "cuda"), help="Where every stage runs.")
    budget: str = option("auto", choices=DEMO_BUDGETS,
                         help="How much data and training: auto picks full on cpu, gpu on cuda; tiny is a smoke run.")
    self_prompts: int | None = option(
        None, help="Prompts the target writes itself and answers, besides the bundled ones (default: the budget's, "
                   "10,000 for gpu, 0 for full).")
    position_weights: str | None = position_weights_option(
        None, " Default: the budget's (gpu: dpace; full, on a CPU: decay).")
    drafter: str | None = drafter_option(None, " Default: the budget's (gpu: dflash2; full, on a CPU: dflash, whose "
                                               "steps cost a CPU far less).")

    def __post_init__(self) -> None:
        _check(self.device in ("cpu", "cuda"), f"--device {self.device!r}: use cpu or cuda")
        _check(self.position_weights in (None,) + POSITION_WEIGHTS,
               f"--position-weights {self.position_weights!r}: use {' or '.join(POSITION_WEIGHTS)}")
        _check(self.drafter in (None,) + DRAFTERS, f"--drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        _check(self.budget in DEMO_BUDGETS, f"--budget {self.budget!r}: use one of {', '.join(DEMO_BUDGETS)}")
        _check(self.self_prompts is None or self.self_prompts >= 0,
               f"--self-prompts must be >= 0, got {self.self_prompts}")
        if self.budget == "auto":
            object.__setattr__(self, "budget", "gpu" if self.device == "cuda" else "full")


@dataclass(frozen=True, kw_only=True)
class RunConfig(StageConfig):
    """Options of `dflash run` itself; each stage's own options come from ExtractConfig and TrainConfig
    (see run_stage_options)."""

    model: str = option(help="Target model folder: extract's --model and train's --target.")
    data: tuple[str, ...] = option(help="Conversations (repeatable), as for `dflash extract --data`.", metavar="FILE")
    store: str = option(help="Feature store: extract's --out and train's --store.")
    out: str = option(help="Run folder of training (train's --out); the stages' logs go to RUN/logs/.")
    extract_gpus: str = option("0,1,2,3,4", help="GPUs of extraction (extract's --gpus), or cpu.")
    train_gpus: str = option("5,6,7", help="GPUs of training (train's --gpus), or cpu.")
    no_grow: bool = option(False, help="Keep training on --train-gpus when extraction ends (default: it grows onto "
                                       "the freed GPUs, same slots, same batches).")
    retries: int = option(3, help="Restarts of a stage that dies (SIGKILL, crash) without progress in between.")
    progress_every: float = option(30.0, help="Seconds between progress lines.")

    def __post_init__(self) -> None:
        _check(bool(self.data), "--data needs at least one file or folder")
        parse_gpus(self.extract_gpus)
        parse_gpus(self.train_gpus)
        _check(self.retries >= 0, f"--retries must be >= 0, got {self.retries}")
        _check(self.progress_every > 0, f"--progress-every must be > 0, got {self.progress_every}")


# How `dflash run`'s options map onto its stages: these stage fields come from RunConfig (None: `dflash run` sets
# them itself: training always follows extraction and resumes its run folder).
RUN_SHARED: dict[str, dict[str, str | None]] = {
    "ExtractConfig": {"model": "model", "data": "data", "out": "store", "gpus": "extract_gpus"},
    "TrainConfig": {"target": "model", "store": "store", "out": "out", "gpus": "train_gpus", "follow": None,
                    "resume": None},
}


def run_stage_options(cls: type) -> dict[str, str]:
    """Return {field: `dflash run` option name} of the stage's fields that `dflash run` passes through as they are.

    A name both stages have (batch_tokens, dtype) takes the stage's prefix: --extract-batch-tokens, --train-dtype.
    """
    stages = {"ExtractConfig": ExtractConfig, "TrainConfig": TrainConfig}
    other = stages["TrainConfig" if cls.__name__ == "ExtractConfig" else "ExtractConfig"]
    both = {f.name for f in dataclasses.fields(other)}
    prefix = "extract_" if cls.__name__ == "ExtractConfig" else "train_"
    return {f.name: prefix + f.name if f.name in both else f.name
            for f in dataclasses.fields(cls) if f.name not in RUN_SHARED[cls.__name__]}
