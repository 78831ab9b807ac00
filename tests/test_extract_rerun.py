"""Reruns of `dflash extract` on a store that is not what it seems: a lost header, a copied model, leftovers of
killed runs, a run refused before its first shard."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.errors import ConfigError, CorruptShard, InputError, ManifestMismatch
from dflash.extract import run
from dflash.storage import Store
from dflash.storage.layout import dumps, record_digest
from dflash.storage.summary import verify_store
from test_extract_run import data_file, extract_config, one_torch_thread, store_samples  # noqa: F401


def test_shards_of_another_header_are_refused_and_verify_flags_them(tiny_qwen3, data_file, tmp_path):
    out = tmp_path / "store"
    run(extract_config(tiny_qwen3, data_file, out))  # layers auto: [1, 2, 3, 4, 5] on 8 layers
    n = Store.open(str(out)).num_shards
    (out / "zarr.json").unlink()
    # Another header must not adopt shards that were captured at layer 5 under a header that says layer 6.
    with pytest.raises(ManifestMismatch, match=rf"has no zarr.json but {n} commit records written under another header"):
        run(extract_config(tiny_qwen3, data_file, out, layers=(1, 2, 3, 4, 6)))
    assert not (out / "zarr.json").exists()
    # The same settings recreate the very header the shards were written under: they are adopted, all sound.
    run(extract_config(tiny_qwen3, data_file, out))
    assert Store.open(str(out)).is_complete() and verify_store(str(out)) == (n, [])
    # A header swapped by hand: every shard reads as written under another one, and verify says so by path.
    meta = json.loads((out / "zarr.json").read_text())
    meta["attributes"]["dflash"]["layer_ids"] = [1, 2, 3, 4, 6]
    (out / "zarr.json").write_text(json.dumps(meta))
    checked, bad = verify_store(str(out))
    assert checked == n and len(bad) == n and all("written under another header" in b for b in bad)
    with pytest.raises(CorruptShard, match="commits/00000.json: shard 0 was written under another header"):
        Store.open(str(out)).read_shard(0)


def test_records_older_than_header_binding_stay_readable(tiny_qwen3, data_file, tmp_path):
    out = tmp_path / "store"
    run(extract_config(tiny_qwen3, data_file, out))
    want = store_samples(out)
    for path in (out / "commits").glob("*.json"):  # what a store written before this change holds
        rec = json.loads(path.read_text())
        del rec["header_xxh3"]
        rec["record_xxh3"] = record_digest(rec)
        path.write_bytes(dumps(rec))
    store = Store.open(str(out))
    assert verify_store(str(out)) == (store.num_shards, []) and sorted(store_samples(out)) == sorted(want)
    (out / "zarr.json").unlink()  # unbound records cannot prove their header: a recreated one refuses them
    with pytest.raises(ManifestMismatch, match="header xxh3 none"):
        run(extract_config(tiny_qwen3, data_file, out))


def test_a_store_from_before_target_fingerprints_resumes(tiny_qwen3, data_file, tmp_path):
    out = tmp_path / "store"
    run(extract_config(tiny_qwen3, data_file, out))
    want = store_samples(out)
    meta = json.loads((out / "zarr.json").read_text())  # the header such a store has
    header = meta["attributes"]["dflash"]
    del header["informational"], header["target"]["fingerprint"], header["kernels"], header["runtime"]
    (out / "zarr.json").write_text(json.dumps(meta))
    for path in (out / "commits").glob("*.json"):
        rec = json.loads(path.read_text())
        del rec["header_xxh3"]
        rec["record_xxh3"] = record_digest(rec)
        path.write_bytes(dumps(rec))
    assert Store.open(str(out)).withdraw(1)
    run(extract_config(tiny_qwen3, data_file, out))
    store = Store.open(str(out))
    assert store.is_complete() and "fingerprint" not in store.header["target"]
    assert verify_store(str(out)) == (store.num_shards, []) and sorted(store_samples(out)) == sorted(want)


def test_a_copied_or_moved_target_is_the_same_target(tiny_qwen3, data_file, tmp_path):
    from dflash.tests.tiny_targets import build_tiny_target

    out = tmp_path / "store"
    run(extract_config(tiny_qwen3, data_file, out))
    assert Store.open(str(out)).withdraw(1)  # as if the run had been killed before shard 1
    copy = shutil.copytree(tiny_qwen3, tmp_path / "elsewhere" / "model")
    moved = copy.rename(tmp_path / "moved")
    run(extract_config(moved, data_file, out))
    store = Store.open(str(out))
    assert store.is_complete() and store.header["target"]["path"] == os.path.abspath(tiny_qwen3)
    # Same config, other weights: not the same target, whatever its folder is called.
    other = build_tiny_target(tmp_path / "other", "qwen3", seed=1)
    store.withdraw(1)
    with pytest.raises(ManifestMismatch, match="target.fingerprint"):
        run(extract_config(other, data_file, out))


def test_refused_runs_leave_no_store_and_a_skeleton_is_replaced(tiny_qwen3, data_file, tmp_path):
    import torch

    from dflash.extract.header import build_header
    from dflash.extract.plan import scan_rows

    out = tmp_path / "store"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--gpus 99"):
            run(extract_config(tiny_qwen3, data_file, out, gpus="99"))
        assert not out.exists()
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_qwen3, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(InputError, match="expected weights .* found none"):
        run(extract_config(no_weights, data_file, out))
    assert not out.exists()
    # A skeleton (header, no shard: a run killed while loading the model) gives way to a run with other options.
    from transformers import AutoConfig, AutoTokenizer

    from dflash.conversations import read_rows

    first = extract_config(tiny_qwen3, data_file, out, layers=(1, 2))
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    Store.create_or_open(str(out), build_header(first, AutoConfig.from_pretrained(tiny_qwen3), tok,
                                                 tok.chat_template, scan_rows(read_rows(first.data), first.max_length)))
    run(extract_config(tiny_qwen3, data_file, out))
    store = Store.open(str(out))
    assert store.is_complete() and store.header["layer_ids"] == [1, 2, 3, 4, 5]


_DIE_HOLDING = r"""
import os, sys
from dflash.storage import Store, claims
from dflash.storage.layout import claim_path
store = Store.open(sys.argv[1])
claims.acquire(store.fs, 0)  # killed between shard 0's commit record and the claim's release
lock = store.fs.path(claim_path(1)) + ".takeover-abc.partial"  # killed while taking over a stale claim
open(lock, "w").write('{"host": "%s", "pid": %d}' % (claims.HOST, os.getpid()))
print("holding", flush=True)
sys.stdin.read()
"""


def test_rerun_collects_what_killed_runs_left_and_nothing_live(tiny_qwen3, data_file, tmp_path):
    out = tmp_path / "store"
    cfg = extract_config(tiny_qwen3, data_file, out)
    run(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dead = subprocess.Popen([sys.executable, "-c", _DIE_HOLDING, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert dead.stdout.readline().strip() == "holding"
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", _DIE_HOLDING.replace("(store.fs, 0)", "(store.fs, 2)")
                             .replace("claim_path(1)", "claim_path(3)"), str(out)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert live.stdout.readline().strip() == "holding"
        hour_ago = time.time() - 3600
        old = [out / "commits/.00001.json.999.abcdef01.partial", out / ".zarr.json.999.abcdef02.partial"]
        for p in old:
            p.write_text("{")
            os.utime(p, (hour_ago, hour_ago))
        fresh = out / "commits/.00002.json.1000.abcdef03.partial"  # a live writer's record before its rename
        fresh.write_text("{")
        assert (out / "claims/00000.json").exists() and (out / "claims/00001.json.takeover-abc.partial").exists()
        run(cfg)  # every shard is committed: nothing to redo, but the rerun cleans up
        assert not (out / "claims/00000.json").exists(), "the dead writer's claim is still there"
        assert not (out / "claims/00001.json.takeover-abc.partial").exists()
        assert not any(p.exists() for p in old) and fresh.exists()
        assert (out / "claims/00002.json").exists() and (out / "claims/00003.json.takeover-abc.partial").exists()
    finally:
        live.stdin.close()
        live.wait(timeout=30)
    assert Store.open(str(out)).is_complete()


def test_the_store_records_how_generate_made_its_data_and_an_older_store_resumes_without_it(tiny_qwen3, tmp_path):
    from dflash.conversations import sidecar_path
    from dflash.storage.layout import header_digest
    from test_extract_run import write_conversations

    (tmp_path / "data").mkdir()
    data = write_conversations(tmp_path / "data" / "answers.jsonl", 18)
    made = {"model": "/m", "dtype": "bfloat16", "engine": "fast", "device": "cuda", "temperature": 0.0,
            "max_new_tokens": 256, "seed": 0, "batch_size": 1024}
    sidecar_path(data).write_text(json.dumps(made))  # what `dflash generate --out answers.jsonl` leaves beside it
    out = tmp_path / "store"
    # A folder of generate's output: its record is not read as a data file.
    run(extract_config(tiny_qwen3, data.parent, out))
    header = Store.open(str(out)).header
    assert header["dataset"]["files"] == ["answers.jsonl"] and header["dataset"]["rows"] == 18
    assert header["dataset"]["generated_by"] == {"answers.jsonl": {k: v for k, v in made.items() if k != "batch_size"}}
    want = store_samples(out)
    # Regenerated records say something else: shown, never a mismatch (the data file is the same).
    sidecar_path(data).write_text(json.dumps({**made, "dtype": "float32"}))
    assert Store.open(str(out)).withdraw(1)
    run(extract_config(tiny_qwen3, data.parent, out))
    assert sorted(store_samples(out)) == sorted(want)
    # A store written before the record existed: its header and its records' digests never had it.
    meta = json.loads((out / "zarr.json").read_text())
    old = meta["attributes"]["dflash"]
    del old["dataset"]["generated_by"], old["kernels"], old["runtime"]
    old["informational"] = ["target.path"]
    (out / "zarr.json").write_text(json.dumps(meta))
    for path in (out / "commits").glob("*.json"):
        rec = json.loads(path.read_text())
        rec["header_xxh3"] = header_digest(Store.open(str(out)).header)
        rec["record_xxh3"] = record_digest(rec)
        path.write_bytes(dumps(rec))
    assert Store.open(str(out)).withdraw(2)
    run(extract_config(tiny_qwen3, data.parent, out))
    store = Store.open(str(out))
    assert store.is_complete() and "generated_by" not in store.header["dataset"]
    assert verify_store(str(out)) == (store.num_shards, []) and sorted(store_samples(out)) == sorted(want)
