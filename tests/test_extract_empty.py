"""Nothing to train on is an error, not a success: data without a usable row, and a store of 0 samples."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.config import TrainConfig
from dflash.errors import InputError, StoreError
from dflash.extract import run
from dflash.storage import Store
from test_extract_run import extract_config, one_torch_thread, store_samples  # noqa: F401

CHAT = [{"role": "user", "content": "count please"}, {"role": "assistant", "content": "one two three four five six"}]


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _jsonl_list(path: Path) -> Path:
    path.write_text("[1]\n")
    return path


def _binary(path: Path) -> Path:
    import random

    rng = random.Random(0)
    path.write_bytes(bytes(rng.randrange(256) for _ in range(4000)))
    return path


def _prompt_answer(path: Path) -> Path:
    return _parquet(path, {"prompt": ["count please", "again"], "answer": ["one two three", "four five"]})


@pytest.mark.parametrize("make, name, reason", [
    (_jsonl_list, "rows.jsonl", "unknown_shape"),
    (_binary, "blob.jsonl", "malformed_json"),
    # {"prompt"} is a prompt (generate answers it); with an unknown answer column there is nothing to train on.
    (_prompt_answer, "pa.parquet", "no_assistant_turn"),
])
def test_data_without_a_usable_row_is_refused_naming_the_reasons(make, name, reason, tiny_qwen3, tmp_path):
    data = make(tmp_path / name)
    out = tmp_path / "store"
    with pytest.raises(InputError, match=rf"none of its [\d,]+ rows is usable \({reason}: [\d,]+\)"):
        run(extract_config(tiny_qwen3, data, out))
    assert not out.exists(), "a refused run left a store behind"


def test_parquet_messages_as_json_strings_are_parsed(tiny_qwen3, tmp_path):
    data = _parquet(tmp_path / "m.parquet", {"messages": [json.dumps(CHAT)] * 3 + ["not json"]})
    summary = run(extract_config(tiny_qwen3, data, tmp_path / "store"))
    assert summary["samples"] == 3 and summary["dropped"] == {"unknown_shape": 1}
    assert sorted(store_samples(tmp_path / "store")) == [0, 1, 2]


def test_a_store_of_zero_samples_is_an_error_for_extract_and_train(tiny_qwen3, tmp_path):
    from dflash import train

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(5)) + "\n")
    out = tmp_path / "store"
    # Every row reads, none keeps enough loss tokens: the store is made, and holds nothing.
    with pytest.raises(InputError, match=r"no row became a sample \(too_few_loss_tokens: 5\)"):
        run(extract_config(tiny_qwen3, data, out, min_loss_tokens=1000))
    store = Store.open(str(out))
    assert len(store.committed_ids()) == store.num_shards and sum(len(store.sample_lengths(s)) for s in
                                                                  store.committed_ids()) == 0
    with pytest.raises(StoreError, match="hold 0 samples .* nothing to train on"):
        train.run(TrainConfig(store=str(out), target=str(tiny_qwen3), out=str(tmp_path / "run"), gpus="cpu",
                              epochs=1, batch_tokens=512, draft_layers=1, block_size=8, dtype="float32",
                              val_fraction=0.0))
    assert not (tmp_path / "run" / "checkpoints").exists()
