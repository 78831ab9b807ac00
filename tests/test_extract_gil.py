"""The GIL hand-over interval a CUDA worker sets while it fills shards (extract/worker.py gil_handover)."""
from __future__ import annotations

import sys

import pytest

from dflash.extract import worker


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_a_cuda_worker_hands_the_gil_over_sooner_and_restores_it(interval):
    with worker.gil_handover("cuda:3"):
        assert sys.getswitchinterval() == pytest.approx(worker.GIL_SWITCH_S)
        assert worker.GIL_SWITCH_S < 0.005
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_interval_comes_back_when_the_fill_fails(interval):
    with pytest.raises(KeyboardInterrupt):
        with worker.gil_handover("cuda"):
            raise KeyboardInterrupt
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_cpu_worker_leaves_the_interval_alone(interval):
    with worker.gil_handover("cpu"):
        assert sys.getswitchinterval() == pytest.approx(0.005)
