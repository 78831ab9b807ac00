"""One reader of conversation files for every stage: one table of formats and shapes, one line rule, streaming."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.conversations import EMPTY_TURNS, formats, jsonl_lines, read_rows
from dflash.errors import InputError
from dflash.generate.prompts import read_prompts

# Every character str.splitlines() takes for a line end that is text inside a JSON string.
LINE_LIKE = "a\u2028b\u2029c\u0085d\ve\ff\x1cg\x1dh\x1ei"

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": f"Say {LINE_LIKE} back."}, {"role": "assistant", "content": f"{LINE_LIKE}!"}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red, é€😀."}],
]
_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


def _openai(conv):
    return {"messages": conv}


def _sharegpt(conv):
    return {"id": "x", "conversations": [{"from": _SHAREGPT[m["role"]], "value": m["content"]} for m in conv]}


def _jsonl(path: Path, recs) -> Path:
    # ensure_ascii=False: the line-like characters are written raw, as `dflash demo` and many exports write them
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    return path


def _json_array(path: Path, recs) -> Path:
    path.write_text(json.dumps(recs, ensure_ascii=False, indent=2), encoding="utf-8")
    return path


def _parquet(path: Path, recs) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    key = "messages" if "messages" in recs[0] else "conversations"
    pq.write_table(pa.table({key: [json.dumps(r[key], ensure_ascii=False) for r in recs]}), path, row_group_size=2)
    return path


def _datasets_folder(path: Path, recs) -> Path:
    pa = pytest.importorskip("pyarrow")
    path.mkdir()
    key = "messages" if "messages" in recs[0] else "conversations"
    table = pa.table({key: [r[key] for r in recs]})
    with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=2):
                w.write_batch(batch)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return path


WRITERS = {"jsonl": (_jsonl, ".jsonl"), "json-array": (_json_array, ".json"), "parquet": (_parquet, ".parquet"),
           "datasets": (_datasets_folder, "")}


@pytest.mark.parametrize("shape", [_openai, _sharegpt], ids=["openai", "sharegpt"])
@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_format_and_shape_gives_the_same_rows_to_extract_and_generate(tmp_path, fmt, shape):
    write, suffix = WRITERS[fmt]
    path = write(tmp_path / f"data{suffix}", [shape(c) for c in CONVERSATIONS])
    rows = read_rows([str(path)])
    assert [r.messages for r in rows] == CONVERSATIONS
    assert [r.error for r in rows] == [None] * 3
    # generate reads the same rows: the same turns less the assistant's, which it regenerates
    prompts = read_prompts(path)
    assert [p.messages for p in prompts] == [[m for m in c if m["role"] != "assistant"] for c in CONVERSATIONS]
    assert [p.turns for p in prompts] == [1, 1, 2]
    # ranges read alone equal the stream
    assert [r.messages for r in rows[1:3]] == CONVERSATIONS[1:] and rows[2].index == 2


def test_jsonl_lines_split_on_newline_alone(tmp_path):
    path = tmp_path / "p.jsonl"
    first = json.dumps({"prompt": LINE_LIKE}, ensure_ascii=False).encode()  # U+2028 & co raw, \v escaped
    path.write_bytes(first + b'\r\n\n{"prompt": "two"}')
    assert [(n, raw) for n, _, raw in jsonl_lines(path)] == [(1, first), (2, b""), (3, b'{"prompt": "two"}')]
    assert [p.messages[0]["content"] for p in read_prompts(path)] == [LINE_LIKE, "two"]


def test_plain_text_lines_split_on_newline_alone(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(f"{LINE_LIKE}\nsecond\n", encoding="utf-8")
    assert [p.messages for p in read_prompts(path)] == [[{"role": "user", "content": LINE_LIKE}],
                                                         [{"role": "user", "content": "second"}]]


def test_streaming_across_read_boundaries(tmp_path, monkeypatch):
    """Rows and their offsets are right when values straddle the reader's chunks (64 bytes here, not 4 MiB)."""
    monkeypatch.setattr(formats, "READ_BYTES", 64)
    recs = [_sharegpt(CONVERSATIONS[i % 3]) | {"n": i, "f": 1.5e-3 * i} for i in range(40)]
    for path in (_json_array(tmp_path / "a.json", recs), _jsonl(tmp_path / "a.jsonl", recs)):
        rows = read_rows([str(path)])
        assert len(rows) == 40
        assert [r.messages for r in rows] == [CONVERSATIONS[i % 3] for i in range(40)]
        assert [r.messages for r in rows[17:23]] == [CONVERSATIONS[i % 3] for i in range(17, 23)]


def test_json_data_key_and_sharegpt_roles(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": [{"conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
        {"from": "tool", "value": "42"}, {"from": "gpt", "value": ""}, {"from": "gpt", "value": "done"}]}]}))
    (row,) = read_rows([str(path)])
    assert [m["role"] for m in row.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert row.notes == (EMPTY_TURNS,)  # the empty reply is skipped, and says so


def test_text_parts_are_joined_and_other_parts_are_a_bad_row(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": "c"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                      {"role": "assistant", "content": "c"}]},
    ])
    rows = list(read_rows([str(path)]))
    assert rows[0].messages[0]["content"] == "ab"
    assert rows[1].error == "non_text_content"


def test_a_broken_json_array_names_the_byte(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a"} {"prompt": "b"}]')
    with pytest.raises(InputError, match=r"d.json: not valid JSON \(expected a comma or the closing \] at byte 17\)"):
        read_rows([str(path)])


def _two_arrays(path: Path, sep: str) -> Path:
    """What `cat a.json b.json > all.json` makes: two arrays back to back."""
    first = json.dumps([_openai(c) for c in CONVERSATIONS], indent=2)
    path.write_text(first + sep + json.dumps([_openai(c) for c in CONVERSATIONS[:2]]), encoding="utf-8")
    return path


@pytest.mark.parametrize("sep", ["", "\n", "\n\n  "])
def test_two_arrays_back_to_back_are_refused_naming_the_byte_for_every_stage(tmp_path, sep):
    path = _two_arrays(tmp_path / "all.json", sep)
    at = len(json.dumps([_openai(c) for c in CONVERSATIONS], indent=2).encode()) + len(sep)
    match = rf"all.json: expected only whitespace after the JSON array of rows, found more text at byte {at} "
    with pytest.raises(InputError, match=match):
        read_rows([str(path)])  # extract
    with pytest.raises(InputError, match=match):
        read_prompts(path)  # generate --prompts
    from dflash.tests.tiny_targets import build_tokenizer
    from dflash.decode.prompt_eval import prompt_ids

    with pytest.raises(InputError, match=match):
        prompt_ids(str(path), build_tokenizer("chatml"))  # eval --prompts


@pytest.mark.parametrize("tail", ["x", "]", "{}", "// a comment"])
def test_any_text_after_the_array_is_refused_and_whitespace_is_not(tmp_path, tail):
    body = json.dumps([_openai(c) for c in CONVERSATIONS])
    path = tmp_path / "d.json"
    path.write_text(body + " \n" + tail, encoding="utf-8")
    with pytest.raises(InputError, match=rf"found more text at byte {len(body.encode()) + 2} "):
        read_rows([str(path)])
    path.write_text(body + " \r\n\t\n", encoding="utf-8")
    assert [r.messages for r in read_rows([str(path)])] == CONVERSATIONS


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "pretty"])
def test_a_wrapper_object_is_read_whatever_the_order_of_its_keys(tmp_path, indent, monkeypatch):
    monkeypatch.setattr(formats, "READ_BYTES", 32)  # values straddle the reader's chunks
    rows = [_sharegpt(c) for c in CONVERSATIONS] * 4
    path = tmp_path / "w.json"
    for wrapper in ({"version": 1, "meta": {"source": "é" * 40, "n": [1, 2.5e-3]}, "data": rows, "after": None},
                    {"data": rows, "version": 1}):
        path.write_text(json.dumps(wrapper, indent=indent, ensure_ascii=False), encoding="utf-8")
        got = read_rows([str(path)])
        assert [r.messages for r in got] == CONVERSATIONS * 4
        assert [r.messages for r in got[5:8]] == (CONVERSATIONS * 4)[5:8]
    path.write_text(json.dumps({"version": 1, "rows": rows}, indent=2), encoding="utf-8")
    with pytest.raises(InputError, match=r'w.json: expected a JSON array of rows or an object with a "data" array'):
        read_rows([str(path)])
    path.write_text(json.dumps({"data": rows}, indent=2) + json.dumps({"data": rows}, indent=2), encoding="utf-8")
    with pytest.raises(InputError, match="expected only whitespace after the JSON object of rows, found more text"):
        read_rows([str(path)])


def test_json_lines_in_a_json_file_are_still_rows(tmp_path):
    path = tmp_path / "l.json"
    path.write_text("".join(json.dumps(_openai(c)) + "\n" for c in CONVERSATIONS), encoding="utf-8")
    assert [r.messages for r in read_rows([str(path)])] == CONVERSATIONS
    # A first row that happens to hold a "data" list is a row like the others when rows follow it.
    path.write_text(json.dumps({"data": [1]} | _openai(CONVERSATIONS[0])) + "\n" + json.dumps(_openai(CONVERSATIONS[1])))
    assert [r.messages for r in read_rows([str(path)])] == CONVERSATIONS[:2]
