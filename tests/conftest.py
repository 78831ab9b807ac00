"""Shared fixtures: tiny random targets built offline, the converted SmolLM2 folder, hub access switched off, the gpu
marker."""
from __future__ import annotations

import os

import pytest

# Nothing in the test run may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """Under pytest-xdist (the README's test command runs two workers, one a core on CI's 2-core machine): torch on
    one thread in each worker and in every interpreter a test starts (OMP_NUM_THREADS is inherited). OpenMP threads
    spinning against another worker's made runs many times slower: the tiny demo took 130 s alone and 352 s inside
    the suite (bench/RESULTS.md); tests that start subprocesses already set it one by one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _dynamo_first_graphs():
    """Each test leaves torch.compile's first-graph settings as it found them: kernels.dynamic_first turns them
    dynamic and duck sizing off for the process (on CUDA, where a self-check tries flex), which would make later
    tests' compilation depend on the order they run in."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "_dynamo"):
        yield
        return
    import torch.fx.experimental._config as shapes

    with torch._dynamo.config.patch(assume_static_by_default=torch._dynamo.config.assume_static_by_default), \
            shapes.patch(use_duck_shape=shapes.use_duck_shape):
        yield


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3 target folder (ChatML template, 8 layers, hidden 64, vocab larger than the tokenizer)."""
    from dflash.tests.tiny_targets import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama target folder (Llama-3-style template, 8 layers, hidden 64)."""
    from dflash.tests.tiny_targets import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """Conversations whose answers a tiny drafter can learn (test_train_run.write_toy_data)."""
    from test_train_run import write_toy_data

    return write_toy_data(tmp_path_factory.mktemp("train-data") / "toy.jsonl")


@pytest.fixture(scope="session")
def store(tiny_qwen3, toy_data, tmp_path_factory) -> str:
    """A complete store of 6 shards made by `dflash extract` on the tiny target, once per session: here, not in
    test_train_run, since a session fixture imported into another test module is built again for that module."""
    from test_train_run import SHARD_ROWS

    from dflash.config import ExtractConfig
    from dflash.extract import run
    from dflash.storage import Store

    out = tmp_path_factory.mktemp("train-store") / "store"
    run(ExtractConfig(model=str(tiny_qwen3), data=(str(toy_data),), out=str(out), gpus="cpu", shard_size=SHARD_ROWS,
                      batch_tokens=1024, max_length=256, min_loss_tokens=4, dtype="float32"))
    assert Store.open(str(out)).is_complete()
    return str(out)


_CONVERT = "from dflash.demo.assets import smollm2_folder; print(smollm2_folder())"


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Convert the SmolLM2 GGUF into a fresh cache with two processes at once; both must return the same complete
    folder. Session-wide: test_assets checks the conversion, test_demo runs on the folder (DFLASH_CACHE=its parent)
    instead of converting again."""
    import subprocess
    import sys

    from dflash.demo import assets

    cache = tmp_path_factory.mktemp("dflash-cache")
    # What a converter killed two hours ago leaves behind; the next conversion clears it away.
    orphan = cache / f".{assets.SMOLLM2_FOLDER_NAME}.99999.deadbeef.tmp"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    old = os.stat(orphan).st_mtime - 7200
    os.utime(orphan, (old, old))
    env = {**os.environ, "DFLASH_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONVERT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    folder = cache / assets.SMOLLM2_FOLDER_NAME
    assert paths == {str(folder)}
    # Exactly the published folder: the losing process removed its temporary copy, and the orphan is gone.
    assert sorted(p.name for p in cache.iterdir()) == [assets.SMOLLM2_FOLDER_NAME]
    return folder
