"""Input formats and normalisation: JSONL, JSON, Parquet, a datasets folder; bad rows by reason and row number."""
from __future__ import annotations

import json

import pytest

from dflash.errors import InputError
from dflash.conversations import fingerprint, input_files, read_rows

MESSAGES = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SHAREGPT = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
ALPACA = {"instruction": "add", "input": "1 and 2", "output": "3"}


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_shapes_normalise_to_messages(tmp_path):
    rows = read_rows([_jsonl(tmp_path / "a.jsonl", [MESSAGES, SHAREGPT, ALPACA])])
    assert [r.error for r in rows] == [None, None, None]
    assert rows[0].messages == MESSAGES["messages"]
    assert rows[1].messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert rows[2].messages == [{"role": "user", "content": "add\n\n1 and 2"}, {"role": "assistant", "content": "3"}]


@pytest.mark.parametrize(
    "record, reason",
    [
        ('{"messages": [', "malformed_json"),
        ({"text": "plain"}, "unknown_shape"),
        ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown_role"),
        # A turn with no text is skipped (and counted as a note): here that leaves nothing to train on.
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 7}]}, "non_string_content"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
        ([1, 2], "unknown_shape"),
    ],
)
def test_bad_rows_are_marked_with_reason_and_row(tmp_path, record, reason):
    rows = read_rows([_jsonl(tmp_path / "d.jsonl", [MESSAGES, record, MESSAGES])])
    assert [r.error for r in rows] == [None, reason, None]
    assert rows[1].index == 1 and rows[1].where.endswith("d.jsonl:2")


def test_rows_are_numbered_across_files_and_formats(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    a = _jsonl(tmp_path / "a.jsonl", [MESSAGES, "", ALPACA])  # the blank line is not a row
    (tmp_path / "b.json").write_text(json.dumps([SHAREGPT]))
    pq.write_table(pa.Table.from_pylist([ALPACA, ALPACA]), tmp_path / "c.parquet")
    rows = read_rows([a, str(tmp_path / "b.json"), str(tmp_path / "c.parquet")])
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert all(r.error is None for r in rows)
    assert rows[2].where.endswith("b.json[0]") and rows[4].where.endswith("c.parquet[1]")


def test_datasets_save_to_disk_folder(tmp_path):
    pa = pytest.importorskip("pyarrow")
    folder = tmp_path / "ds"
    folder.mkdir()
    other = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "3"}]}
    table = pa.Table.from_pylist([MESSAGES, other])
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text("{}")
    rows = read_rows([str(folder)])
    assert [r.messages[-1]["content"] for r in rows] == ["hello", "3"]


def test_missing_and_unsupported_inputs_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        input_files([str(tmp_path / "nope.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="found a .csv file"):
        input_files([str(tmp_path / "x.csv")])
    (tmp_path / "bad.json").write_text("[{not json")
    with pytest.raises(InputError, match="bad.json: not valid JSON"):
        list(read_rows([str(tmp_path / "bad.json")]))
    # A .json file that does not start an array (nor an object cut short at the end of its first line) is JSON
    # Lines: its bad line is a bad row, counted like any other.
    (tmp_path / "lines.json").write_text("{not json\n")
    assert [r.error for r in read_rows([str(tmp_path / "lines.json")])] == ["malformed_json"]


def test_fingerprint_follows_content(tmp_path):
    a = tmp_path / "a.jsonl"
    _jsonl(a, [MESSAGES])
    before = fingerprint([a])
    assert fingerprint([a]) == before
    _jsonl(a, [MESSAGES, ALPACA])
    assert fingerprint([a]) != before
