"""How a command-line option is declared and read: the choices shared by several stages, option() (a config field
whose metadata is its option: the one place for default, choices and help), the options several stages share, and
the parsers named by option(parse=...) that turn an option's text into a field's value."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import ConfigError

__all__ = ["CODECS", "OFFLOADS", "parse_shard_weights", "DRAFTERS", "DTYPES", "DTYPE_CHOICES", "GENERATE_ENGINES", "POSITION_WEIGHTS", "DPACE_ALPHA",
           "LEGACY_DEFAULTS", "option", "parse_layers", "parse_shard_ids", "parse_json_object", "parse_sampling_mix",
           "parse_budgets", "parse_val_fraction", "parse_gpus", "resolve_devices", "position_weights_option",
           "drafter_option", "tree_tau_nodes_option", "cache_dir_option", "cache_gb_option", "check", "check_cache",
           "check_budgets", "check_model_dir", "flag_name"]

# storage/codec.py's, here without importing storage
CODECS = ("blosc", "none", "fp8", "uq8", "uq6", "uq4", "bf16m3", "bf16m2", "bf16m1")
OFFLOADS = ("none", "cpu")
COMPILES = ("auto", "on", "off")
DRAFTERS = ("dflash", "dflash2")
DTYPES = ("bfloat16", "float32")
DTYPE_CHOICES = ("auto",) + DTYPES  # auto: targets/numerics.py decides (bf16 on CUDA and on CPUs with native bf16)
GENERATE_ENGINES = ("auto", "fast", "plain")
POSITION_WEIGHTS = ("decay", "dpace")
DPACE_ALPHA = 0.5
# What a run made before an option existed trained with, where today's default differs: DFlash 2 with D-PACE won
# the A/B on one H200 (bench/RESULTS.md, "DFlash 2 and D-PACE"), so they became the defaults on 2026-12-01.
LEGACY_DEFAULTS = {"drafter": "dflash", "position_weights": "decay"}


def option(default: Any = dataclasses.MISSING, *, help: str, choices: tuple[str, ...] | None = None,
           cli_default: str | None = None, parse: str | None = None, metavar: str | None = None,
           unless: str | None = None, flag: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """Return a config field whose metadata is its command-line option: the one place for default, choices, help.

    cli_default: the text the option shows and takes by default when the field's value is not text (layers: auto);
    parse: the name of the parser here (dflash.config exports it) that turns the option's text into the field's
    value;
    unless: a required field that may be None when this other option is given (its __post_init__ checks);
    flag: the option's name (tree_tau_nodes for --tree-tau-nodes) where it differs from the field's, which stays what
    saved configs hold;
    aliases: former option names, still taken for a release as hidden options that print one deprecation line.
    """
    meta = {"help": help, "choices": choices, "cli_default": cli_default, "parse": parse, "metavar": metavar,
            "unless": unless, "flag": flag, "aliases": tuple(aliases)}
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field: dataclasses.Field) -> str:
    """Return a config field's option name, underscored (tree_tau_nodes): its `flag`, else the field's name."""
    return field.metadata.get("flag") or field.name


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
        check(not unknown, f"--sampling-mix entry {e}: unknown key(s) {unknown}; an entry sets weight and any of "
                            f"{', '.join(MIX_KEYS)}")
        weight = e.get("weight", 1)
        check(isinstance(weight, (int, float)) and weight > 0,
               f"--sampling-mix entry {e}: weight must be a number > 0, got {weight!r}")
        check(e.get("chat_template_kwargs") is None or isinstance(e["chat_template_kwargs"], dict),
               f"--sampling-mix entry {e}: chat_template_kwargs must be a JSON object")
        entries.append(json.loads(json.dumps({**e, "weight": weight}, sort_keys=True)))
    return tuple(entries)


def parse_budgets(value: Any) -> tuple[int, ...] | None:
    """Return the node counts of a `--tree-tau-nodes` / `--tree-decode-nodes` value ("8,16,32,64" -> (8, 16, 32, 64);
    "" -> (); None -> None: not given)."""
    if value is None:
        return None
    return _parse_ids(value, "tree node counts", "8,16,32,64 (or '' for none)")


def parse_val_fraction(value: Any) -> float | None:
    """Return the fraction of a `--val-fraction` value ("auto" -> None: the split's own default)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--val-fraction {value!r}: expected auto or a fraction like 0.05") from None


def parse_shard_weights(value: Any) -> int | None:
    """Return the GPUs sharing one copy of the weights of a `--shard-weights` value ("auto" -> None, "4" -> 4; "off"
    is 1)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text == "off":
        return 1
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(f"--shard-weights {value!r}: expected auto or a number of GPUs >= 1 (1 keeps a whole copy "
                          "on every GPU)")
    return k


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


# The three uses of a DDTree's node count N each have one name, the same in every command: --tree-tau-nodes (the
# teacher-forced metric: train's validation, eval on a store), --tree-decode-nodes (eval decoding prompts with trees),
# --tree-loss-nodes (train's tree loss). Their former names stay as hidden aliases for a release (2026-12-04).
def tree_tau_nodes_option(where: str) -> Any:
    """Return the --tree-tau-nodes field (train's validation and eval's: one default, one help)."""
    return option((8, 16, 32, 64), parse="parse_budgets", metavar="N,N,..", cli_default="8,16,32,64",
                  flag="tree_tau_nodes", aliases=("tree_budgets",),
                  help="Report tree tau for DDTrees of these node counts" + where + ": 1 + the depth of the "
                       "longest gold prefix among the N best prefixes of the drafter's per-slot distributions "
                       "(teacher-forced; '' for none).")


def cache_dir_option() -> Any:
    """Return the --cache-dir field (train's, eval's and so run's: one help)."""
    return option(None, metavar="DIR",
                  help="Local folder caching the shards of a remote store (s3://): the first epoch fetches each shard "
                       "once (whole, checked against its commit record, a few ahead of the reader), later epochs read "
                       "local disk; least recently used shards are evicted past --cache-gb. Ignored for a local store.")


def cache_gb_option() -> Any:
    """Return the --cache-gb field (the bound of --cache-dir)."""
    return option(100.0, help="Size bound of --cache-dir in GB (1e9 bytes); an evicted shard is fetched and checked "
                              "again when next read.")


def check_cache(cache_gb: float) -> None:
    """Refuse a cache bound that is not a positive size."""
    check(cache_gb > 0, f"--cache-gb must be > 0 (GB), got {cache_gb}")


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond."""
    if not cond:
        raise ConfigError(message)


def check_model_dir(path: str | None, option: str) -> None:
    """Refuse a model path that cannot be a Hugging Face model folder: empty, a file, nothing there, or a folder
    without config.json (one line each, before anything loads or any output exists). The commands call it on the
    config they made: a config itself holds values, and may name a folder made later (the demo's converted target)."""
    import os

    if path is None:
        return
    fix = "pass the folder of a Hugging Face model (config.json, weights, tokenizer)"
    if not str(path).strip():
        raise ConfigError(f"{option}: expected a Hugging Face model folder, got an empty path; {fix}")
    if os.path.isfile(path):
        raise ConfigError(f"{option} {path}: expected a Hugging Face model folder, found a file; {fix} (the folder "
                          "that holds config.json)")
    if not os.path.isdir(path):
        raise ConfigError(f"{option} {path}: expected a Hugging Face model folder, found nothing there; {fix} (a "
                          "model on the Hub: `hf download ID --local-dir DIR` first, then pass DIR)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{option} {path}: expected a Hugging Face model folder with a config.json, found a folder "
                          f"without one; {fix}")


def check_budgets(budgets: tuple[int, ...], flag: str) -> None:
    """Refuse tree sizes that are not node counts >= 1."""
    check(all(n >= 1 for n in budgets), f"{flag} must be node counts >= 1, got {list(budgets)}")
