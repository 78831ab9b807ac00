"""Conversation files, read one way for every stage: which files, which rows, and each row's chat messages.

`dflash generate`, `extract`, `eval`, the demo and `run` all read their inputs here, so one file means the same rows
everywhere. Formats: JSONL (lines split on "\\n" alone: U+2028, U+0085, \\v and friends are text inside a JSON
string, not line ends), one JSON array (or {"data": [...]}), Parquet, Arrow (IPC stream or file), a `datasets`
save_to_disk folder, and plain text (one prompt a line). Shapes: OpenAI `messages`, ShareGPT `conversations`
(`from`/`value`), Alpaca `instruction`/`output`, `{"prompt"}`, and a bare JSON string (a prompt).

Files are streamed: a first pass indexes where every row starts (8 bytes a row; Parquet and Arrow need only their
metadata), and rows are parsed when asked for, so a multi-GB file is never held in memory.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import logging
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .messages import ROLES, SHAREGPT_ROLES, is_sidecar, message
from ..errors import InputError

__all__ = ["Row", "Rows", "BadRowLog", "input_files", "read_rows", "fingerprint", "normalise", "jsonl_lines",
           "report_bad_rows", "prompt_turns", "INVALID_UTF8", "EMPTY_TURNS"]

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz")  # .jsonl.gz: benchmark files ship so (HumanEval)
TEXT_SUFFIXES = (".txt",)
_FILE_SUFFIXES = JSONL_SUFFIXES + (".json", ".parquet", ".arrow") + TEXT_SUFFIXES


def _suffix(path: Path) -> str:
    """Return the suffix that names a file's format (".jsonl.gz" counts as one)."""
    name = path.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else path.suffix.lower()


def _open(path: str | Path) -> Any:
    """Return the file opened for binary reading (a .gz file decompressed; its offsets are of the plain bytes)."""
    import gzip

    return gzip.open(path, "rb") if str(path).lower().endswith(".gz") else open(path, "rb")
# What a row needs to be usable: a conversation to train on has an assistant turn; a prompt has a user turn.
NEEDS = ("assistant", "user")

INVALID_UTF8 = "invalid_utf8_replaced"
EMPTY_TURNS = "empty_turns_skipped"
_READ = 1 << 22


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


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


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
            while chunk := fh.read(_READ):
                h.update(chunk)
    return h.hexdigest()


def jsonl_lines(path: str | Path, start: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """Yield (1-based line number counted from `start`, byte offset, line without its "\\n") of a file, streamed.

    Lines end at "\\n" alone (a "\\r" before it is dropped): the one line rule of every JSONL file dflash reads or
    writes. Python's str.splitlines() also splits at U+2028, U+0085, \\v, \\f and \\x1c-\\x1e, which are text.
    """
    with _open(path) as f:
        f.seek(start)
        offset, lineno, tail = start, 0, b""
        while chunk := f.read(_READ):
            parts = (tail + chunk).split(b"\n")
            tail = parts.pop()
            for raw in parts:
                lineno += 1
                yield lineno, offset, raw[:-1] if raw.endswith(b"\r") else raw
                offset += len(raw) + 1
        if tail:
            yield lineno + 1, offset, tail[:-1] if tail.endswith(b"\r") else tail


# -- the index: where each row of a file starts ----------------------------------------------------------------------

class _FileRows:
    """The rows of one file: how many, and each one's record (parsed when asked for)."""

    def __init__(self, path: Path, flag: str) -> None:
        self.path, self.flag = path, flag
        suffix = _suffix(path)
        self.kind = ("jsonl" if suffix in JSONL_SUFFIXES else "text" if suffix in TEXT_SUFFIXES
                     else "arrow" if suffix in (".parquet", ".arrow") else _json_kind(path, flag))
        self.offsets = array("q")
        self.lines = array("q")
        if self.kind in ("jsonl", "text"):
            for lineno, offset, raw in jsonl_lines(path):
                if raw.strip():  # blank lines are not rows (editors leave a trailing one)
                    self.offsets.append(offset)
                    self.lines.append(lineno)
            self.count = len(self.offsets)
        elif self.kind == "array":
            for offset, _ in _array_values(path, flag):
                self.offsets.append(offset)
            self.count = len(self.offsets)
        else:
            self.count = _arrow_count(path, flag)

    def records(self, start: int, stop: int) -> Iterator[tuple[str, Any, tuple[str, ...]]]:
        """Yield (where, record or _BadRow, notes) of rows start..stop-1 of this file."""
        if start >= stop:
            return
        if self.kind in ("jsonl", "text"):
            yield from self._line_records(start, stop)
        elif self.kind == "array":
            for i, (_, rec) in enumerate(_array_values(self.path, self.flag, self.offsets[start]), start):
                if i >= stop:
                    break
                yield f"{self.path}[{i}]", rec, ()
        else:
            for i, rec in enumerate(_arrow_rows(self.path, self.flag, start, stop), start):
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
                yield where, _BadRow("malformed_json", f"{e.msg} at column {e.colno}"), notes


def _json_kind(path: Path, flag: str) -> str:
    """Return "array" for a .json file holding one JSON array (or an object with a "data" array), "jsonl" for JSON
    Lines.

    A JSON Lines row is one line: an object that spans lines is a wrapper ({"version": 1, "data": [...]}), and so is
    a one-line object with a "data" array that is the whole file. A first line that reads as an object of its own
    followed by more rows is JSON Lines.
    """
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        return "array"
    if not head.startswith(b"{"):
        raise InputError(f"{flag} {path}: expected a JSON array of rows (or JSON Lines), found a file starting with "
                         f"{head[:20]!r}; fix the file or write it as JSONL")
    first, end = _first_line(path)
    if end < 0:
        return "array"  # a first line too long for a row: the wrapper's rules
    try:
        text = first.decode("utf-8").rstrip()
        row = json.loads(text)
    except UnicodeDecodeError:
        return "jsonl"
    except json.JSONDecodeError as e:
        # Cut short at the line's end: an object over several lines (the wrapper). Wrong before it: a bad row.
        return "array" if e.pos >= len(text) else "jsonl"
    if not (isinstance(row, dict) and isinstance(row.get("data"), list)):
        return "jsonl"
    with open(path, "rb") as f:  # a one-line object with a "data" array: a wrapper only if nothing follows it
        f.seek(end)
        while chunk := f.read(_READ):
            if chunk.strip():
                return "jsonl"
    return "array"


def _first_line(path: Path, cap: int = 64 << 20) -> tuple[bytes, int]:
    """Return a file's first non-blank line (without a BOM and its "\\n") and the byte offset past it; (b"", -1) if
    it is longer than `cap` (no row is that long)."""
    with open(path, "rb") as f:
        buf, base = b"", 0
        while True:
            chunk = f.read(_READ)
            buf += chunk
            while (nl := buf.find(b"\n")) >= 0:
                line = buf[:nl].lstrip(b"\xef\xbb\xbf")
                if line.strip():
                    return line, base + nl + 1
                base, buf = base + nl + 1, buf[nl + 1:]
            if not chunk:
                return buf.lstrip(b"\xef\xbb\xbf"), base + len(buf)
            if len(buf) > cap:
                return b"", -1


class _JsonStream:
    """A JSON file read in chunks: the next character past whitespace, one value decoded at a time, and the byte
    offset of the position (each character is encoded once to count it)."""

    def __init__(self, f: Any, path: Path, flag: str, offset: int) -> None:
        self.f, self.path, self.flag = f, path, flag
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        # buf[mark] lies at byte mark_byte of the file.
        self.buf, self.pos, self.mark, self.mark_byte = "", 0, 0, offset
        self.eof = False

    def more(self) -> bool:
        """Read the next chunk into the buffer; return False at the end of the file."""
        chunk = self.f.read(_READ)
        try:
            text = self.utf8.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            raise InputError(f"{self.flag} {self.path}: not valid UTF-8 ({e.reason}); fix the file or write it as "
                             "JSONL") from None
        if self.mark > _READ:  # drop what was read, keeping mark's byte count
            self.byte()
            self.buf, self.pos, self.mark = self.buf[self.mark:], self.pos - self.mark, 0
        self.buf += text
        self.eof = not chunk
        return bool(chunk)

    def byte(self) -> int:
        """Return the byte offset of the position in the file."""
        self.mark_byte += len(self.buf[self.mark:self.pos].encode("utf-8"))
        self.mark = self.pos
        return self.mark_byte

    def peek(self) -> str:
        """Return the next character past JSON whitespace ("" at the end of the file), without taking it."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos:self.pos + 1]

    def take(self, char: str, what: str) -> None:
        """Take `char` as the next character, or raise InputError naming `what` was expected."""
        if self.peek() != char:
            raise self.bad(what)
        self.pos += 1

    def value(self) -> Any:
        """Return the next JSON value, decoded whole."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # a number at the buffer's end may go on in the next chunk
                    self.pos = end
                    return value
            except json.JSONDecodeError:
                if self.eof:
                    raise self.bad("a JSON value") from None
            self.more()

    def bad(self, what: str) -> InputError:
        return InputError(f"{self.flag} {self.path}: not valid JSON (expected {what} at byte {self.byte()}); fix the "
                          "file or write it as JSONL")

    def elements(self, *, opened: bool) -> Iterator[tuple[int, Any]]:
        """Yield (byte offset, value) of an array's elements up to its closing "]"; opened: the position is just
        past the "[" (else at an element, as an earlier pass yielded it)."""
        if opened and self.peek() == "]":
            self.pos += 1
            return
        while True:
            if self.peek() == "":
                raise self.bad("more elements or the closing ]")
            yield self.byte(), self.value()
            if self.peek() == "]":
                self.pos += 1
                return
            self.take(",", "a comma or the closing ]")


def _array_values(path: Path, flag: str, offset: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (byte offset, value) of the rows of a .json file, streamed: the elements of its array, or of the "data"
    array of an object (its other keys in any order); from `offset` when given (an element's start, as an earlier
    pass yielded it). The first pass reads the file whole: after the array (or object), only whitespace may follow.
    """
    with open(path, "rb") as f:
        if offset is not None:
            f.seek(offset)
            yield from _JsonStream(f, path, flag, offset).elements(opened=False)
            return
        s = _JsonStream(f, path, flag, 0)
        s.peek()
        if s.buf.startswith("\ufeff", s.pos):
            s.pos += 1
        top = s.peek()
        if top == "[":
            s.pos += 1
            yield from s.elements(opened=True)
        elif top == "{":  # {"data": [...]} and its kin ({"version": 1, "data": [...]}): the rows' key
            s.pos += 1
            found = False
            while s.peek() != "}":
                if s.peek() != '"':
                    raise s.bad("a key")
                key = s.value()
                s.take(":", "a colon")
                if key == "data" and not found and s.peek() == "[":
                    s.pos += 1
                    yield from s.elements(opened=True)
                    found = True
                else:
                    s.value()
                if s.peek() != "}":
                    s.take(",", "a comma or the closing }")
                    if s.peek() == "}":
                        raise s.bad("a key")
            s.pos += 1
            if not found:
                raise InputError(f"{flag} {path}: expected a JSON array of rows or an object with a \"data\" array, "
                                 "found an object without one; fix the file or write it as JSONL")
        else:
            raise s.bad("a JSON array")
        if s.peek() != "":
            raise InputError(
                f"{flag} {path}: expected only whitespace after the JSON {'array' if top == '[' else 'object'} of rows, found more text at byte "
                f"{s.byte()} (two arrays back to back?); join the rows into one array or write them as JSONL")


def _arrow(path: Path, flag: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{flag} {path}: reading Parquet/Arrow needs pyarrow; run `pip install pyarrow`") from None
    return pa, pq


def _arrow_count(path: Path, flag: str) -> int:
    pa, pq = _arrow(path, flag)
    try:
        if path.suffix.lower() == ".parquet":
            return pq.ParquetFile(path).metadata.num_rows
        with pa.memory_map(str(path)) as src:
            return _arrow_table(pa, src).num_rows
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{flag} {path}: not a readable {path.suffix[1:]} file ({e}); re-export it") from None


def _arrow_table(pa: Any, src: Any) -> Any:
    # save_to_disk writes the IPC stream format; memory-mapped, read_all() references the map instead of copying.
    try:
        return pa.ipc.open_stream(src).read_all()
    except pa.ArrowInvalid:
        src.seek(0)
        return pa.ipc.open_file(src).read_all()


def _arrow_rows(path: Path, flag: str, start: int, stop: int) -> Iterator[dict[str, Any]]:
    """Yield rows start..stop-1 of a Parquet file (by row group) or an Arrow file (memory-mapped)."""
    pa, pq = _arrow(path, flag)
    try:
        if path.suffix.lower() == ".parquet":
            pf = pq.ParquetFile(path)
            first = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if first + n > start and first < stop:
                    table = pf.read_row_group(g)
                    lo = max(start, first) - first
                    for k in range(lo, min(stop - first, n), 4096):
                        yield from table.slice(k, min(4096, min(stop - first, n) - k)).to_pylist()
                first += n
                if first >= stop:
                    return
            return
        with pa.memory_map(str(path)) as src:
            table = _arrow_table(pa, src)
            for k in range(start, stop, 4096):
                # Converted while the map is open: the table's buffers live in it.
                yield from table.slice(k, min(4096, stop - k)).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{flag} {path}: not a readable {path.suffix[1:]} file ({e}); re-export it") from None


# -- shapes ---------------------------------------------------------------------------------------------------------

def _text(value: Any, what: str) -> str | None:
    """Return a turn's text ('' when it has none), or raise _BadRow for content that is not text."""
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts: text parts are joined, anything else is not text
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(value) or not all(isinstance(t, str) for t in texts):
            raise _BadRow("non_text_content", f"{what} holds non-text parts")
        return "".join(texts)
    if not isinstance(value, str):
        raise _BadRow("non_string_content", f"{what} is {type(value).__name__}, expected a string")
    return value


def _turns(rec: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """Return the (role, text) turns of a messages/conversations record and the roles of the empty turns skipped."""
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
    out: list[tuple[str, str]] = []
    empty: list[str] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRow("unknown_shape", f"turn {k} is a {type(turn).__name__}, expected an object")
        if "role" not in turn and "from" in turn:
            raw_role, content = turn.get("from"), turn.get("value")
            role = SHAREGPT_ROLES.get(str(raw_role).lower())
        else:
            raw_role, content = turn.get("role"), turn.get("content")
            role = raw_role if raw_role in ROLES else None
        if role is None:
            raise _BadRow("unknown_role", f"turn {k} has role {raw_role!r}, expected one of {', '.join(ROLES)} "
                                          "(ShareGPT: human, gpt, system, tool)")
        text = _text(content, f"turn {k} content")
        if text.strip():
            out.append((role, text))
        else:
            empty.append(role)  # a turn with no text (an assistant's bare tool call, an empty reply): nothing to learn
    return out, empty


def normalise(rec: Any, need: str = "assistant") -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """Return the chat messages of one record and what was changed to read it; raise _BadRow if it is unusable.

    need: "assistant" (a conversation to train on needs an assistant turn) or "user" (a prompt needs a user turn).
    """
    if isinstance(rec, _BadRow):
        raise rec
    if isinstance(rec, str):
        rec = {"prompt": rec}
    if not isinstance(rec, dict):
        raise _BadRow("unknown_shape", f"a {type(rec).__name__}, expected an object")
    # Parquet/Arrow give every row every column of the file, None where a row lacks one.
    rec = {k: v for k, v in rec.items() if v is not None}
    notes: tuple[str, ...] = ()
    empty: list[str] = []
    if "messages" in rec or "conversations" in rec:
        turns, empty = _turns(rec)
        if empty:
            notes = (EMPTY_TURNS,)
    elif "instruction" in rec and ("output" in rec or need == "user"):
        prompt = _text(rec["instruction"], "instruction")
        extra = rec.get("input")
        if isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        system = rec.get("system")
        turns = [("system", system)] if isinstance(system, str) and system.strip() else []
        turns += [("user", prompt)]
        if "output" in rec:
            turns.append(("assistant", _text(rec["output"], "output")))
        turns = [(r, t) for r, t in turns if t.strip()]
    elif "prompt" in rec:
        text = _text(rec["prompt"], "prompt")
        turns = [("user", text)] if text.strip() else []
    else:
        keys = ", ".join(sorted(map(str, rec))[:6])
        raise _BadRow("unknown_shape", f"keys [{keys}]; expected messages, conversations, instruction+output or "
                                       "prompt")
    if not turns:
        raise _BadRow("empty_content", "no turn has any text")
    if not any(r == need for r, _ in turns):
        if need in empty:
            raise _BadRow("empty_content", f"every {need} turn is empty")
        raise _BadRow(f"no_{need}_turn", f"no {need} turn" + (" to train on" if need == "assistant" else
                                                                " to answer"))
    return [message(r, t) for r, t in turns], notes


def prompt_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Return the turns of a conversation that a regeneration keeps: everything but the assistant's."""
    return [m for m in messages if m["role"] != "assistant"]


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
        except _BadRow as bad:
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
