"""The `dflash` command line: click options -> one config object -> the stage's run(). Nothing heavy at import."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click

from . import __version__
from .config import DemoConfig, EvalConfig, ExtractConfig, GenerateConfig, RunConfig, TrainConfig, run_stage_options
from .config.cli_options import config_option, config_options, make_config
from .config.options import check_model_dir
from .errors import DflashError

log = logging.getLogger("dflash")


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
    from .runtime.memory import is_out_of_memory, out_of_memory_error

    try:
        stage.run(cfg)
    except Exception as e:
        # A forward that runs out splits its batch (extract/pipeline.py); this is memory that ran out elsewhere: the
        # target's load, its start-up self-check, a peer's share on a GPU another process fills.
        if not is_out_of_memory(e):
            raise
        raise out_of_memory_error(
            "dflash extract (loading or checking the target)", "cuda" if cfg.gpus != "cpu" and _cuda() else "cpu",
            "more free memory on the GPUs (--gpus), the weights over more GPUs or in host memory (--shard-weights K, "
            "--offload cpu), or a smaller --batch-tokens; committed shards are kept", e) from None


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
