"""`dflash extract` loads its target beside the rest of start-up: same features, same refusals, prompt stops."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash.extract import orchestrate, run
from test_extract_run import data_file, extract_config, one_torch_thread, store_samples  # noqa: F401  (fixtures)

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

_FLAGS = ["--gpus", "cpu", "--batch-tokens", "1024", "--max-length", "256", "--min-loss-tokens", "1",
          "--dtype", "float32", "--shard-size", "4"]
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _extract(model: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "dflash.cli", "extract", "--model", str(model), "--data", str(data), "--out",
            str(out), *_FLAGS]


def _patched(load: str, model: Path, data: Path, out: Path) -> list[str]:
    """Return the command line of _extract with targets/load.py's load_for_features replaced by `load` (Python source of a
    function body with model_dir, device, dtype in scope): a load that fails or hangs where the real one would."""
    src = ("import sys, time\nimport dflash.targets.load as loading\nfrom dflash.errors import InputError\n"
           f"def load_for_features(model_dir, device, dtype):\n    {load}\nloading.load_for_features = load_for_features\n"
           "from dflash.cli import main\nmain()\n")
    return [sys.executable, "-c", src, *_extract(model, data, out)[3:]]


def _one_line(proc: subprocess.CompletedProcess, text: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash: error: ")]
    assert len(errors) == 1 and text in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_features_equal_the_sequential_load(tiny_qwen3, data_file, tmp_path, monkeypatch):  # noqa: F811
    beside = tmp_path / "beside"
    summary = run(extract_config(tiny_qwen3, data_file, beside))
    monkeypatch.setattr(orchestrate, "_load_beside", lambda cfg, devices, complete: False)
    inline = tmp_path / "inline"
    run(extract_config(tiny_qwen3, data_file, inline))
    a, b = store_samples(beside), store_samples(inline)
    assert sorted(a) == sorted(b) and len(a) == summary["samples"] > 0
    for row in a:
        for x, y in zip(a[row], b[row]):
            assert x.dtype == y.dtype and np.array_equal(x, y), row


def test_a_dry_run_loads_nothing_beside(tiny_qwen3, data_file, tmp_path, monkeypatch):  # noqa: F811
    from dflash.extract import loader

    def refuse(self):
        raise AssertionError("a dry run started the background load")

    monkeypatch.setattr(loader.BackgroundLoad, "start", refuse)
    result = run(extract_config(tiny_qwen3, data_file, tmp_path / "store", dry_run=True))
    assert "plan" in result and not (tmp_path / "store").exists()


def _break(model: Path, folder: Path, how: str) -> Path:
    shutil.copytree(model, folder)
    weights = next(folder.glob("*.safetensors"))
    raw = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file" * 8 if how == "garbage" else raw[: len(raw) // 2])
    return folder


@pytest.mark.parametrize("how, found", [("garbage", "found a header length of"), ("truncated", "(cut short)")])
def test_broken_weights_refuse_in_one_line_without_a_store(tiny_qwen3, data_file, tmp_path, how, found):  # noqa: F811
    model = _break(tiny_qwen3, tmp_path / "model", how)
    out = tmp_path / "store"
    proc = subprocess.run(_extract(model, data_file, out), capture_output=True, text=True,
                          env=_ENV, timeout=300)
    line = _one_line(proc, "model.safetensors to be a safetensors file")
    assert found in line and str(model) in line and not out.exists()


def test_missing_weights_refuse_in_one_line_without_a_store(tiny_qwen3, data_file, tmp_path):  # noqa: F811
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model, ignore=shutil.ignore_patterns("*.safetensors"))
    out = tmp_path / "store"
    proc = subprocess.run(_extract(model, data_file, out), capture_output=True, text=True,
                          env=_ENV, timeout=300)
    _one_line(proc, "expected weights (*.safetensors")
    assert not out.exists()


def test_a_failed_background_load_is_the_same_one_line_error(tiny_qwen3, data_file, tmp_path):  # noqa: F811
    # What the header cannot see (out of memory, a loader's own refusal) fails on the load's thread: the main
    # thread reports it as the in-line load did, in one line, and since it waits for the load (and the runner's
    # self-check) before it makes the store, leaves no store behind.
    out = tmp_path / "store"
    load = "time.sleep(1); raise InputError(f'--model {model_dir}: expected loadable weights, found none (test)')"
    proc = subprocess.run(_patched(load, tiny_qwen3, data_file, out), capture_output=True, text=True, env=_ENV,
                          timeout=300)
    _one_line(proc, "expected loadable weights, found none (test)")
    assert not out.exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_load_stops_promptly(tiny_qwen3, data_file, tmp_path, sig, code):  # noqa: F811
    out = tmp_path / "store"
    load = "print('LOADING', file=sys.stderr, flush=True); time.sleep(600)"
    proc = subprocess.Popen(_patched(load, tiny_qwen3, data_file, out), stderr=subprocess.PIPE, text=True, env=_ENV)
    seen: list[str] = []
    try:
        for line in proc.stderr:  # the load has begun and the main thread has read the data beside it
            seen.append(line)
            if "LOADING" in "".join(seen) and " rows of " in "".join(seen):
                break
        else:
            pytest.fail("".join(seen)[-3000:])
        time.sleep(0.5)  # into model_wait
        proc.send_signal(sig)
        rest = proc.communicate(timeout=120)[1]  # the load sleeps for 600 s: the command must not wait for it
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, rest[-3000:]
    assert "interrupted; rerun the same command to resume" in rest, rest[-3000:]
    assert not out.exists(), "a store made before the target was checked"


def test_the_prefetch_reads_every_weight_file_once(tmp_path):
    from dflash.targets.load import WeightPrefetch

    (tmp_path / "config.json").write_text("{}")
    sizes = {"model-00001-of-00002.safetensors": 3 << 20, "model-00002-of-00002.safetensors": (1 << 20) + 7,
             "pytorch_model.bin": 5}
    for name, n in sizes.items():
        (tmp_path / name).write_bytes(os.urandom(n))
    done = []
    p = WeightPrefetch(tmp_path, block=1 << 20, available=1 << 40, on_done=done.append).start()
    assert p.wait(30) and p.skipped is None
    assert [f.name for f in p.files] == sorted(sizes) and p.read_bytes == p.bytes == sum(sizes.values())
    assert len(done) == 1 and done[0] == p.seconds >= 0


@pytest.mark.parametrize("case", ["too_large", "no_folder", "no_weights"])
def test_the_prefetch_skips_what_it_should_not_read(tmp_path, case):
    from dflash.targets.load import WeightPrefetch

    (tmp_path / "model.safetensors").write_bytes(b"x" * 4096)
    folder = {"too_large": tmp_path, "no_folder": tmp_path / "absent", "no_weights": tmp_path / "empty"}[case]
    if case == "no_weights":
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    # Weights larger than half the memory available would push each other out of the page cache.
    p = WeightPrefetch(folder, available=4096, on_done=lambda s: pytest.fail("a skipped prefetch read")).start()
    assert p.wait(5) and p.skipped and p.read_bytes == 0


def test_a_cancelled_prefetch_stops_at_the_next_block(tmp_path):
    from dflash.targets.load import WeightPrefetch

    (tmp_path / "model.safetensors").write_bytes(b"x" * (8 << 20))
    p = WeightPrefetch(tmp_path, block=1 << 20, available=1 << 40)
    p.close()  # cancelled before it starts: it reads at most the block it is in
    assert p.start().wait(30) and p.read_bytes <= 1 << 20
