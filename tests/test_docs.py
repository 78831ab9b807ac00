"""The documentation: the generated reference is current, the site builds in strict mode, and the commands the README
and the docs show are commands the CLI takes (their --help and --dry-run forms run here; the demo's `--budget tiny`
runs in tests/test_demo.py)."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from dflash.cli import cli, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = {DOCS / "reference" / "cli.md", DOCS / "reference" / "errors.md"}


def gen_reference():
    """Return docs/gen_reference.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def doc_commands() -> list[tuple[str, list[str]]]:
    """Return every `dflash ...` command in a fenced code block of README.md and the docs pages (generated pages
    aside), as (where, argv after `dflash`), with backslash continuations joined and comments dropped."""
    found = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        if path in GENERATED:
            continue
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line.startswith("dflash ") and "..." not in line:
                    argv = shlex.split(line, comments=True)[1:]
                    found.append((f"{path.relative_to(ROOT)}: {line[:60]}", argv))
    return found


def test_the_generated_reference_is_what_the_cli_generates_now():
    # Fails after an option, a default or a help text changed without `python docs/gen_reference.py`.
    gen = gen_reference()
    for key, text in {"cli": gen.cli_page(), "errors": gen.errors_page()}.items():
        committed = gen.PAGES[key].read_text(encoding="utf-8")
        assert committed == text, f"{gen.PAGES[key]} is stale: run python docs/gen_reference.py"
    # and it holds what it must: every command, every visible option, every error family
    page = gen.cli_page()
    for name, cmd in cli.commands.items():
        assert f"## `dflash {name}`" in page
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert f"`{p.opts[0]}" in page, (name, p.opts[0])
    from dflash import errors

    assert all(f"| `{n}` |" in gen.errors_page() for n in errors.__all__)


def test_an_error_family_without_its_fix_stops_the_generator(monkeypatch):
    from dflash import errors

    gen = gen_reference()
    monkeypatch.setattr(errors, "__all__", [*errors.__all__, "NewError"], raising=True)
    monkeypatch.setattr(errors, "NewError", type("NewError", (errors.DflashError,), {}), raising=False)
    with pytest.raises(SystemExit, match="NewError"):
        gen.errors_page()


def test_every_command_the_docs_show_parses_with_todays_options():
    commands = doc_commands()
    assert len(commands) >= 20, commands  # the README's recipe and the guides' commands were found
    seen = set()
    for where, argv in commands:
        name, args = argv[0], argv[1:]
        assert name in cli.commands, where
        cmd = cli.commands[name]
        visible = {o for p in cmd.params if not getattr(p, "hidden", False) for o in p.opts}
        unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in visible]
        assert not unknown, f"{where}: no such option of dflash {name}: {unknown}"
        cmd.make_context(name, list(args))  # types, choices and required options, as the command parses them
        seen.add(name)
    assert {"generate", "extract", "run", "train", "eval", "export"} <= seen


def test_help_of_every_command_answers(capsys):
    proc = subprocess.run([sys.executable, "-m", "dflash.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Commands:" in proc.stdout, proc.stderr
    for name, cmd in cli.commands.items():
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith(f"Usage: dflash {name}"), name
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert p.opts[0] in out, (name, p.opts[0])


def test_the_docs_dry_run_commands_run_on_a_tiny_target(tiny_qwen3, tmp_path, capsys):
    # The docs' --dry-run forms, with their paths replaced by a tiny target and a small conversation file and their
    # GPUs by the CPU: each prints the plan and writes nothing.
    from test_extract_run import write_conversations

    data = write_conversations(tmp_path / "data.jsonl", 12, seed=3)
    dry = [(where, argv) for where, argv in doc_commands() if "--dry-run" in argv]
    assert dry, "the docs show no --dry-run command"
    subs = {"--model": str(tiny_qwen3), "--target": str(tiny_qwen3), "--data": str(data), "--gpus": "cpu"}
    for i, (where, argv) in enumerate(dry):
        out = tmp_path / f"store{i}"
        subs["--out"] = str(out)
        args = [subs.get(argv[k - 1], a) if k else a for k, a in enumerate(argv)]
        with pytest.raises(SystemExit) as e:
            main(args)
        text = capsys.readouterr()
        assert e.value.code == 0, f"{where}: {text.err}"
        assert "plan of" in text.out and "projected" in text.out, where
        assert not out.exists(), f"{where}: a dry run wrote {out}"


def build_site(root: Path, site: Path) -> subprocess.CompletedProcess:
    """Run `mkdocs build --strict` on the mkdocs.yml in root, into site."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, printed on every build
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_site_builds_offline_in_strict_mode(tmp_path):
    pytest.importorskip("material", reason="the docs generator is not installed: pip install -e '.[docs]'")
    proc = build_site(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "reference/cli/index.html", "benchmarks/results/index.html"} <= pages, pages
    # bench/RESULTS.md is in the site, and no page loads anything from elsewhere (fonts, scripts)
    assert "Targets beyond plain attention" in (tmp_path / "site/benchmarks/results/index.html").read_text()
    for page in (tmp_path / "site").rglob("*.html"):
        assert not re.search(r"<(link|script)[^>]+(href|src)=\"https?://", page.read_text()), page


def test_strict_mode_fails_on_a_broken_link(tmp_path):
    pytest.importorskip("material", reason="the docs generator is not installed: pip install -e '.[docs]'")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "RESULTS.md", tmp_path / "bench" / "RESULTS.md")
    page = tmp_path / "docs" / "guides" / "resume.md"
    page.write_text(page.read_text() + "\nSee [the old page](no-such-page.md).\n")
    proc = build_site(tmp_path, tmp_path / "site")
    assert proc.returncode != 0 and "no-such-page.md" in proc.stderr, proc.stderr[-2000:]
