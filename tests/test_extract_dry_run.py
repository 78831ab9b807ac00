"""The extract plan: --dry-run prints it and writes nothing, its projected bytes match the written store, and
extract refuses a store that would not fit unless --force."""
from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from dflash.errors import StoreError
from dflash.extract import run
from dflash.storage import Store
from test_extract_run import extract_config, one_torch_thread, write_conversations  # noqa: F401


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("plan") / "conv.jsonl", 40, seed=5)


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("codec", ["blosc", "none", "bf16m3", "uq6"])
def test_dry_run_projects_the_written_store_within_5_percent(conversations, tiny_qwen3, tmp_path, capsys, codec):
    out = tmp_path / "store"
    plan = run(extract_config(tiny_qwen3, conversations, out, shard_size=10, codec=codec, dry_run=True))["plan"]
    assert not out.exists(), "a dry run wrote something"
    text = capsys.readouterr().out
    assert "plan of" in text and "projected" in text and "free" in text and "tok/s per device" in text
    assert plan["dropped"] == {"empty_content": 1, "malformed_json": 1, "unknown_role": 1}
    assert plan["free_bytes"] > 0 and plan["extract_s"] is not None
    summary = run(extract_config(tiny_qwen3, conversations, out, shard_size=10, codec=codec))
    assert (plan["samples"], plan["tokens"]) == (summary["samples"], summary["tokens"])
    # The plan printed is the one the run extracted: its shards are the store's.
    assert (plan["rows"], plan["shards"], plan["shards_left"]) == (40, Store.open(str(out)).num_shards, 4)
    assert plan["projected_bytes"] == pytest.approx(store_bytes(out), rel=0.05)


def test_extract_refuses_a_store_larger_than_the_free_space_unless_forced(conversations, tiny_qwen3, tmp_path,
                                                                           monkeypatch):
    from dflash.extract import plan

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    cfg = extract_config(tiny_qwen3, conversations, tmp_path / "store", shard_size=10)
    # The way out it suggests is the codec with fewer bytes, with what it saves and was measured to cost the drafter:
    # from the default uq6, uq4; from the lossless blosc, uq6 and its tau measured on the GPU demo.
    with pytest.raises(StoreError, match=r"needs .* more but .* has 1.00 KB free; pass --codec uq4 \(about 0.31x of "
                                         r"raw bf16; its price in tau is not measured yet\), extract fewer .*--force"):
        run(cfg)
    with pytest.raises(StoreError, match=r"pass --codec uq6 \(about 0.35x of raw bf16; on the GPU demo's drafter "
                                         r"held-out tau_hat .* measured tau .*\), extract fewer .*--force"):
        run(extract_config(tiny_qwen3, conversations, tmp_path / "store", shard_size=10, codec="blosc"))
    with pytest.raises(StoreError, match=r"has 1.00 KB free; extract fewer rows, choose another --out, or "):
        run(extract_config(tiny_qwen3, conversations, tmp_path / "store", shard_size=10, codec="uq4"))
    assert not (tmp_path / "store").exists()
    run(extract_config(tiny_qwen3, conversations, tmp_path / "store", shard_size=10, force=True))
    assert Store.open(str(tmp_path / "store")).is_complete()


@pytest.mark.parametrize("codec", ["blosc", "fp8", "uq6"])
def test_projected_objects_are_the_files_a_shard_commits(tmp_path, codec):
    from dflash.extract.dry_run import _shard_objects
    from dflash.tests.synthetic_shards import write_synthetic_shard

    header = {"layer_ids": [1, 3], "hidden_size": 32, "codec": codec, "shard_plan": {"num_shards": 2}}
    store = Store.create_or_open(str(tmp_path), header, chunk_tokens=64)
    rec = write_synthetic_shard(store, 1, num_samples=4)
    files = [p for p in (tmp_path / "shards/00001").rglob("*") if p.is_file()] + [tmp_path / "commits/00001.json"]
    assert _shard_objects(rec["num_tokens"], store.header, 64) == len(files)
