"""One name a concept: the DDTree node-count options, and their former names kept as hidden, deprecated aliases."""
from __future__ import annotations

import dataclasses

import click
import pytest

from dflash.cli import cli, main, make_config
from dflash.config import EvalConfig, RunConfig, TrainConfig, run_stage_options
from dflash.errors import ConfigError

# (command, config, field, name now, former name, value given, value parsed)
RENAMED = [
    ("train", TrainConfig, "tree_budgets", "--tree-tau-nodes", "--tree-budgets", "4,8", (4, 8)),
    ("train", TrainConfig, "tree_loss", "--tree-loss-nodes", "--tree-loss", "32", 32),
    ("eval", EvalConfig, "tree_budgets", "--tree-tau-nodes", "--tree-budgets", "16", (16,)),
    ("eval", EvalConfig, "tree_budget", "--tree-decode-nodes", "--tree-budget", "8,32", (8, 32)),
]
REQUIRED = {"train": ["--store", "S", "--target", "T", "--out", "R"], "eval": ["--drafter", "D"],
            "run": ["--model", "M", "--data", "d.jsonl", "--store", "S", "--out", "R"]}


def parse(command: str, cls: type, args: list[str], names: dict | None = None, **fixed):
    """Return the config `dflash COMMAND ARGS` makes, through the command's own parsing and make_config."""
    with cli.commands[command].make_context(command, list(args)) as ctx:  # click consumes the list
        return make_config(cls, ctx.params, names, **fixed)


def extra(command: str, flag: str) -> list[str]:
    return ["--prompts", "p.jsonl"] if flag == "--tree-decode-nodes" else (["--store", "S"] if command == "eval" else [])


@pytest.mark.parametrize("command,cls,field,now,old,text,value", RENAMED)
def test_the_new_name_sets_the_field_and_help_shows_only_it(command, cls, field, now, old, text, value):
    cfg = parse(command, cls, REQUIRED[command] + extra(command, now) + [now, text])
    assert getattr(cfg, field) == value
    shown = cli.commands[command].get_help(click.Context(cli.commands[command], info_name=command))
    assert now in shown and f"{old} " not in shown and f"{old}\n" not in shown


@pytest.mark.parametrize("command,cls,field,now,old,text,value", RENAMED)
def test_the_former_name_still_works_with_one_deprecation_line(command, cls, field, now, old, text, value, capsys):
    cfg = parse(command, cls, REQUIRED[command] + extra(command, now) + [old, text])
    assert getattr(cfg, field) == value
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dflash: warning: {old} is deprecated, use {now}"), err
    with pytest.raises(ConfigError, match=f"^{old} {text} and {now} .*pass only the second"):
        parse(command, cls, REQUIRED[command] + extra(command, now) + [old, text, now, text])


def test_dflash_run_takes_trains_new_and_former_names(capsys):
    names = run_stage_options(TrainConfig)
    args = REQUIRED["run"] + ["--tree-tau-nodes", "4", "--tree-loss", "16"]
    cfg = parse("run", TrainConfig, args, names, target="M", store="S", out="R")
    assert cfg.tree_budgets == (4,) and cfg.tree_loss == 16
    assert "--tree-loss is deprecated, use --tree-loss-nodes" in capsys.readouterr().err
    assert parse("run", RunConfig, args).retries == 3


def test_a_stage_started_by_dflash_run_gets_the_new_names(capsys):
    # `dflash run` passes a stage its config as flags (to_argv): they must parse back without a deprecation line.
    cfg = TrainConfig(store="S", target="T", out="R", tree_budgets=(4, 8), tree_loss=32)
    argv = cfg.to_argv()
    assert "--tree-tau-nodes" in argv and "--tree-loss-nodes" in argv and "--tree-budgets" not in argv
    assert parse("train", TrainConfig, argv) == cfg
    evc = EvalConfig(drafter="D", store=None, prompts="p.jsonl", tree_budget=(8,))
    assert parse("eval", EvalConfig, evc.to_argv()) == evc
    assert capsys.readouterr().err == ""


def test_a_config_file_takes_the_new_name_and_the_former_one_with_a_warning(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    for key, warned in (("tree-loss-nodes", False), ("tree_loss", True)):
        path.write_text(f"{key}: 0\n")  # 0 is refused by the config: proof that the file's value reached it
        with pytest.raises(SystemExit):
            main(["train", "--config", str(path)] + REQUIRED["train"])
        err = capsys.readouterr().err
        assert err.endswith("dflash: error: --tree-loss-nodes must be a node count >= 1, got 0\n"), err
        assert ("'tree_loss' in --config" in err and "is deprecated, use --tree-loss-nodes" in err) == warned, err
    # the refusal lists the names of today, not the former ones
    path.write_text("tree-size: 4\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(path)] + REQUIRED["train"])
    err = capsys.readouterr().err
    assert "has no option 'tree-size'" in err and "tree-loss-nodes" in err and "tree-loss," not in err, err


def test_every_renamed_field_keeps_its_name_in_saved_configs():
    # Saved config.json files hold field names: a run or store made before the rename still loads.
    for cls in (TrainConfig, EvalConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag"):
                assert f.name in f.metadata["aliases"], f.name
