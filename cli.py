"""The `dflash` command line: click options -> one config object -> the stage's run(). Nothing heavy at import."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click

from . import __version__
from .errors import ConfigError, DflashError

log = logging.getLogger("dflash")


def _read_config_file(path: str) -> dict[str, Any]:
    """Return the mapping in a YAML, TOML or JSON file of command defaults."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read the file ({e.strerror})") from None
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
        elif ext == ".json":
            data = json.loads(raw)
        elif ext in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw)
        else:
            raise ConfigError(f"--config {path}: expected a .yaml, .yml, .toml or .json file, found {ext or 'no'} extension")
    except ConfigError:
        raise
    except Exception as e:  # the parsers' own error types differ; all mean the same to the user
        raise ConfigError(f"--config {path}: not valid {ext[1:].upper()}: {e}".replace("\n", " ")) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values, found {type(data).__name__}")
    return data


def _apply_config_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager callback: load the file into the command's default_map so command-line flags still win."""
    if not value:
        return value
    data = _read_config_file(value)
    # A file may hold one section per command ({extract: {...}, train: {...}}) or the command's options directly.
    cmd_name = ctx.command.name
    if cmd_name in data and isinstance(data[cmd_name], dict):
        data = data[cmd_name]
    known = {p.name: p for p in ctx.command.params if p.name and p.name != "config"}
    defaults: dict[str, Any] = {}
    for key, val in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"--config {value}: `dflash {cmd_name}` has no option {key!r}; "
                f"allowed: {', '.join(sorted(n.replace('_', '-') for n in known))}"
            )
        if isinstance(val, list) and not known[name].multiple and not known[name].nargs != 1:
            val = ",".join(str(v) for v in val)
        defaults[name] = val
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def config_option(f):
    """Add `--config FILE` (YAML, TOML or JSON defaults for this command's options; flags win)."""
    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=_apply_config_file,
        help="YAML, TOML or JSON file of defaults for this command's options; command-line flags win.",
    )(f)


def _layers(value: str) -> tuple[int, ...] | None:
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--layers {value!r}: expected auto or comma-separated layer ids like 1,9,17,25,33") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", prog_name="dflash")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    help="How much to log.",
)
def cli(log_level: str) -> None:
    """Train DFlash speculative-decoding drafters from an offline cache of target hidden states.

    \b
    extract: conversations -> target forward on GPUs -> zarr shards + manifest
    train:   committed shards -> drafter training on other GPUs (can follow a running extract)
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


@cli.command()
@config_option
@click.option("--model", required=True, help="Target model: a Hugging Face folder.")
@click.option("--data", required=True, multiple=True, help="JSONL/JSON/Parquet files or a datasets folder (repeatable).")
@click.option("--out", required=True, help="Store path (a folder or an fsspec URL).")
@click.option("--gpus", default="0,1,2,3,4", show_default=True, help="GPU indices, or cpu.")
@click.option("--layers", default="auto", show_default=True, help="auto or comma-separated target layer ids.")
@click.option("--max-length", default=4096, show_default=True, type=int)
@click.option("--min-loss-tokens", default=32, show_default=True, type=int)
@click.option("--shard-size", default=None, type=int, help="Source rows per shard [default: ~2 GB of features].")
@click.option("--batch-tokens", default=32768, show_default=True, type=int)
@click.option("--codec", default="blosc", show_default=True, type=click.Choice(["blosc", "none", "fp8"]))
@click.option("--chat-template", default=None, help="Jinja chat template file to use instead of the tokenizer's.")
@click.option("--mask-token-id", default=None, type=int, help="Mask token when the vocabulary has no unused row.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row instead of counting it.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]))
def extract(**opts: Any) -> None:
    """Run the target over conversations and store its DFlash features (rerun to resume)."""
    from .config import ExtractConfig

    opts["data"] = tuple(opts["data"])
    opts["layers"] = _layers(opts["layers"])
    cfg = ExtractConfig(**opts)
    from . import extract as stage

    stage.run(cfg)


@cli.command()
@config_option
@click.option("--store", required=True, help="Feature store made by `dflash extract`.")
@click.option("--target", required=True, help="Target model folder (embedding and lm_head are read from it).")
@click.option("--out", required=True, help="Run folder: checkpoints, metrics.jsonl, config.")
@click.option("--gpus", default="5,6,7", show_default=True, help="GPU indices, or cpu.")
@click.option("--epochs", default=6, show_default=True, type=int)
@click.option("--max-steps", default=None, type=int)
@click.option("--batch-tokens", default=16384, show_default=True, type=int)
@click.option("--lr", default=6e-4, show_default=True, type=float)
@click.option("--draft-layers", default=5, show_default=True, type=int)
@click.option("--block-size", default=16, show_default=True, type=int)
@click.option("--anchors", default=512, show_default=True, type=int,
              help="Blocks drawn per sample; a batch holds at most --batch-tokens/4 blocks in all.")
@click.option("--grad-accum", default=1, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--val-fraction", default=0.0, show_default=True, type=float)
@click.option("--follow", is_flag=True, help="Train while `dflash extract` is still writing the store.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint.")
@click.option("--save-every", default=1000, show_default=True, type=int)
@click.option("--keep", default=3, show_default=True, type=int)
@click.option("--log-every", default=10, show_default=True, type=int)
@click.option("--tensorboard", is_flag=True)
@click.option("--skip-corrupt", is_flag=True, help="Skip (and count) corrupt shards instead of stopping.")
@click.option("--prefetch-shards", default=2, show_default=True, type=int, help="Whole shards each rank reads ahead.")
@click.option("--warmup-ratio", default=0.04, show_default=True, type=float)
@click.option("--sliding-window", default=None, type=int, help="Window of sliding layers (with --full-every).")
@click.option("--full-every", default=None, type=int, help="Every K-th drafter layer attends fully.")
@click.option("--attention", default="auto", show_default=True, type=click.Choice(["auto", "flex", "sdpa"]))
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]),
              help="Compute dtype (master weights stay fp32).")
def train(**opts: Any) -> None:
    """Train a DFlash drafter from a feature store (can follow a running extract)."""
    from .config import TrainConfig

    cfg = TrainConfig(**opts)
    from . import train as stage

    stage.run(cfg)


@cli.command(name="eval")
@config_option
@click.option("--drafter", required=True, help="Run folder of `dflash train`, one of its checkpoints, or an export.")
@click.option("--store", required=True, help="Feature store made by `dflash extract`.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--target", default=None, help="Target folder for embedding/lm_head [default: the run's or the store's].")
@click.option("--shards", default="val", show_default=True, type=click.Choice(["val", "all"]),
              help="The held-out shards of the run, or every committed shard.")
@click.option("--val-fraction", default=None, type=float, help="Held-out fraction used in training (for an export).")
@click.option("--skip-corrupt", is_flag=True, help="Skip (and count) corrupt shards instead of stopping.")
def eval_(drafter: str, store: str, as_json: bool, **opts: Any) -> None:
    """Teacher-forced tau_hat and per-slot acceptance of a drafter on a store's held-out shards."""
    from .train.evaluate import format_eval, run_eval

    result = run_eval(drafter, store, **opts)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_eval(result))


@cli.command()
@config_option
@click.option("--run", required=True, help="Run folder of `dflash train` (newest complete checkpoint) or a checkpoint folder.")
@click.option("--out", required=True, help="Folder to write: config.json + model.safetensors (bf16).")
@click.option("--remote-code", is_flag=True, help="Also write modeling_dflash.py + auto_map for trust_remote_code.")
def export(run: str, out: str, remote_code: bool) -> None:
    """Export a trained drafter as a Hugging Face folder the DFlash inference code loads."""
    from .train.export import export_drafter

    click.echo(str(export_drafter(run, out, remote_code=remote_code)))


@cli.command()
@config_option
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(store: str, as_json: bool) -> None:
    """Summarise a feature store: header, shards, tokens, bytes, compression, writers."""
    from .storage.summary import format_inspect, inspect_store

    info = inspect_store(store)
    click.echo(json.dumps(info, indent=2, sort_keys=True) if as_json else format_inspect(info))


@cli.command()
@config_option
@click.argument("store")
@click.option("--repair", is_flag=True, help="Withdraw the commits of bad shards so the next extract redoes them.")
def verify(store: str, repair: bool) -> int:
    """Re-read every committed shard of a store and check every checksum and invariant (exit 1 if any is bad)."""
    from .storage.summary import verify_store

    checked, bad = verify_store(store, repair=repair)
    for line in bad:
        click.echo(line)
    click.echo(f"{checked - len(bad)} of {checked} committed shards are sound", err=True)
    return 1 if bad else 0


@cli.command()
@config_option
@click.option("--model", required=True, help="Target model: a Hugging Face folder.")
@click.option("--prompts", required=True, help="Prompts: JSONL ({prompt} or {messages} ending on the user) or text lines.")
@click.option("--out", required=True, help="Output JSONL of conversations (appended; rerun to resume).")
@click.option("--max-new-tokens", default=256, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--batch-size", default=16, show_default=True, type=int)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--backend", default="transformers", show_default=True, type=click.Choice(["transformers", "vllm"]))
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of sampling (temperature > 0).")
def generate(**opts: Any) -> None:
    """Answer prompts with the target model, writing conversations ready for `dflash extract`."""
    from .config import GenerateConfig

    cfg = GenerateConfig(**opts)
    from . import generate as stage

    stage.run(cfg)


@cli.command()
@config_option
@click.option("--out", default="dflash-demo", show_default=True, help="Folder for every stage's output (rerun to resume).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--budget", default="auto", show_default=True, type=click.Choice(["auto", "full", "gpu", "tiny"]),
              help="How much data and training: auto picks full on cpu, gpu on cuda; tiny is a smoke run.")
def demo(**opts: Any) -> None:
    """The whole recipe on the embedded SmolLM2 target: generate, extract, train, evaluate, export, decode."""
    from .config import DemoConfig

    cfg = DemoConfig(**opts)
    from . import demo as stage

    click.echo(stage.format_table(stage.run(cfg)))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: DflashError -> one line on stderr and exit 2; anything else keeps its traceback."""
    try:
        rv = cli.main(args=argv, prog_name="dflash", standalone_mode=False)
    except DflashError as e:
        click.echo(f"dflash: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("dflash: interrupted; rerun the same command to resume", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
