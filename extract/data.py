"""Conversation inputs: JSONL / JSON / Parquet files or a local `datasets` folder, normalised to chat messages."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..conversations import ROLES, SHAREGPT_ROLES, is_sidecar, message
from ..errors import InputError

__all__ = ["Row", "BadRowLog", "input_files", "read_rows", "fingerprint", "normalise"]

log = logging.getLogger(__name__)

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


@dataclass(frozen=True)
class Row:
    """One source row: its global number, where it came from, and its messages or why it is bad."""

    index: int
    where: str
    messages: list[dict[str, str]] | None = None
    error: str | None = None
    detail: str = ""
    # What was changed to read the row at all (e.g. "invalid_utf8_replaced"); counted in the extract summary.
    notes: tuple[str, ...] = ()


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def input_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """Return the data files behind `--data` values, in a stable order (folders expand to their data files)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            if p.suffix.lower() not in _FILE_SUFFIXES:
                raise InputError(
                    f"--data {raw}: expected a .jsonl, .json or .parquet file or a datasets folder, "
                    f"found a {p.suffix or 'suffix-less'} file; convert it to JSONL"
                )
            out.append(p)
        elif p.is_dir():
            out.extend(_folder_files(p))
        else:
            raise InputError(f"--data {raw}: no such file or folder; check the path")
    return out


def _folder_files(folder: Path) -> list[Path]:
    """Return the data files of a `save_to_disk` folder (state.json order) or of a folder of data files."""
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"--data {folder}: state.json is not a datasets state file ({e!r}); re-save the dataset") from None
        return [folder / n for n in names]
    # `dflash generate` keeps its record beside what it wrote (FILE.config.json): that is not a data file.
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_SUFFIXES
                   and not is_sidecar(p))
    if not found:
        raise InputError(f"--data {folder}: a folder with no .jsonl, .json, .parquet or .arrow files; point --data at the data")
    return found


def fingerprint(files: list[Path]) -> str:
    """Return a blake2b hex digest of the files' names, sizes and bytes, in order: the dataset's identity."""
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


INVALID_UTF8 = "invalid_utf8_replaced"


def _records(path: Path) -> Iterator[tuple[str, Any, tuple[str, ...]]]:
    """Yield (line-or-row label, record or _BadRow, notes) for every row of one file."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                notes: tuple[str, ...] = ()
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    # Kept (a stray byte should not cost a conversation) but counted, never silent.
                    line, notes = raw.decode("utf-8", errors="replace"), (INVALID_UTF8,)
                if not line.strip():
                    continue  # blank lines are not rows (editors leave a trailing one)
                try:
                    yield f"{path}:{lineno}", json.loads(line), notes
                except json.JSONDecodeError as e:
                    yield f"{path}:{lineno}", _BadRow("malformed_json", f"{e.msg} at column {e.colno}"), notes
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"--data {path}: not valid JSON ({e}); fix the file or write it as JSONL") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise InputError(f"--data {path}: expected a JSON list of rows, found {type(data).__name__}")
        for i, rec in enumerate(data):
            yield f"{path}[{i}]", rec, ()
    elif suffix in (".parquet", ".arrow"):
        for i, rec in enumerate(_arrow_rows(path)):
            yield f"{path}[{i}]", rec, ()


def _arrow_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the rows of a Parquet file or of an Arrow stream file (what `datasets.save_to_disk` writes)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"--data {path}: reading Parquet/Arrow needs pyarrow; run `pip install pyarrow`") from None
    try:
        if path.suffix.lower() == ".parquet":
            for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
                yield from batch.to_pylist()
            return
        with pa.memory_map(str(path)) as src:
            try:
                table = pa.ipc.open_stream(src).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(src).read_all()
            rows = table.to_pylist()  # while the map is open: the table's buffers live in it
        yield from rows
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"--data {path}: not a readable {path.suffix[1:]} file ({e}); re-export it") from None


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _BadRow("non_string_content", f"{what} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise _BadRow("empty_content", f"{what} is empty")
    return value


def normalise(rec: Any) -> list[dict[str, str]]:
    """Return the chat messages of one record (messages, ShareGPT or Alpaca shape); raise _BadRow if unusable."""
    if isinstance(rec, _BadRow):
        raise rec
    if not isinstance(rec, dict):
        raise _BadRow("unknown_shape", f"a {type(rec).__name__}, expected an object")
    # Parquet/Arrow give every row every column of the file, None where a row lacks one.
    rec = {k: v for k, v in rec.items() if v is not None}
    if "messages" in rec or "conversations" in rec:
        sharegpt = "messages" not in rec
        turns = rec["conversations"] if sharegpt else rec["messages"]
        if isinstance(turns, str):
            # Parquet and CSV exports often hold the turns as one JSON string column: read it as the list it is.
            try:
                turns = json.loads(turns)
            except json.JSONDecodeError as e:
                raise _BadRow("unknown_shape", f"messages/conversations is a string but not JSON ({e.msg})") from None
        if not isinstance(turns, list) or not turns:
            raise _BadRow("unknown_shape", "messages/conversations is not a non-empty list")
        out = []
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise _BadRow("unknown_shape", f"turn {k} is a {type(turn).__name__}, expected an object")
            if sharegpt or ("from" in turn and "role" not in turn):
                role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
                raw_role, content = turn.get("from"), turn.get("value")
            else:
                raw_role, content = turn.get("role"), turn.get("content")
                role = raw_role if raw_role in ROLES else None
            if role is None:
                raise _BadRow("unknown_role", f"turn {k} has role {raw_role!r}, expected one of {', '.join(ROLES)}")
            out.append(message(role, _text(content, f"turn {k} content")))
    elif "instruction" in rec and "output" in rec:
        prompt = _text(rec["instruction"], "instruction")
        extra = rec.get("input")
        if isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        out = []
        if isinstance(rec.get("system"), str) and rec["system"].strip():
            out.append(message("system", rec["system"]))
        out += [message("user", prompt), message("assistant", _text(rec["output"], "output"))]
    else:
        keys = ", ".join(sorted(map(str, rec))[:6])
        raise _BadRow("unknown_shape", f"keys [{keys}]; expected messages, conversations or instruction+output")
    if not any(m["role"] == "assistant" for m in out):
        raise _BadRow("no_assistant_turn", "no assistant turn to train on")
    return out


def read_rows(paths: tuple[str, ...] | list[str]) -> list[Row]:
    """Return every source row of the inputs, numbered globally from 0, each normalised or marked bad."""
    rows: list[Row] = []
    for f in input_files(paths):
        for where, rec, notes in _records(f):
            try:
                rows.append(Row(len(rows), where, messages=normalise(rec), notes=notes))
            except _BadRow as bad:
                rows.append(Row(len(rows), where, error=bad.reason, detail=bad.detail, notes=notes))
    if not rows:
        raise InputError(f"--data {' '.join(paths)}: no rows found; check the files are not empty")
    return rows


@dataclass
class BadRowLog:
    """Counts of dropped rows by reason, with the first few row numbers of each (for reports and commit extras)."""

    counts: dict[str, int] = field(default_factory=dict)
    rows: dict[str, list[int]] = field(default_factory=dict)

    def add(self, reason: str, row: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.rows.setdefault(reason, []).append(row)

    def to_dict(self) -> dict[str, Any]:
        """Return {"counts": {...}, "rows": {...}}: every dropped row number, so a resumed run loses none."""
        return {"counts": dict(sorted(self.counts.items())), "rows": {k: v for k, v in sorted(self.rows.items())}}
