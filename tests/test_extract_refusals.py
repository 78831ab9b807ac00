"""`dflash extract` on what it cannot use or cannot write: one clear line, exit 2, nothing left behind."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from test_extract_run import data_file  # noqa: F401  (fixture)
from test_train_run import dflash_main

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

_FLAGS = ["--gpus", "cpu", "--batch-tokens", "1024", "--max-length", "256", "--min-loss-tokens", "1",
          "--dtype", "float32", "--shard-size", "4"]


def _extract(capsys, model: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    """Run the `dflash` entry point in this process (a process of its own would add only its start-up)."""
    args = ["extract", "--model", str(model), "--data", str(data), "--out", str(out), *_FLAGS]
    return subprocess.CompletedProcess(args, *dflash_main(capsys, *args))


def _one_line(proc: subprocess.CompletedProcess, text: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and "INFO" not in line]
    assert len(errors) == 1 and errors[0].startswith("dflash: error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and text in errors[0], proc.stderr[-2000:]


def test_an_encoder_model_is_refused_naming_what_is_supported(tmp_path, data_file, capsys):  # noqa: F811
    from transformers import BertConfig

    from dflash.tests.tiny_targets import build_tokenizer

    bert = tmp_path / "bert"
    tok = build_tokenizer("chatml")
    BertConfig(vocab_size=len(tok) + 8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    tok.save_pretrained(bert)
    proc = _extract(capsys, bert, data_file, tmp_path / "store")
    _one_line(proc, "dflash extract supports decoder-only transformers")
    assert "bert" in proc.stderr and not (tmp_path / "store").exists()


def _mount(path: Path, *opts: str) -> None:
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=64m", *opts)), "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


def test_a_read_only_out_is_one_line_and_a_complete_store_reruns_read_only(tmp_path, tiny_qwen3, data_file,  # noqa: F811
                                                                           capsys):
    for opts in (("ro",), ("ro", "size=16k")):  # the second too small for the store: read-only is still the news
        ro = tmp_path / "-".join(opts)
        _mount(ro, *opts)
        try:
            _one_line(_extract(capsys, tiny_qwen3, data_file, ro / "store"), "cannot write the store there")
        finally:
            subprocess.run(["umount", "-l", str(ro)], check=False)
    mnt = tmp_path / "mnt"
    _mount(mnt)
    try:
        first = _extract(capsys, tiny_qwen3, data_file, mnt / "store")
        assert first.returncode == 0, first.stderr[-2000:]
        done = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot remount read-only here: {done.stderr.decode().strip()}")
        again = _extract(capsys, tiny_qwen3, data_file, mnt / "store")  # a complete store needs no write
        assert again.returncode == 0, again.stderr[-2000:]
        assert "samples" in again.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


_DOWN = "model.layers.2.mlp.down_proj.weight"  # [hidden 64, intermediate 128] in the tiny target


def _damaged(src: Path, dst: Path, how: str) -> Path:
    """Return a copy of a target folder whose model.safetensors is damaged one way."""
    import json
    import shutil
    import struct

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if how == "dtype":  # the header says F16 for 4-byte values: the same header length, the wrong bytes
        raw = weights.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        assert header[_DOWN]["dtype"] == "F32"
        header[_DOWN]["dtype"] = "F16"
        meta = json.dumps(header, separators=(",", ":")).encode().ljust(n)
        weights.write_bytes(raw[:8] + meta + raw[8 + n:])
        return dst
    sd = load_file(weights)
    if how == "missing":
        del sd[_DOWN]
    elif how == "transposed":
        sd[_DOWN] = sd[_DOWN].t().contiguous()
    elif how == "nan":
        sd[_DOWN] = sd[_DOWN].clone()
        sd[_DOWN][3, 5] = float("nan")
    save_file(sd, weights, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("how, text", [
    ("missing", f"expected tensor {_DOWN}, found it in none of model.safetensors (the model would start it at random)"),
    ("transposed", f"expected tensor {_DOWN} of shape [64, 128], found [128, 64] in model.safetensors"),
    ("dtype", f"tensor {_DOWN} in model.safetensors: its header says F16 [64, 128] (16,384 bytes), the file holds "
              "32,768 bytes"),
    ("nan", f"tensor {_DOWN} holds 1 non-finite values (NaN or inf)"),
])
def test_damaged_weights_are_one_line_before_any_store_exists(tmp_path, tiny_qwen3, data_file, capsys, how,  # noqa: F811
                                                             text):
    model = _damaged(tiny_qwen3, tmp_path / how, how)
    proc = _extract(capsys, model, data_file, tmp_path / "store")
    _one_line(proc, text)
    assert not (tmp_path / "store").exists()


def test_two_arrays_in_one_data_file_are_refused_and_nothing_is_written(tmp_path, tiny_qwen3, data_file, capsys):  # noqa: F811
    import json

    rows = [json.loads(line) for line in data_file.read_text().splitlines()[:3]]
    joined = tmp_path / "all.json"
    joined.write_text(json.dumps(rows, indent=1) + "\n" + json.dumps(rows))
    _one_line(_extract(capsys, tiny_qwen3, joined, tmp_path / "store"), "found more text at byte")
    assert not (tmp_path / "store").exists()
