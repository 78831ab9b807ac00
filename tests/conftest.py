"""Shared fixtures: tiny random targets built offline, hub access switched off, the gpu marker."""
from __future__ import annotations

import os

import pytest

# Nothing in the test run may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3 target folder (ChatML template, 8 layers, hidden 64, vocab larger than the tokenizer)."""
    from dflash.testing import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama target folder (Llama-3-style template, 8 layers, hidden 64)."""
    from dflash.testing import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")
