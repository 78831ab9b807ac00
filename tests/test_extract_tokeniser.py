"""A worker's shards tokenised in a child process (extract/tokeniser.py), the path a CUDA worker takes from its
second shard on, run here on the CPU by forcing the choice: the store, the drop counts and the resume equal the
thread path's; a killed child is a ResourceError that a rerun resumes; a killed worker leaves no child behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import dflash.extract.worker as worker
from dflash.errors import ResourceError
from dflash.extract import run
from dflash.extract.tokeniser import ChildTokeniser
from dflash.tests.test_extract_run import BAD_ROWS, extract_config, store_samples, write_conversations


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conv.jsonl", 18)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for row in a:
        for x, y in zip(a[row], b[row]):
            np.testing.assert_array_equal(x, y)


def test_shards_tokenised_in_a_child_equal_the_threads(data_file, tiny_qwen3, tmp_path, monkeypatch):
    thread = run(extract_config(tiny_qwen3, data_file, tmp_path / "thread"))
    submitted: list[int] = []
    submit = ChildTokeniser.submit

    def counted(self, shard_id):
        submitted.append(shard_id)
        return submit(self, shard_id)

    monkeypatch.setattr(worker, "tokenise_in_child", lambda device, shards_left: shards_left > 1)
    monkeypatch.setattr(ChildTokeniser, "submit", counted)
    child = run(extract_config(tiny_qwen3, data_file, tmp_path / "child"))
    # 18 rows in shards of 4: 5 shards, the first on the thread, the other 4 in the child
    assert sorted(submitted) == [1, 2, 3, 4]
    assert child["dropped_rows"] == thread["dropped_rows"] == {reason: [row] for row, reason in BAD_ROWS.items()}
    _same(store_samples(tmp_path / "child"), store_samples(tmp_path / "thread"))


def test_a_child_killed_mid_run_is_a_resource_error_and_a_rerun_resumes(data_file, tiny_qwen3, tmp_path,
                                                                          monkeypatch):
    run(extract_config(tiny_qwen3, data_file, tmp_path / "whole"))
    submit = ChildTokeniser.submit

    def killing(self, shard_id):
        if shard_id == 2:  # the child dies before it tokenises shard 2: shards 0 and 1 commit
            for pid in list(self._pool._processes):
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        return submit(self, shard_id)

    monkeypatch.setattr(worker, "tokenise_in_child", lambda device, shards_left: shards_left > 1)
    monkeypatch.setattr(ChildTokeniser, "submit", killing)
    out = tmp_path / "killed"
    with pytest.raises(ResourceError, match=r"shard 2: the worker's tokeniser process died .* rerun the same command"):
        run(extract_config(tiny_qwen3, data_file, out))
    assert 0 < len(store_samples(out)) < len(store_samples(tmp_path / "whole"))
    monkeypatch.setattr(ChildTokeniser, "submit", submit)
    run(extract_config(tiny_qwen3, data_file, out))
    _same(store_samples(out), store_samples(tmp_path / "whole"))


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_worker_killed_outright_leaves_no_tokeniser_behind(data_file, tiny_qwen3, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        import dflash.extract.worker as worker
        from dflash.extract import run
        from dflash.extract.tokeniser import ChildTokeniser
        from dflash.tests.test_extract_run import extract_config

        worker.tokenise_in_child = lambda device, shards_left: shards_left > 1
        submit = ChildTokeniser.submit

        def hang(self, shard_id):
            future = submit(self, shard_id)
            print("SUBMITTED", flush=True)
            time.sleep(600)  # killed here, the child alive and waiting for its next shard
            return future

        ChildTokeniser.submit = hang
        run(extract_config({str(tiny_qwen3)!r}, {str(data_file)!r}, {str(tmp_path / 'store')!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SUBMITTED"
        kids = [k for k in _children(proc.pid) if _alive(k)]
        assert kids, "the worker has no tokeniser process"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 20
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if _alive(k)], f"tokeniser processes {kids} outlived their killed worker"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_bad_row_in_a_later_shard_stops_a_strict_run_as_on_the_thread(tiny_qwen3, tmp_path, monkeypatch):
    from dflash.errors import InputError

    data = write_conversations(tmp_path / "conv.jsonl", 18, bad={9: "unknown_role"})  # shard 2, in the child
    monkeypatch.setattr(worker, "tokenise_in_child", lambda device, shards_left: shards_left > 1)
    with pytest.raises(InputError, match=r"conv.jsonl:10: bad row \(unknown_role"):
        run(extract_config(tiny_qwen3, data, tmp_path / "store", strict=True))
