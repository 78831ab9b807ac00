"""The CLI group: help, version, clean errors, --config files with flag overrides, lazy imports."""
from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from dflash import __version__
from dflash.cli import cli, config_option, main

COMMANDS = ["extract", "train", "run", "eval", "export", "inspect", "verify", "generate", "demo"]


def run_dflash(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["dflash", *args], capture_output=True, text=True, timeout=120, **kw)


def test_help_lists_every_command():
    proc = run_dflash("--help")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.split("Commands:")[1].strip().splitlines()]
    assert sorted(listed) == sorted(COMMANDS)


def test_version():
    proc = run_dflash("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"dflash, version {__version__}"


def test_cli_import_stays_light():
    # `dflash --help` must answer at once: nothing heavy may be imported with the CLI.
    code = "import sys, dflash.cli; print(sorted(m for m in ('torch', 'transformers', 'zarr') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dflash_error_is_one_line_exit_2_without_traceback(tmp_path):
    proc = run_dflash("extract", "--model", str(tmp_path), "--data", "x.jsonl", "--out", str(tmp_path / "s"), "--gpus", "zero")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("dflash: error: --gpus 'zero'")


def test_unexpected_exception_keeps_traceback(monkeypatch):
    @cli.command(name="boom-test")
    def boom():
        raise RuntimeError("kaboom")

    try:
        with pytest.raises(RuntimeError, match="kaboom"):
            main(["boom-test"])
    finally:
        cli.commands.pop("boom-test")


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["extract"])
    assert exc.value.code == 2
    assert "Missing option '--model'" in capsys.readouterr().err


@click.command()
@config_option
@click.option("--alpha", default=1, type=int)
@click.option("--beta-gamma", default="x")
@click.option("--flag", is_flag=True)
def probe(alpha: int, beta_gamma: str, flag: bool) -> None:
    click.echo(json.dumps({"alpha": alpha, "beta_gamma": beta_gamma, "flag": flag}))


@pytest.mark.parametrize(
    "name,text",
    [
        ("c.yaml", "alpha: 5\nbeta-gamma: from-file\nflag: true\n"),
        ("c.toml", 'alpha = 5\nbeta_gamma = "from-file"\nflag = true\n'),
        ("c.json", '{"alpha": 5, "beta-gamma": "from-file", "flag": true}'),
        ("c.yml", "probe:\n  alpha: 5\n  beta_gamma: from-file\n  flag: true\nother:\n  zzz: 1\n"),
    ],
)
def test_config_file_sets_defaults_and_flags_win(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    runner = CliRunner()
    res = runner.invoke(probe, ["--config", str(path)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"alpha": 5, "beta_gamma": "from-file", "flag": True}
    res = runner.invoke(probe, ["--config", str(path), "--alpha", "7"])
    assert json.loads(res.output) == {"alpha": 7, "beta_gamma": "from-file", "flag": True}
    # the file may come after the flag on the command line: the flag still wins
    res = runner.invoke(probe, ["--beta-gamma", "cli", "--config", str(path)])
    assert json.loads(res.output)["beta_gamma"] == "cli"


def test_config_file_unknown_option_is_refused_by_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 2\nlearning_rate: 0.1\n")
    proc = run_dflash("train", "--config", str(path))
    assert proc.returncode == 2
    assert "has no option 'learning_rate'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("content,why", [("alpha: [1, 2\n", "not valid YAML"), ("- 1\n- 2\n", "expected a mapping")])
def test_config_file_bad_content(tmp_path, content, why):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(Exception) as exc:
        probe.main(["--config", str(path)], standalone_mode=False)
    assert why in str(exc.value) and str(path) in str(exc.value)


def test_config_roundtrip_and_validation(tmp_path):
    from dflash.config import ExtractConfig, TrainConfig
    from dflash.errors import ConfigError

    cfg = ExtractConfig(model="m", data=("a.jsonl", "b.jsonl"), out="s", layers=(1, 2, 3))
    cfg.save(tmp_path / "c.json")
    assert ExtractConfig.load(tmp_path / "c.json") == cfg
    with pytest.raises(ConfigError, match="--codec 'zip' is not auto or one of blosc"):
        ExtractConfig(model="m", data=("a",), out="s", codec="zip")
    with pytest.raises(ConfigError, match="--sliding-window and --full-every go together"):
        TrainConfig(store="s", target="t", out="o", sliding_window=2048)
    with pytest.raises(TypeError):
        ExtractConfig("m", ("a",), "s")  # keyword-only
    with pytest.raises(ConfigError, match="has no field"):
        TrainConfig.from_dict({**TrainConfig(store="s", target="t", out="o").to_dict(), "bogus": 1})


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_targets_load_offline_and_render_chat(arch, request):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = request.getfixturevalue(f"tiny_{arch}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    text = tok.decode(ids)
    assert "2+2?" in text and text.count("4") == 1
    assert model.config.vocab_size > len(tok)  # the DFlash mask token is the first unused row
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    # layers must be distinguishable, or a layer-offset bug in feature capture would go unseen
    assert not torch.allclose(out.hidden_states[2], out.hidden_states[3], atol=1e-2)


@pytest.mark.parametrize("command,cls", [("extract", "ExtractConfig"), ("train", "TrainConfig"),
                                         ("eval", "EvalConfig"), ("generate", "GenerateConfig"),
                                         ("demo", "DemoConfig")])
def test_every_option_is_its_config_field(command, cls):
    # One place for an option: the config field's default, choices and help are what click shows and uses.
    import dataclasses

    from dflash import config

    fields = {f.name: f for f in dataclasses.fields(getattr(config, cls))}
    from dflash.config.options import flag_name

    # hidden: a former option name, still taken with a deprecation line (tests/test_option_names.py)
    params = {p.name: p for p in cli.commands[command].params if p.name not in ("config", "as_json") and not p.hidden}
    assert set(params) == set(fields)
    for name, field in fields.items():
        p, meta = params[name], field.metadata
        assert meta["help"] and p.help == meta["help"], name
        assert p.opts == ["--" + flag_name(field).replace("_", "-")], name
        if field.default is not dataclasses.MISSING and field.type != "bool":
            expected = meta["cli_default"] or field.default
            assert p.default == expected, name
            if meta["choices"]:
                assert list(p.type.choices) == list(meta["choices"]), name
        assert p.required == (field.default is dataclasses.MISSING), name
    # Parsing the defaults gives the dataclass's own defaults (layers: auto -> None).
    from dflash.cli import make_config

    required = {n: ("x",) if str(f.type).startswith("tuple[str") else "x" for n, f in fields.items()
                if f.default is dataclasses.MISSING}
    opts = {n: (p.default if p.default is not None else None) for n, p in params.items() if n not in required}
    made = make_config(getattr(config, cls), {**opts, **required})
    assert made == getattr(config, cls)(**required)


def _fake_sklearn(tmp_path) -> tuple[dict, str]:
    """A package named sklearn that leaves a marker file when imported; (env with it on the path, marker path)."""
    import os

    pkg = tmp_path / "sklearn"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    return env, str(marker)


@pytest.mark.parametrize("skip", [True, False])
def test_unused_packages_count_as_absent_to_transformers(tmp_path, skip):
    # transformers 5.17 imports scikit-learn with its generation module whenever it is installed (seconds of start-up
    # that dflash never uses); once skipped, transformers sees it as absent and nothing imports it. Unskipped, the
    # same process finds and imports it: the check is not vacuous.
    import os

    env, marker = _fake_sklearn(tmp_path)
    code = (
        "import importlib, sys\n"
        + ("from dflash.runtime.process import skip_unused_packages; print(skip_unused_packages())\n" if skip
           else "print([])\n")
        + "from transformers.utils import is_sklearn_available\n"
        "print(is_sklearn_available())\n"
        "try:\n    import sklearn\n    print('imported')\nexcept ImportError:\n    print('absent')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    if skip:
        assert out.split() == ["['sklearn']", "False", "absent"]
        assert not os.path.exists(marker)
    else:
        assert out.split() == ["[]", "True", "imported"]
        assert os.path.exists(marker)


def test_unused_packages_kept_when_asked_or_already_imported(tmp_path, monkeypatch):
    from dflash.runtime.process import skip_unused_packages

    monkeypatch.setenv("DFLASH_KEEP_PACKAGES", "sklearn")
    assert skip_unused_packages(["sklearn"]) == []
    monkeypatch.delenv("DFLASH_KEEP_PACKAGES")
    assert skip_unused_packages(["json"]) == []  # already imported: left as it is
    assert sys.modules["json"] is not None


def test_every_command_skips_unused_packages(monkeypatch):
    # The group's callback runs before any command imports transformers (and spawned workers do the same in
    # runtime.process._child).
    monkeypatch.delitem(sys.modules, "sklearn", raising=False)
    monkeypatch.delenv("DFLASH_KEEP_PACKAGES", raising=False)
    result = CliRunner().invoke(cli, ["extract", "--help"])
    assert result.exit_code == 0, result.output
    assert "sklearn" in sys.modules and sys.modules["sklearn"] is None
    monkeypatch.delitem(sys.modules, "sklearn")  # what the test process had before
