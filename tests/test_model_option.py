"""A --model or --target that cannot be a Hugging Face model folder: one line, exit 2, nothing made, for every
command that takes one."""
from __future__ import annotations

import subprocess
import sys

import pytest

# The other options each command needs, so that the model path is what it refuses.
_COMMANDS = {
    "extract": ["--model", "{m}", "--data", "{d}", "--out", "{o}", "--gpus", "cpu"],
    "generate": ["--model", "{m}", "--prompts", "{d}", "--out", "{o}", "--device", "cpu"],
    "run": ["--model", "{m}", "--data", "{d}", "--store", "{o}", "--out", "{o}-run", "--extract-gpus", "cpu",
            "--train-gpus", "cpu"],
    "train": ["--store", "{d}", "--target", "{m}", "--out", "{o}", "--gpus", "cpu"],
    "eval": ["--drafter", "{d}", "--prompts", "{d}", "--target", "{m}"],
}


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "file.safetensors").write_bytes(b"\0" * 16)
    (root / "no-config").mkdir()
    (root / "no-config" / "model.safetensors").write_bytes(b"\0" * 16)
    return {"": "got an empty path", str(root / "file.safetensors"): "found a file",
            str(root / "no-config"): "found a folder without one", str(root / "absent"): "found nothing there"}


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_a_model_path_that_is_no_model_folder_is_one_line_and_exit_2(command, bad_models, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    option = "--target" if "--target" in _COMMANDS[command] else "--model"
    for model, found in bad_models.items():
        out = tmp_path / f"out{len(found)}"
        args = [a.format(m=model, d=data, o=out) for a in _COMMANDS[command]]
        proc = subprocess.run([sys.executable, "-m", "dflash.cli", command, *args], capture_output=True, text=True,
                              timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith(f"dflash: error: {option}") and found in lines[0], lines[0]
        assert "Hugging Face model folder" in lines[0] and "Traceback" not in proc.stderr
        assert not out.exists() and not (tmp_path / f"{out.name}-run").exists()
