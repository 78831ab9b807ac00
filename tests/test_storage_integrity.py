"""Corruption of a committed shard is caught by the reader and by `dflash verify`, by path; none is read as data."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dflash.cli import main
from dflash.errors import CorruptShard
from dflash.storage import Store
from dflash.tests.synthetic_shards import read_sample, write_synthetic_shard

HEADER = {"layer_ids": [1, 4], "hidden_size": 48, "codec": "blosc", "shard_plan": {"num_shards": 3}, "tag": "t"}


def make_store(path, codec: str = "blosc") -> Store:
    store = Store.create_or_open(str(path), {**HEADER, "codec": codec}, chunk_tokens=64)
    for i in range(3):
        write_synthetic_shard(store, i, num_samples=6)
    return store


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def delete(path) -> None:
    path.unlink()


def edit_record(path) -> None:
    rec = json.loads(path.read_text())
    rec["num_tokens"] += 1
    path.write_text(json.dumps(rec))


DAMAGE = {"flip": flip_byte, "truncate": truncate, "delete": delete}


@pytest.mark.parametrize("codec", ["blosc", "none", "fp8", "uq6"])
@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("target", ["features/c.1.0.0", "input_ids/c.0", "offsets/c.0"])
def test_damaged_chunk_is_reported_by_path(tmp_path, codec, kind, target):
    store = make_store(tmp_path, codec)
    path = tmp_path / "shards/00001" / target
    DAMAGE[kind](path)
    with pytest.raises(CorruptShard) as e:
        store.read_shard(1)
    assert str(path) in str(e.value) and "shard 1" in str(e.value)
    problems = store.verify(1)
    assert len(problems) == 1 and str(path) in problems[0]
    assert store.verify(0) == [] and store.verify(2) == []
    store.read_shard(0)  # the others stay readable


def test_edited_commit_record_is_reported(tmp_path):
    store = make_store(tmp_path)
    path = tmp_path / "commits/00002.json"
    edit_record(path)
    with pytest.raises(CorruptShard, match="modified after commit"):
        store.read_shard(2)
    assert str(path) in store.verify(2)[0]
    path.write_text("{not json")
    assert "not valid JSON" in store.verify(2)[0]


def test_flip_in_array_metadata_is_reported_by_verify(tmp_path):
    store = make_store(tmp_path)
    path = tmp_path / "shards/00000/features/zarr.json"
    text = path.read_text()
    path.write_text(text.replace('"clevel": 1', '"clevel": 2'))
    assert str(path) in store.verify(0)[0]


@pytest.mark.parametrize("codec", ["fp8", "uq6"])
def test_scales_damage_is_reported(tmp_path, codec):
    store = make_store(tmp_path, codec)
    path = tmp_path / "shards/00000/feature_scales/c.0.0"
    flip_byte(path)
    with pytest.raises(CorruptShard, match="feature_scales/c.0.0"):
        store.read_shard(0)


def test_unverified_read_skips_checksums_but_not_sizes(tmp_path):
    store = make_store(tmp_path, "none")
    truncate(tmp_path / "shards/00001/features/c.0.0.0")
    with pytest.raises(CorruptShard, match="expected"):
        store.read_shard(1, verify=False)


def run_cli(*args: str) -> tuple[int, str]:
    # A real process: exit codes and output exactly as a user sees them.
    p = subprocess.run([sys.executable, "-m", "dflash.cli", *args], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def test_verify_command_exit_codes_and_repair(tmp_path):
    store = make_store(tmp_path)
    assert run_cli("verify", str(tmp_path))[0] == 0
    flip_byte(tmp_path / "shards/00000/features/c.0.0.0")
    delete(tmp_path / "shards/00002/loss_mask/c.0")
    code, out = run_cli("verify", str(tmp_path))
    bad = [line for line in out.splitlines() if line.startswith("shard ")]
    assert code == 1 and len(bad) == 2, out
    assert "shards/00000/features/c.0.0.0" in bad[0] and "shards/00002/loss_mask/c.0" in bad[1]
    assert store.committed_ids() == [0, 1, 2]  # plain verify changes nothing
    code, out = run_cli("verify", str(tmp_path), "--repair")
    assert code == 1 and "withdrew" in out
    assert store.committed_ids() == [1]
    assert run_cli("verify", str(tmp_path))[0] == 0
    assert store.gc()["shards"] == 2  # the withdrawn shards are garbage now, redone by the next extract


def test_inspect_command(tmp_path, capsys):
    store = make_store(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path), "--json"])
    assert e.value.code == 0
    info = json.loads(capsys.readouterr().out)
    recs = [store.commit_record(i) for i in range(3)]
    assert info["shards_committed"] == 3 and info["shards_planned"] == 3 and info["complete"] is False
    assert info["tokens"] == sum(r["num_tokens"] for r in recs)
    assert info["loss_tokens"] == sum(r["num_loss_tokens"] for r in recs)
    assert info["bytes_on_disk"] == sum(r["bytes"] for r in recs)
    assert 1.0 < info["compression_ratio"] < 2.0 and info["header"]["tag"] == "t"
    assert sum(info["writers"].values()) == 3
    store.mark_complete()
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path)])
    text = capsys.readouterr().out
    assert "3 / 3 committed  (complete)" in text and "B/token" in text
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path / "missing")])
    assert e.value.code == 2 and "no dflash store" in capsys.readouterr().err


_EXIT_HARNESS = """
import atexit, concurrent.futures, sys, threading, time
marks, store = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(marks + "/atexit", "w").close())
def late():
    time.sleep(0.5)
    open(marks + "/thread", "w").close()
threading.Thread(target=late).start()  # non-daemon: the exit waits for it
pool = concurrent.futures.ThreadPoolExecutor(1)  # never shut down: its idle worker must not hold the exit
pool.submit(time.sleep, 0).result()
class Finalized:
    def __del__(self, _open=open, _path=marks + "/finalized"):  # bound now: builtins may be gone by then
        _open(_path, "w").close()
keep = Finalized()  # freed only by the interpreter's finalization
sys.stdout.write("tail without a newline ")  # still in the pipe's buffer when the command ends
sys.argv = ["dflash", "inspect", store]
from dflash.cli import main
main()
"""


def test_console_entry_skips_finalization_and_keeps_every_exit_effect(tmp_path):
    # `dflash` (argv from the command line) ends a successful command without the interpreter's finalization
    # (seconds after a model was loaded), but threads are joined, atexit handlers run and output is flushed.
    make_store(tmp_path / "store")
    marks = tmp_path / "marks"
    marks.mkdir()
    p = subprocess.run([sys.executable, "-c", _EXIT_HARNESS, str(marks), str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("tail without a newline ") and "3 / 3 committed" in p.stdout
    assert sorted(f.name for f in marks.iterdir()) == ["atexit", "thread"]  # no "finalized": finalization skipped


def test_corrupt_data_never_reads_as_zeros(tmp_path):
    # zarr itself reads a missing chunk as fill_value; our reader must refuse instead.
    import zarr

    store = make_store(tmp_path)
    delete(tmp_path / "shards/00001/features/c.0.0.0")
    assert not np.any(zarr.open_group(str(tmp_path), mode="r")["shards/00001/features"][:64])
    with pytest.raises(CorruptShard, match="missing"):
        store.read_shard(1)
    with pytest.raises(CorruptShard):
        read_sample(store, 1, 0)


def test_inspect_reads_no_chunk_says_so_and_an_unreadable_record_is_not_complete(tmp_path, capsys):
    make_store(tmp_path).mark_complete()
    flip_byte(tmp_path / "shards/00000/features/c.0.0.0")  # inspect cannot see this: it reads records only
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path)])
    text = capsys.readouterr().out
    assert "3 / 3 committed  (complete)" in text and "no chunk was read" in text and "dflash verify" in text
    (tmp_path / "commits/00002.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] is False and info["unreadable_records"] == [2] and info["chunks_checked"] is False
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path)])
    text = capsys.readouterr().out
    assert "(complete)" not in text and "(not complete)" in text and "UNREADABLE" in text
