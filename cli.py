"""The `dflash` command line: click options -> one config object -> the stage's run(). Nothing heavy at import."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable

import click

from . import __version__
from .config import DemoConfig, EvalConfig, ExtractConfig, GenerateConfig, RunConfig, TrainConfig, run_stage_options
from .config.aliases import alias_key, deprecated, warn_alias, with_alias
from .config.options import check_model_dir, flag_name
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
    params = [p for p in ctx.command.params if p.name and p.name != "config" and not getattr(p, "hidden", False)]
    # A key is an option's name (tree-tau-nodes) or, deprecated, the name it had before (tree-budgets: the
    # parameter's name, which is its config field's).
    flags = {o.lstrip("-").replace("-", "_"): p for p in params for o in p.opts if o.startswith("--")}
    known = {**{p.name: p for p in params}, **flags}
    defaults: dict[str, Any] = {}
    for key, val in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"--config {value}: `dflash {cmd_name}` has no option {key!r}; "
                f"allowed: {', '.join(sorted(n.replace('_', '-') for n in flags))}"
            )
        param = known[name]
        if name not in flags:
            deprecated(f"{key!r} in --config {value}", param.opts[0].lstrip("-"))
        if isinstance(val, list) and not param.multiple and not param.nargs != 1:
            val = ",".join(str(v) for v in val)
        defaults[param.name] = val
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


_CLICK_TYPES = {"int": int, "float": float, "str": str}


def _click_type(field: Any) -> Any:
    """Return the click type of a config field from its annotation (with `from __future__ import annotations`,
    a string such as "int | None" or "tuple[str, ...]")."""
    if field.metadata.get("choices"):
        return click.Choice(list(field.metadata["choices"]))
    if field.metadata.get("parse"):
        return str
    base = str(field.type).replace(" | None", "")
    return _CLICK_TYPES.get(base, str)


class _RequiredUnless(click.Option):
    """A required option that another one, when given, waives (--prompts unless --self-prompts)."""

    def __init__(self, *args: Any, unless: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.unless = unless

    def handle_parse_result(self, ctx: click.Context, opts: Any, args: list[str]) -> Any:
        waived = opts.get(self.unless) is not None or (ctx.default_map or {}).get(self.unless) is not None
        self.required = not waived
        try:
            return super().handle_parse_result(ctx, opts, args)
        finally:
            self.required = True


def config_options(cls: type, *, skip: tuple[str, ...] = (), names: dict[str, str] | None = None) -> Callable:
    """Add one click option per field of a stage config, with the default, choices and help its metadata holds.

    names: only these fields, each under its given option name ({field: name}), as `dflash run` takes them.
    """
    import dataclasses

    def decorate(f: Callable) -> Callable:
        for field in reversed([x for x in dataclasses.fields(cls) if x.name not in skip
                               and (names is None or x.name in names)]):
            meta = field.metadata
            key = (names or {}).get(field.name, field.name)  # the parameter's name: make_config's key
            prefix = key[: -len(field.name)] if key.endswith(field.name) else ""  # `dflash run`'s train_ / extract_
            name = "--" + (prefix + flag_name(field)).replace("_", "-")
            required = field.default is dataclasses.MISSING
            kw: dict[str, Any] = {"help": meta.get("help"), "metavar": meta.get("metavar")}
            if field.type == "bool":
                kw.update(is_flag=True, default=False)
            elif str(field.type).startswith("tuple[str"):
                kw.update(multiple=True, required=required, type=str)
                if not required:
                    kw.update(default=field.default)
            else:
                kw.update(type=_click_type(field), required=required)
                if not required:  # a required option given a default (even None) would no longer be required first
                    default = meta.get("cli_default") or field.default
                    kw.update(default=default, show_default=default is not None)
            if meta.get("unless"):
                kw.update(cls=_RequiredUnless, unless=meta["unless"])
            f = click.option(name, key, **kw)(f)
            for alias in meta.get("aliases", ()):
                f = click.option("--" + (prefix + alias).replace("_", "-"), alias_key(key, alias), hidden=True,
                                 default=None, type=kw.get("type", str), metavar=kw.get("metavar"),
                                 callback=warn_alias(name))(f)
        return f

    return decorate


def make_config(cls: type, opts: dict[str, Any], names: dict[str, str] | None = None, **fixed: Any) -> Any:
    """Return the stage config of a command's parsed options: text parsed where a field says so, lists as tuples.

    names: {field: option name} where they differ (`dflash run`); fixed: field values given as they are.
    """
    import dataclasses

    from . import config as config_mod

    values = dict(fixed)
    for field in dataclasses.fields(cls):
        key = (names or {}).get(field.name, field.name)
        if field.name in fixed or key not in opts:
            continue
        value = with_alias(field, key, opts)
        if field.metadata.get("parse"):
            value = getattr(config_mod, field.metadata["parse"])(value)
        elif isinstance(value, list):
            value = tuple(value)
        values[field.name] = value
    return cls(**values)


class _Interrupted(Exception):
    """A signal's KeyboardInterrupt, carried past click (which would print `Aborted.`) to main."""


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:  # SIGINT, or SIGTERM through runtime's handler
            raise _Interrupted() from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
    from .runtime.process import setup_logging, skip_unused_packages

    skip_unused_packages()  # before anything imports transformers
    setup_logging(log_level)


@cli.command()
@config_option
@config_options(ExtractConfig)
def extract(**opts: Any) -> None:
    """Run the target over conversations and store its DFlash features (rerun to resume)."""
    cfg = make_config(ExtractConfig, opts)
    check_model_dir(cfg.model, "--model")
    from . import extract as stage

    stage.run(cfg)


@cli.command()
@config_option
@config_options(TrainConfig)
def train(**opts: Any) -> None:
    """Train a DFlash drafter from a feature store (can follow a running extract)."""
    cfg = make_config(TrainConfig, opts)
    check_model_dir(cfg.target, "--target")
    from . import train as stage

    stage.run(cfg)


@cli.command(name="run")
@config_option
@config_options(RunConfig)
@config_options(ExtractConfig, names=run_stage_options(ExtractConfig))
@config_options(TrainConfig, names=run_stage_options(TrainConfig))
def run_(**opts: Any) -> int:
    """Extract on some GPUs while training follows on others, restart what dies, grow training when extraction ends.

    \b
    --model is extract's --model and train's --target; --store is extract's --out and train's --store; --out is
    train's run folder (logs in RUN/logs/). A stage option both stages have takes the stage's name:
    --extract-batch-tokens, --train-batch-tokens, --extract-dtype, --train-dtype. Rerun the same command to resume.
    """
    cfg = make_config(RunConfig, opts)
    check_model_dir(cfg.model, "--model")
    extract_cfg = make_config(ExtractConfig, opts, run_stage_options(ExtractConfig), model=cfg.model, data=cfg.data,
                              out=cfg.store, gpus=cfg.extract_gpus)
    train_cfg = make_config(TrainConfig, opts, run_stage_options(TrainConfig), target=cfg.model, store=cfg.store,
                            out=cfg.out, gpus=cfg.train_gpus, follow=True, resume=True)
    from .run import supervise

    return supervise(cfg, extract_cfg, train_cfg)


@cli.command(name="eval")
@config_option
@config_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_(as_json: bool, **opts: Any) -> None:
    """Teacher-forced tau_hat of a drafter on a store's held-out shards, or measured tau on a prompt file."""
    cfg = make_config(EvalConfig, opts)
    check_model_dir(cfg.target, "--target")
    from .runtime.memory import is_out_of_memory, out_of_memory_error

    try:
        if cfg.prompts is not None:
            from .decode.prompt_eval import format_prompt_eval as fmt, run_prompt_eval
            from .drafter.folders import resolve_drafter

            result = run_prompt_eval(cfg, *resolve_drafter(cfg.drafter))
        else:
            from .train.evaluate import format_eval as fmt, run_eval

            result = run_eval(cfg)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        shrink = ("fewer --decode tokens (--out keeps the prompts decoded so far)" if cfg.prompts is not None else
                  "a smaller --batch-tokens or --anchors")
        raise out_of_memory_error("dflash eval", "cuda" if _cuda() else "cpu", shrink, e) from None
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else fmt(result))


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
@config_options(GenerateConfig)
def generate(**opts: Any) -> None:
    """Answer prompts with the target model, writing conversations ready for `dflash extract`."""
    cfg = make_config(GenerateConfig, opts)
    check_model_dir(cfg.model, "--model")
    from . import generate as stage

    stage.run(cfg)


@cli.command()
@config_option
@config_options(DemoConfig)
def demo(**opts: Any) -> None:
    """The whole recipe on the embedded SmolLM2 target: generate, extract, train, evaluate, export, decode."""
    cfg = make_config(DemoConfig, opts)
    from . import demo as stage

    click.echo(stage.format_table(stage.run(cfg)))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: DflashError -> one line on stderr and exit 2; SIGINT/SIGTERM -> one line and exit
    130/143 once the work has unwound (claims released, a checkpoint finished or abandoned); anything else keeps
    its traceback."""
    from .runtime.process import guard_std_streams, install_signal_handlers, interrupt_exit_code, lost_output

    if argv is None:  # the console entry point: this process's own streams (an in-process caller keeps its own)
        guard_std_streams()
    install_signal_handlers()
    try:
        rv = cli.main(args=argv, prog_name="dflash", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except DflashError as e:
        click.echo(f"dflash: error: {e}", err=True)
        code = e.exit_code
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        code = 130
    except (_Interrupted, KeyboardInterrupt) as e:
        click.echo("dflash: interrupted; rerun the same command to resume", err=True)
        code = interrupt_exit_code(e.__cause__ if isinstance(e, _Interrupted) else e)
    if argv is None:  # the console entry point: nothing after this process's work but its teardown
        if lost := lost_output():
            click.echo(f"dflash: warning: {lost}: what the command wrote there is incomplete", err=True)
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> None:
    """End the process with `code` as the interpreter would, less its finalization, which frees every object one by
    one (and runs their __del__, which can wait forever on a lock a daemon thread held when it was frozen).

    After a command that loaded torch, transformers and a model, that finalization (the GC of every module's
    objects) took 0.7 s on the development CPU; on the lent H200 the time from the summary to the process's end went
    from 2.4 s to 1.1 s without it (bench/RESULTS.md, issue 22, fourth pass). Everything the interpreter does at
    exit that has an effect outside the process still runs, in its order: threading's exit hooks (executors let
    their workers go) and the join of every non-daemon thread, then the atexit handlers (logging's flush and close,
    multiprocessing's join of its children, weakref finalizers marked for exit), then the flush of stdout and
    stderr. dflash's own files are written and fsynced before a command returns, never left to a finalizer.
    """
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  (the interpreter's own first step at exit)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with the descriptor closed (`>&-`)
                stream.flush()
        except Exception:  # a closed pipe or stream, a replaced one: nothing more can reach it anyway
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
