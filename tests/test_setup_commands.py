"""The README's two set-up commands: CI runs the test command as the README prints it, both install through the
lock, and the lock pins what pyproject allows."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("pip install torch==")]


def test_ci_runs_the_readmes_test_command_and_both_use_the_lock():
    demo, tests = _readme_commands()
    assert demo.endswith("&& dflash demo") and tests.endswith("&& pytest -q")
    assert tests in [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in (demo, tests):
        installs = [part.strip() for part in command.split("&&") if part.strip().startswith("pip install")]
        # Every install that resolves dependencies goes through constraints.txt (--no-deps resolves none).
        assert all("-c constraints.txt" in p or "--no-deps" in p for p in installs), command


def test_the_lock_pins_the_releases_pyproject_allows():
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line):
            pins[m.group(1).lower().replace("_", "-")] = Version(m.group(2))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch" not in pins  # the README's own command pins it; a GPU user brings theirs
    for raw in project["dependencies"]:
        req = Requirement(raw)
        name = req.name.lower().replace("_", "-")
        if name == "torch":
            continue
        assert name in pins, f"constraints.txt pins no {name}: run bash .ci/lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req.specifier}"
