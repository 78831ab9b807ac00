"""Conversation files, read one way for every stage: which files a path names, their rows numbered globally in file
order (indexed in a first pass, 8 bytes a row; Parquet and Arrow need only their metadata; each row parsed when asked
for), the dataset's fingerprint, and the rows dropped, by reason."""
from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from .formats import READ_BYTES, array_values, arrow_count, arrow_rows, json_kind, jsonl_lines
from .messages import is_sidecar
from .shapes import NEEDS, BadRow, normalise

__all__ = ["Row", "Rows", "BadRowLog", "input_files", "read_rows", "fingerprint", "report_bad_rows", "INVALID_UTF8"]

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz")  # .jsonl.gz: benchmark files ship so (HumanEval)
TEXT_SUFFIXES = (".txt",)
_FILE_SUFFIXES = JSONL_SUFFIXES + (".json", ".parquet", ".arrow") + TEXT_SUFFIXES


def _suffix(path: Path) -> str:
    """Return the suffix that names a file's format (".jsonl.gz" counts as one)."""
    name = path.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else path.suffix.lower()


INVALID_UTF8 = "invalid_utf8_replaced"


@dataclass(frozen=True)
class Row:
    """One source row: its global number, where it came from, and its messages or why it cannot be used."""

    index: int
    where: str
    messages: list[dict[str, str]] | None = None
    error: str | None = None
    detail: str = ""
    # What was changed to read the row at all (invalid UTF-8 replaced, empty turns skipped); counted, never silent.
    notes: tuple[str, ...] = ()


# -- files ---------------------------------------------------------------------------------------------------------

def input_files(paths: tuple[str, ...] | list[str], flag: str = "--data") -> list[Path]:
    """Return the data files behind the given paths, in a stable order (folders expand to their data files)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            if _suffix(p) not in _FILE_SUFFIXES:
                raise InputError(
                    f"{flag} {raw}: expected a .jsonl, .json, .parquet, .arrow or .txt file or a datasets folder, "
                    f"found a {p.suffix or 'suffix-less'} file; rename it (.txt: one prompt a line) or convert it "
                    "to JSONL"
                )
            out.append(p)
        elif p.is_dir():
            out.extend(_folder_files(p, flag))
        else:
            raise InputError(f"{flag} {raw}: no such file or folder; check the path")
    return out


def _folder_files(folder: Path, flag: str) -> list[Path]:
    """Return the data files of a `save_to_disk` folder (state.json order) or of a folder of data files."""
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{flag} {folder}: state.json is not a datasets state file ({e!r}); re-save the "
                             "dataset") from None
        return [folder / n for n in names]
    # `dflash generate` keeps its record beside what it wrote (FILE.config.json): that is not a data file.
    found = sorted(p for p in folder.rglob("*") if p.is_file() and _suffix(p) in _FILE_SUFFIXES
                   and not is_sidecar(p))
    if not found:
        raise InputError(f"{flag} {folder}: a folder with no .jsonl, .json, .parquet, .arrow or .txt files; point "
                         f"{flag} at the data")
    return found


def fingerprint(files: list[Path]) -> str:
    """Return a blake2b hex digest of the files' names, sizes and bytes, in order: the dataset's identity."""
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(READ_BYTES):
                h.update(chunk)
    return h.hexdigest()


# -- the index: where each row of a file starts ----------------------------------------------------------------------

class _FileRows:
    """The rows of one file: how many, and each one's record (parsed when asked for)."""

    def __init__(self, path: Path, flag: str) -> None:
        self.path, self.flag = path, flag
        suffix = _suffix(path)
        self.kind = ("jsonl" if suffix in JSONL_SUFFIXES else "text" if suffix in TEXT_SUFFIXES
                     else "arrow" if suffix in (".parquet", ".arrow") else json_kind(path, flag))
        self.offsets = array("q")
        self.lines = array("q")
        if self.kind in ("jsonl", "text"):
            for lineno, offset, raw in jsonl_lines(path):
                if raw.strip():  # blank lines are not rows (editors leave a trailing one)
                    self.offsets.append(offset)
                    self.lines.append(lineno)
            self.count = len(self.offsets)
        elif self.kind == "array":
            for offset, _ in array_values(path, flag):
                self.offsets.append(offset)
            self.count = len(self.offsets)
        else:
            self.count = arrow_count(path, flag)

    def records(self, start: int, stop: int) -> Iterator[tuple[str, Any, tuple[str, ...]]]:
        """Yield (where, record or BadRow, notes) of rows start..stop-1 of this file."""
        if start >= stop:
            return
        if self.kind in ("jsonl", "text"):
            yield from self._line_records(start, stop)
        elif self.kind == "array":
            for i, (_, rec) in enumerate(array_values(self.path, self.flag, self.offsets[start]), start):
                if i >= stop:
                    break
                yield f"{self.path}[{i}]", rec, ()
        else:
            for i, rec in enumerate(arrow_rows(self.path, self.flag, start, stop), start):
                yield f"{self.path}[{i}]", rec, ()

    def _line_records(self, start: int, stop: int) -> Iterator[tuple[str, Any, tuple[str, ...]]]:
        i = start
        first_line = self.lines[start]
        for k, (_, _, raw) in enumerate(jsonl_lines(self.path, self.offsets[start])):
            if i >= stop:
                break
            if not raw.strip():
                continue
            where = f"{self.path}:{first_line + k}"
            notes: tuple[str, ...] = ()
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                # Kept (a stray byte should not cost a conversation) but counted, never silent.
                line, notes = raw.decode("utf-8", errors="replace"), (INVALID_UTF8,)
            i += 1
            if self.kind == "text":
                yield where, line.strip(), notes
                continue
            try:
                yield where, json.loads(line), notes
            except json.JSONDecodeError as e:
                yield where, BadRow("malformed_json", f"{e.msg} at column {e.colno}"), notes


# -- rows -----------------------------------------------------------------------------------------------------------

class Rows(Sequence):
    """The rows of conversation files, numbered globally from 0 in file order, parsed when asked for.

    `rows[i]` and `rows[a:b]` (a list) read those rows alone; iterating streams every row once.
    """

    def __init__(self, paths: tuple[str, ...] | list[str], *, flag: str = "--data", need: str = "assistant") -> None:
        assert need in NEEDS, need
        self.paths, self.flag, self.need = tuple(paths), flag, need
        self.files = input_files(paths, flag)
        self._parts = [_FileRows(f, flag) for f in self.files]
        self._starts = [0]
        for part in self._parts:
            self._starts.append(self._starts[-1] + part.count)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            assert step == 1, "rows are read in ranges"
            return list(self._range(start, stop))
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError(key)
        return next(self._range(i, i + 1))

    def __iter__(self) -> Iterator[Row]:
        return self._range(0, len(self))

    def _range(self, start: int, stop: int) -> Iterator[Row]:
        for k, part in enumerate(self._parts):
            lo, hi = max(start, self._starts[k]), min(stop, self._starts[k + 1])
            if lo >= hi:
                continue
            for n, (where, rec, notes) in enumerate(part.records(lo - self._starts[k], hi - self._starts[k]), lo):
                yield self._row(n, where, rec, notes)

    def _row(self, index: int, where: str, rec: Any, notes: tuple[str, ...]) -> Row:
        try:
            messages, more = normalise(rec, self.need)
        except BadRow as bad:
            return Row(index, where, error=bad.reason, detail=bad.detail, notes=notes)
        return Row(index, where, messages=messages, notes=notes + more)


def read_rows(paths: tuple[str, ...] | list[str], *, flag: str = "--data", need: str = "assistant") -> Rows:
    """Return the rows of the inputs (indexed, parsed on demand); InputError if the files hold no row at all."""
    rows = Rows(paths, flag=flag, need=need)
    if not len(rows):
        raise InputError(f"{flag} {' '.join(map(str, paths))}: no rows found; check the files are not empty")
    return rows


@dataclass
class BadRowLog:
    """Counts of dropped rows by reason, with the first few row numbers of each (for reports and commit extras)."""

    counts: dict[str, int] = field(default_factory=dict)
    rows: dict[str, list[int]] = field(default_factory=dict)
    first: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, row: int, where: str = "", detail: str = "", shown: int = 5) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.rows.setdefault(reason, []).append(row)
        if where and len(self.first.setdefault(reason, [])) < shown:
            self.first[reason].append(f"row {row} ({where}: {detail})")

    def to_dict(self) -> dict[str, Any]:
        """Return {"counts": {...}, "rows": {...}}: every dropped row number, so a resumed run loses none."""
        return {"counts": dict(sorted(self.counts.items())), "rows": {k: v for k, v in sorted(self.rows.items())}}

    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """Return the counts as "reason: n, ..." text."""
        return ", ".join(f"{reason}: {n:,}" for reason, n in sorted(self.counts.items()))


def report_bad_rows(bad: BadRowLog, what: str = "rows") -> None:
    """Log one warning per reason: how many rows were skipped for it and the first few of them by name."""
    for reason, n in sorted(bad.counts.items()):
        shown = bad.first.get(reason, [])
        log.warning("%d bad %s (%s), skipped: %s%s", n, what, reason, "; ".join(shown),
                    "; ..." if n > len(shown) else "")
